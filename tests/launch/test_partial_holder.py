"""Partial rollouts in a rollout actor (``ExperienceMakerHolder`` as the plain class the driver wraps with
``ray.remote``; the transformers engine): an update whose last chunk arrives during a generation is applied at the
next segment boundary and its sender released then; every token records its version; a checkpoint's segment versions
replay the batch exactly (the control replays other versions); an idle actor applies an update at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _config(out: Path) -> dict:
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}", f"trainer.output_dir={out}",
        "rollout.engine=transformers", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=6",
        "trainer.rollout_batch_size=4", "trainer.train_batch_size=8", "trainer.micro_train_batch_size=4",
        "rollout.micro_rollout_batch_size=8", "trainer.eval_steps=0", "trainer.progress_bar=false",
        "distributed.backend=ray", "distributed.max_staleness=1", "rollout.partial=true",
        "rollout.partial_segment_tokens=2"]).model_dump(mode="json")


def _items(payload):
    from mmrlhf.experience.wire import unpack_items

    return unpack_items(payload["items"])


def test_an_update_during_a_generation_lands_at_a_segment_boundary_and_replays_exactly(tmp_path):
    from mmrlhf.launch.ray.holder import ExperienceMakerHolder

    holder = ExperienceMakerHolder(_config(tmp_path), index=0, count=1, threads=1)
    v0 = holder.scoring_weights()
    gen = torch.Generator().manual_seed(0)
    v1 = {n: t + 0.05 * t.std().nan_to_num(1.0) * torch.randn(t.shape, generator=gen) for n, t in v0.items()}
    as_chunk = lambda w: [(f"policy.{n}", t) for n, t in w.items()]  # noqa: E731
    gate, sent, seen = holder.boundary, {}, []

    def boundary(call, segment):
        if (call, segment) == (0, 1):  # the trainer's push arrives while segment 0 is generated
            def push():
                sent["returned"] = holder.update_experience_maker(as_chunk(v1), version=1, last=True)
                sent["at"] = time.perf_counter()

            sender = threading.Thread(target=push)
            sender.start()
            while not holder._pending:  # queued, not applied: this generation holds the lock
                time.sleep(0.001)
            sent["thread"] = sender
            seen.append(holder.version)
        version = gate(call, segment)
        seen.append(version)
        return version

    holder.boundary = boundary
    meta, payload = holder.generate(step=0, min_version=0)
    sent["thread"].join(timeout=60)
    assert sent["returned"] == 1 and holder.version == 1
    assert seen[:3] == [0, 0, 1]  # still 0 when the push arrived; 1 from the boundary on
    plan = meta["segment_versions"]
    assert plan[0][:2] == [0, 1] and set(plan[0][1:]) == {1}
    assert meta["version"] == 0  # the oldest token's: what the staleness bound reads
    items = _items(payload)
    spanning = 0
    for it in items:
        v = it.token["rollout_versions"][it.token["loss_mask"]]
        assert v[:2].eq(0).all() and v[2:].eq(1).all(), v
        spanning += int(v.numel() > 2)
    assert spanning >= len(items) // 2, spanning  # the tiny model rarely stops within 6 tokens
    # the actor's own engine-vs-scoring check reads the newest version's tokens only (its copy holds version 1)
    assert meta["metrics"]["engine_logprob_diff/max"] < 1e-4, meta["metrics"]["engine_logprob_diff/max"]

    # A resume: the checkpoint's plan and versions regenerate the same batch
    holder.boundary = gate
    holder._apply(as_chunk(v0), "full")
    holder.version = 0
    replay = {"segments": plan, "weights": {0: as_chunk(v0), 1: as_chunk(v1)}, "kind": "full"}
    again_meta, again = holder.generate(step=0, min_version=0, replay=replay)
    assert again_meta["segment_versions"] == plan and holder.version == 1
    for a, b in zip(items, _items(again), strict=True):
        assert a.response_ids == b.response_ids
        assert torch.equal(a.token["rollout_versions"], b.token["rollout_versions"])
        assert torch.allclose(a.token["rollout_log_probs"], b.token["rollout_log_probs"], rtol=0, atol=1e-6)
    # Control: the same seeds with version 0 throughout differ from the second segment on
    holder._apply(as_chunk(v0), "full")
    holder.version = 0
    flat = {"segments": [[0] * len(plan[0])], "weights": {0: as_chunk(v0)}, "kind": "full"}
    _, other = holder.generate(step=0, min_version=0, replay=flat)
    gaps = [float((a.token["rollout_log_probs"][2:] - b.token["rollout_log_probs"][2:]).abs().max())
            for a, b in zip(items, _items(other)) if a.response_ids[:3] == b.response_ids[:3] and
            len(a.response_ids) > 2]
    assert gaps and max(gaps) > 1e-3, gaps

    # An idle actor (no generation holds the lock) applies an update at once
    assert holder.update_experience_maker(as_chunk(v1), version=2, last=True) == 2 and holder.version == 2
    assert all(torch.equal(holder.scoring_weights()[n], v1[n]) for n in v1)


def test_agent_trajectories_continue_across_an_update_and_replay_exactly(tmp_path):
    """The agent toy (zoom tool, two turns of up to two tokens) in a rollout actor with ``rollout.partial`` and
    segments of one token: an update pushed during the first turn's first segment lands at the next boundary, so a
    trajectory's first token is version 0 and everything after it version 1 (its second token, the zoom's turn);
    every engine call of every turn records its segments' versions, and a checkpoint's plan regenerates the same
    trajectories (the turns run lockstep under partial rollouts, so the calls come out the same)."""
    from mmrlhf.config import load_config
    from mmrlhf.launch.ray.holder import ExperienceMakerHolder
    from mmrlhf.testing.tiny_models import tiny_model_dir

    config = load_config(ROOT / "examples/agent_zoom_toy_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', tools=True)}", f"trainer.output_dir={tmp_path}",
        "rollout.engine=transformers", "rollout.n_samples_per_prompt=4", "trainer.rollout_batch_size=4",
        "trainer.train_batch_size=16", "trainer.micro_train_batch_size=16", "rollout.micro_rollout_batch_size=16",
        "trainer.eval_steps=0", "trainer.progress_bar=false", "distributed.backend=ray",
        "distributed.max_staleness=1", "rollout.partial=true", "rollout.partial_segment_tokens=1"])
    holder = ExperienceMakerHolder(config.model_dump(mode="json"), index=0, count=1, threads=1)
    assert holder.maker.kind.loop.engine is holder.maker.engine and holder.maker.kind.loop.limits.loop == "lockstep"
    v0 = holder.scoring_weights()
    gen = torch.Generator().manual_seed(0)
    v1 = {n: t + 0.05 * t.std().nan_to_num(1.0) * torch.randn(t.shape, generator=gen) for n, t in v0.items()}
    as_chunk = lambda w: [(f"policy.{n}", t) for n, t in w.items()]  # noqa: E731
    gate, sent = holder.boundary, {}

    def boundary(call, segment):
        if (call, segment) == (0, 1):  # the push arrives while the first turn's first token is generated
            sender = threading.Thread(target=lambda: sent.setdefault(
                "returned", holder.update_experience_maker(as_chunk(v1), version=1, last=True)))
            sender.start()
            while not holder._pending:
                time.sleep(0.001)
            sent["thread"] = sender
        return gate(call, segment)

    holder.boundary = boundary
    meta, payload = holder.generate(step=0, min_version=0)
    sent["thread"].join(timeout=60)
    assert sent["returned"] == 1 and holder.version == 1
    plan = meta["segment_versions"]
    assert plan[0] == [0, 1] and len(plan) > 1 and all(set(call) == {1} for call in plan[1:]), plan
    items = _items(payload)
    spanning = two_turns = 0
    for it in items:
        mask = it.token["loss_mask"]
        v = it.token["rollout_versions"][mask]  # the policy tokens' versions, in order
        assert v[0] == 0 and v[1:].eq(1).all(), v
        spanning += int(v.numel() > 1)
        two_turns += int((mask[mask.nonzero()[0, 0]:] == 0).any())  # an observation between policy tokens
    assert spanning > 0 and two_turns > 0, (spanning, two_turns)

    # A resume: the checkpoint's plan regenerates the same trajectories (tokens, versions, engine log-probs)
    holder.boundary = gate
    holder._apply(as_chunk(v0), "full")
    holder.version = 0
    replay = {"segments": plan, "weights": {0: as_chunk(v0), 1: as_chunk(v1)}, "kind": "full"}
    again_meta, again = holder.generate(step=0, min_version=0, replay=replay)
    assert again_meta["segment_versions"] == plan
    for a, b in zip(items, _items(again), strict=True):
        assert a.response_ids == b.response_ids
        assert torch.equal(a.token["rollout_versions"], b.token["rollout_versions"])
        assert torch.allclose(a.token["rollout_log_probs"], b.token["rollout_log_probs"], rtol=0, atol=1e-6)
