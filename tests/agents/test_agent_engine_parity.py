"""Engine vs trainer on multi-turn trajectories with images in two or more observations, per family: the vLLM
engine (float32 on the CPU) samples every turn, an environment answers each with an image, and ActorVL scores the
whole trajectory in every layout at the sampling temperature; the policy tokens' log-probs agree within
FP32_TOLERANCE. Control: the same trajectories with one observation image's pixels changed must not. And the
trajectories do not depend on the loop (asynchronous or lockstep) or on how its requests are split into engine
calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmrlhf.agents.loop_types import AgentLimits
from mmrlhf.agents.rollout import AgentLoop
from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.types import ToolContext
from mmrlhf.experience.agent_rows import encoder_of
from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.actor import ActorVL
from mmrlhf.rollout.types import GenerationResult, SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import FP32_TOLERANCE

from agent_testing import Colours, colour, load_tools_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~25 s per family: engine start, three turns, three layouts
pytest.importorskip("vllm")

T = 0.7


def _diffs(actor, pieces, layout, vision):
    build = {"padded": build_padded_samples, "packed": build_packed_samples, "grouped": build_grouped_samples}[layout]
    built = build([s.prompt_ids for s in pieces], [s.response_ids for s in pieces], pad_id=0, eos_id=(),
                  adapter=actor.adapter, vision=vision, response_masks=[s.policy_mask for s in pieces])
    with torch.no_grad():
        out = actor(built.samples, vision_extra=built.vision_extra, temperature=T)
    worst = []
    for i, s in enumerate(pieces):
        mask = torch.tensor(s.policy_mask, dtype=torch.bool)
        assert torch.equal(out.action_mask[i, : len(mask)], mask)
        engine = torch.tensor(s.engine_logprobs)[mask]
        worst.append(float((out.log_probs[i, : len(mask)][mask] - engine).abs().max()))
    return worst


class OneByOne:
    """The engine asked for each request of a call alone, the last first (what a loop that does not wait for the
    other trajectories sends it)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, 0

    def generate(self, requests, settings):
        outputs, skipped = [], {}
        for i in reversed(range(len(requests))):
            got = self.engine.generate([requests[i]], settings)
            self.calls += 1
            outputs += [dataclasses.replace(o, request_index=i) for o in got.outputs]
            skipped.update({i: reason for reason in got.skipped.values()})
        return GenerationResult(sorted(outputs, key=lambda o: o.request_index), skipped)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_multi_turn_log_probs_match_the_engine(family):
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    model, processor, adapter, data = load_tools_model(family)
    engine = VLLMEngine(str(tiny_model_dir(family, tools=True)), adapter, max_model_len=1024, dtype="float32",
                        limit_mm_per_prompt={"image": 6})
    loop = AgentLoop(engine, processor.tokenizer, adapter, encoder_of(data),
                     AgentLimits(max_turns=3, max_context_tokens=1024, max_new_tokens_per_turn=16, max_images=6),
                     [processor.tokenizer.eos_token_id], ToolRunner({}, workers=2, timeout_s=10, max_image_pixels=10**7),
                     environment=Colours)
    image, other = colour((200, 40, 40), (112, 84)), colour((40, 40, 200), (84, 112))
    batch = data.process_multimodal_batch(["<image>What color?"] * 2, [[image], [other]], ["red", "blue"],
                                          n_samples_per_prompt=3, record_ids=["r", "s"])
    contexts = [ToolContext(record={"id": "r"}, images=[image]), ToolContext(record={"id": "s"}, images=[other])]
    # A vocabulary of three tokens (two words, the end of turn): turns end by themselves within the cap. Both sides
    # sample / score that restricted distribution (with the vision tokens, which are never sampled).
    tok = processor.tokenizer
    keep = {tok.convert_tokens_to_ids(t) for t in ("red", "blue", "<|im_end|>")}
    forbidden = tuple(i for i in range(model.config.text_config.vocab_size) if i not in keep)
    sampling = SamplingSettings(n=3, temperature=T, max_new_tokens=16, seed=5, forbidden_token_ids=forbidden)
    result = loop.run(batch, 3, sampling, contexts)  # the asynchronous loop (the default), over vLLM's stream
    # The same step lockstep, lockstep in waves of one group, lockstep with every engine call split into one call per
    # trajectory (last first), and asynchronous with a pool of one group (agent.max_concurrent_trajectories): the
    # trajectories are the same (each turn's seed is its trajectory's), whatever the timing or the batching.
    def variant(**limits):
        return AgentLoop(engine, processor.tokenizer, adapter, encoder_of(data),
                         dataclasses.replace(loop.limits, **limits), [processor.tokenizer.eos_token_id], loop.runner,
                         environment=Colours)

    lockstep = variant(loop="lockstep")
    runs = [lockstep.run(batch, 3, sampling, contexts),
            variant(loop="lockstep", max_concurrent_trajectories=3).run(batch, 3, sampling, contexts),
            variant(max_concurrent_trajectories=3).run(batch, 3, sampling, contexts)]
    lockstep.engine = OneByOne(engine)
    runs.append(lockstep.run(batch, 3, sampling, contexts))
    engine.close()
    assert lockstep.engine.calls > 6 and len({len(s.response_ids) for s in result.samples}) > 1
    for other_run in runs:
        for s, a in zip(result.samples, other_run.samples, strict=True):
            assert s.response_ids == a.response_ids and s.policy_mask == a.policy_mask
            assert max(abs(x - y) for x, y in zip(s.engine_logprobs, a.engine_logprobs)) < FP32_TOLERANCE
            assert torch.equal(s.vision["pixel_values"], a.vision["pixel_values"])
    pieces = result.samples
    for s in pieces:  # the prompt's image, reset's, then one per step: images in two or more observations
        assert s.vision["image_grid_thw"].shape[0] >= 3, s.trajectory.ended
    actor = ActorVL(model, adapter, excluded_token_ids=sorted(set(forbidden) | set(adapter.vision_special_token_ids())))
    vision = [s.vision for s in pieces]
    for layout in ("padded", "packed", "grouped"):
        worst = _diffs(actor, pieces, layout, vision)
        assert max(worst) < FP32_TOLERANCE, (layout, worst)
    # Control: the last observation image of every trajectory brightened; the policy tokens after it must move.
    changed = []
    for v in vision:
        v = dict(v)
        last_rows = int(v["image_grid_thw"][-1].prod())
        pixels = v["pixel_values"].clone()
        pixels[-last_rows:] += 1.0
        v["pixel_values"] = pixels
        changed.append(v)
    assert min(_diffs(actor, pieces, "padded", changed)) > FP32_TOLERANCE
