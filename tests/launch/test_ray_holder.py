"""A Ray rollout actor holds the producer every launch mode uses (``LocalRollouts``, made by ``local_rollouts``):
it only positions the prompt stream at the step it is asked for and seeds the maker per (step, actor). Built here as
the plain class the driver wraps with ``ray.remote`` (no Ray needed), over the transformers engine."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _config(out: Path, *overrides: str) -> dict:
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}", f"trainer.output_dir={out}",
        "rollout.engine=transformers", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4",
        "trainer.rollout_batch_size=4", "trainer.train_batch_size=8", "trainer.micro_train_batch_size=4",
        "rollout.micro_rollout_batch_size=8", "trainer.eval_steps=0", "trainer.progress_bar=false",
        *overrides]).model_dump(mode="json")


def test_a_rollout_actor_produces_its_share_of_the_step_it_is_asked_for(tmp_path):
    from mmrlhf.config import build_config
    from mmrlhf.data.stream import PromptStream
    from mmrlhf.experience.rollout import ScoringDistribution
    from mmrlhf.experience.wire import unpack_items
    from mmrlhf.launch.ray.holder import ExperienceMakerHolder
    from mmrlhf.rollout.types import SamplingSettings
    from mmrlhf.trainer.builder import build_prompt_source
    from mmrlhf.trainer.rollouts import LocalRollouts

    config = _config(tmp_path, "data.restart_stream_on_resume=true")
    holder = ExperienceMakerHolder(config, index=1, count=2, threads=1)
    assert isinstance(holder.producer, LocalRollouts) and holder.producer.s.share == (1, 2)
    assert not holder.producer.sleeps  # weights arrive by push: nothing would wake a sleeping engine
    # the factory's stream, so the data keys apply as in every other mode (this one was once left out)
    assert holder.stream.restart_on_change is True

    meta, payload = holder.generate(step=2, min_version=0)
    items = unpack_items(payload["items"])  # columnar on the wire
    cfg = build_config(config)
    stream = PromptStream(build_prompt_source(cfg), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    for _ in range(3):  # steps 0, 1 and 2 of 4 prompts each: the stream where step 3 begins
        share = stream.next_batch(4)[1::2]
    assert meta["samples"] == len(items) == 2 * len(share)  # this actor's share of step 2, n = 2 each
    assert meta["stream"] == stream.state_dict()
    assert meta["distribution"] == ScoringDistribution.of(SamplingSettings(temperature=cfg.rollout.temperature,
                                                                           top_p=cfg.rollout.top_p))
    # computed once by the producer: the rollout's, its groups' variance and the experiences' batch statistics
    assert {"reward/mean", "groups/with_variance_frac", "advantage_clip_frac"} <= set(meta["metrics"])

    # positioned and seeded by step, not by what it generated before: a restarted actor regenerates a lost step
    other, _ = holder.generate(step=3, min_version=0)
    again_meta, again = holder.generate(step=2, min_version=0, report=True)
    assert again_meta["stream"] == meta["stream"] != other["stream"]
    for a, b in zip(items, unpack_items(again["items"]), strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids
        assert all(torch.equal(a.vision[k], b.vision[k]) for k in a.vision)
    # a report step's payload carries what the trainer's report shows of the share (the rollout stays here): the
    # first trainer.report_groups groups as plain samples, pickled like the rest; other steps carry none
    assert payload["report"] is None and "report" not in again_meta  # the driver's metadata stays small
    shown = pickle.loads(pickle.dumps(again["report"]))
    groups = cfg.trainer.report_groups
    assert len(shown) == min(groups, len(share)) * 2 and len({s.group for s in shown}) == min(groups, len(share))
    texts = holder.tokenizer.batch_decode([it.response_ids for it in items[:len(shown)]], skip_special_tokens=True)
    assert [s.response for s in shown] == texts
    assert [s.reward for s in shown] == [float(it.info["reward"]) for it in items[:len(shown)]]
    assert all(s.advantage is not None and len(s.images) == 1 for s in shown)
