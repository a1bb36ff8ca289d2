"""Routing replay through multi-turn trajectories (``rollout.routing_replay``): every policy turn's routed experts,
stitched onto the trajectory by the turn loop, replayed in the trainer's forward over the whole trajectory.

The tiny Qwen3-VL-MoE (float32 vLLM engine on the CPU, routing captured) runs three-turn episodes of an environment
that answers with images. Checked: the stitched routing has a row per token the engine ran (prompt and
observations included), the unperturbed trainer routes every (token, layer) as the engine did, and the trajectory
rows carry it. Then the trainer's routers are perturbed (a stand-in for a real engine's numeric drift): without
replay (the control) the policy tokens' log-probs move far from the engine's; with the engine's routing replayed,
the gap shrinks to what the perturbed gate weights alone cause.
"""

from __future__ import annotations

import pytest
import torch

from mmrlhf.agents.loop_types import AgentLimits
from mmrlhf.agents.rollout import AgentLoop
from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.types import ToolContext
from mmrlhf.algorithms.moe import routing_agreement
from mmrlhf.experience.agent_rows import encoder_of, rows_from_trajectories
from mmrlhf.experience.samples import build_padded_samples
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.routing import find_routers
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir

from agent_testing import Colours, colour, load_tools_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~30 s: a MoE engine with routing capture, three turns
pytest.importorskip("vllm")

FAMILY = "qwen3_vl_moe"
DRIFT = 0.05  # relative noise on the trainer's router weights (flips near-tie tokens' experts)


def _gap(out, samples) -> float:
    """max |trainer - engine| log-prob over every policy token."""
    worst = 0.0
    for i, s in enumerate(samples):
        mask = torch.tensor(s.policy_mask, dtype=torch.bool)
        engine = torch.tensor(s.engine_logprobs)[mask]
        worst = max(worst, float((out.log_probs[i, : len(mask)][mask] - engine).abs().max()))
    return worst


def test_agent_trajectories_carry_and_replay_the_engines_routing():
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    model, processor, adapter, data = load_tools_model(FAMILY)
    tok = processor.tokenizer
    engine = VLLMEngine(str(tiny_model_dir(FAMILY, tools=True)), adapter, max_model_len=1024, dtype="float32",
                        limit_mm_per_prompt={"image": 6}, routing_replay="replay")
    runner = ToolRunner({}, workers=2, timeout_s=10, max_image_pixels=10**7)
    loop = AgentLoop(engine, tok, adapter, encoder_of(data),
                     AgentLimits(max_turns=3, max_context_tokens=1024, max_new_tokens_per_turn=8, max_images=6),
                     [tok.eos_token_id], runner, environment=Colours)
    image = colour((200, 40, 40), (112, 84))
    batch = data.process_multimodal_batch(["<image>What color?"], [[image]], ["red"], n_samples_per_prompt=3,
                                          record_ids=["r"])
    words = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white", "<|im_end|>")
    keep = {tok.convert_tokens_to_ids(t) for t in words}
    forbidden = tuple(i for i in range(len(tok)) if i not in keep)
    sampling = SamplingSettings(n=3, temperature=1.0, max_new_tokens=8, seed=5, forbidden_token_ids=forbidden)
    try:
        result = loop.run(batch, 3, sampling, [ToolContext(record={"id": "r"}, images=[image])])
    finally:
        engine.close()
        runner.close()
    samples = result.samples
    text = model.config.text_config
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        assert s.trajectory.num_turns >= 2  # several turns, observations (images) between them
        routed = s.routed_experts
        # one row per token any turn ran: all but the last token when a turn ends the trajectory
        ran = len(ids) - 1 if s.policy_mask[-1] else len(ids)
        assert routed.shape == (ran, text.num_hidden_layers, text.num_experts_per_tok), (routed.shape, len(ids))
        assert int(routed.min()) >= 0 and int(routed.max()) < text.num_experts
    rows = rows_from_trajectories(batch, result)
    assert [r.shape for r in rows.routed_experts] == [s.routed_experts.shape for s in samples]

    built = build_padded_samples([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                 pad_id=tok.pad_token_id, eos_id=(), adapter=adapter,
                                 vision=[s.vision for s in samples], response_masks=[s.policy_mask for s in samples],
                                 routed_experts=rows.routed_experts)
    excluded = sorted(set(forbidden) | set(adapter.vision_special_token_ids()))
    with torch.no_grad():
        own = ActorVL(model, adapter, excluded_token_ids=excluded)(built.samples, vision_extra=built.vision_extra,
                                                                   return_routing=True)
    trainer = own.routing.stacked(text.num_hidden_layers)  # [B*S, L, k]
    agree = routing_agreement(built.samples.routed_experts.reshape(trainer.shape), trainer)
    assert agree["set"] == 1.0 and agree["pairs"] > 100, agree  # the stitched rows are the trainer's routing
    assert _gap(own, samples) < 1e-4

    routers = find_routers(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in routers.values():
            m.weight.add_(DRIFT * m.weight.abs().mean() * torch.randn(m.weight.shape, generator=g))
        control = ActorVL(model, adapter, excluded_token_ids=excluded)(built.samples,
                                                                       vision_extra=built.vision_extra)
        replay = ActorVL(model, adapter, excluded_token_ids=excluded, routing_replay="replay")(
            built.samples, vision_extra=built.vision_extra)
    gap_control, gap_replay = _gap(control, samples), _gap(replay, samples)
    drifted = ActorVL(model, adapter, excluded_token_ids=excluded)(built.samples, vision_extra=built.vision_extra,
                                                                   return_routing=True).routing.stacked(
                                                                       text.num_hidden_layers)
    flipped = routing_agreement(built.samples.routed_experts.reshape(drifted.shape), drifted)
    print(f"agent trajectories: {flipped}, gap without replay {gap_control:.4g}, with replay {gap_replay:.4g}")
    assert flipped["set"] < 1.0  # the drift flipped some experts (measured: 4.3% of (token, layer) sets)
    assert gap_control > 0.005  # measured 0.0145
    assert gap_replay < gap_control / 10  # measured 5.6e-4


def test_the_critic_replays_the_engines_routing():
    """``rollout.routing_replay=replay`` reaches the critic (``build_critic``): its values follow the routing the
    rows carry. Rows carrying the critic's own routing give the values it computes without replay; the same rows
    with every expert choice moved to another expert (the control) give other values."""
    from mmrlhf.config import build_config
    from mmrlhf.trainer.builder import build_critic

    path = tiny_model_dir(FAMILY)
    config = build_config({}, [f"model.pretrain={path}", "algorithm.advantage_estimator=gae",
                               "rollout.routing_replay=replay", "trainer.device=cpu", "model.dtype=float32"])
    critic = build_critic(config)
    assert critic.body.routing_replay == "replay"
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))  # a zero head says nothing
    adapter = critic.body.adapter
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    words = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts, responses = [words("what color is the square"), words("how many")], [words("red"), words("two three")]
    plain = build_padded_samples(prompts, responses, pad_id=0, eos_id=(), adapter=adapter)
    from mmrlhf.models.critic import CriticVL

    routing_itself = CriticVL(ActorVL(critic.body.model, adapter), value_head=critic.value_head)
    text = critic.body.model.config.text_config
    with torch.no_grad():
        traced = critic.body(plain.samples, return_routing=True)
        own = traced.routing.stacked(text.num_hidden_layers).reshape(*plain.samples.sequences.shape, -1,
                                                                     text.num_experts_per_tok)  # [B, S, L, k]
        rows = [own[i, : len(p) + len(r)] for i, (p, r) in enumerate(zip(prompts, responses))]
        moved = [(r + 1) % text.num_experts for r in rows]  # every choice another expert
        values = routing_itself(plain.samples)  # [B, A]
        same = critic(build_padded_samples(prompts, responses, pad_id=0, eos_id=(), adapter=adapter,
                                           routed_experts=rows).samples)
        other = critic(build_padded_samples(prompts, responses, pad_id=0, eos_id=(), adapter=adapter,
                                            routed_experts=moved).samples)
    mask = plain.samples.action_mask
    scale = float(values[mask].abs().max())
    assert scale > 0
    assert float((same - values)[mask].abs().max()) < 1e-5 * scale + 1e-6
    assert float((other - same)[mask].abs().max()) > 1e-3 * scale
