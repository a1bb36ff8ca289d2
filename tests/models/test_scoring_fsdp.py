"""The reference and the distillation teacher sharded with FSDP2 beside the policy (2 torchrun ranks, gloo, CPU)
score what one unsharded process scores.

scoring_fsdp_worker.py shards the policy, the critic, the reference and the teacher as a run does
(``shard_models(..., scorers=...)``, without and with ``distributed.offload=params``) and makes each rank's
experiences through the experience maker over the world of both ranks: rank 0 the image, two-image and video
groups, rank 1 the text group, so rank 1 runs padding forwards of every model beside rank 0's real ones (a sharded
forward is a collective) and never runs the vision tower. Here one process makes the whole step's experiences with
the same models unsharded. Per prompt kind: the old-policy, reference and teacher log-probs, the values, the KL and
the GAE advantages and returns it shapes must match in float32 at the suite's scale-sized tolerance. Controls: the
reference and teacher are really sharded (each rank holds half of every one, offloaded under ``params``), and a
reference weight moved on rank 1 alone moves rank 0's reference log-probs past that tolerance, while its policy's
stay put.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scoring_testing import (
    KINDS,
    SHARES,
    lora_scoring_models,
    scored_items,
    scoring_maker,
    scoring_models,
    scoring_rollout,
)

from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale

pytest.importorskip("torch.distributed.fsdp")

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
WORLD = 2
WORKER = Path(__file__).with_name("scoring_fsdp_worker.py")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    from mmrlhf.testing.tiny_models import tiny_model_dir

    for family in FAMILIES:  # made here once: two ranks making the same cached model at once would race
        tiny_model_dir(family, "tiny", 0)
    out = tmp_path_factory.mktemp("scoring_fsdp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(WORKER), "--out", str(out), *FAMILIES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def _ranks(out: Path, family: str) -> tuple[dict[int, dict], list[dict]]:
    """(sample index -> the run's results per mode, from whichever rank scored it; each rank's metadata)."""
    merged: dict[str, dict[int, dict]] = {}
    metas = []
    for rank in range(WORLD):
        results = torch.load(out / f"{family}.rank{rank}.pt", weights_only=True)
        assert sorted(results["none"]) == list(SHARES[rank])
        for mode, per_sample in results.items():
            merged.setdefault(mode, {}).update(per_sample)
        metas.append(json.loads((out / f"{family}.rank{rank}.json").read_text()))
    return merged, metas


def _by_kind(per_sample: dict[int, dict], key: str, kind: int) -> torch.Tensor:
    """The kind's two samples' ``key`` results, concatenated (each sample: [A] or [A, k])."""
    return torch.cat([per_sample[i][key] for i in (2 * kind, 2 * kind + 1)])


@pytest.fixture(scope="module")
def one_process(bundles) -> dict[str, dict[int, dict]]:
    out = {}
    for family in FAMILIES:
        bundle = bundles[family]
        out[family] = scored_items(scoring_maker(bundle, scoring_models(bundle)), scoring_rollout(bundle))
        if family == FAMILIES[0]:
            out[f"{family}.lora"] = scored_items(scoring_maker(bundle, lora_scoring_models(bundle)),
                                                 scoring_rollout(bundle))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_scoring_equals_one_process_per_prompt_kind(sharded, one_process, family):
    merged, _ = _ranks(sharded, family)
    expected = one_process[family]
    keys = expected[0].keys()
    assert {"action_log_probs", "base_action_log_probs", "teacher_topk_log_probs", "values", "kl",
            "advantages"} <= set(keys)
    for mode in ("none", "params"):
        for kind, name in enumerate(KINDS):
            for key in keys:
                assert_close_at_scale(_by_kind(merged[mode], key, kind), _by_kind(expected, key, kind),
                                      msg=f"{family} offload={mode} {name} {key}")
    # the reference scores differently from the policy (the comparison sees its own forwards)
    ref, policy = (torch.cat([_by_kind(expected, key, k) for k in range(len(KINDS))])
                   for key in ("base_action_log_probs", "action_log_probs"))
    assert not close_at_scale(ref, policy)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_controls_the_reference_is_sharded_and_a_moved_shard_is_seen(sharded, one_process, family):
    merged, metas = _ranks(sharded, family)
    for meta in metas:
        for mode, policy in (("none", "OffloadPolicy"), ("params", "CPUOffloadPolicy")):
            for name in ("reference", "teacher"):
                held = meta[mode][name]
                assert held["all_sharded"] and 0.4 < held["local_share"] < 0.6, (mode, name, held)
                assert held["offload"] == policy, (mode, name, held)
    expected = one_process[family]
    for kind in range(1, len(KINDS)):  # rank 0's kinds: its own reference shard was not touched
        got = _by_kind(merged["perturbed"], "base_action_log_probs", kind)
        assert not close_at_scale(got, _by_kind(expected, "base_action_log_probs", kind)), (KINDS[kind],
                                                                                            metas[0]["perturbed"])
        assert_close_at_scale(_by_kind(merged["perturbed"], "action_log_probs", kind),
                              _by_kind(expected, "action_log_probs", kind))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES[:1])
def test_a_lora_reference_runs_its_padding_forwards_and_scores_as_one_process(sharded, one_process, family):
    """A LoRA run's reference is the sharded policy's own module with its adapters off: its forwards are collectives
    too, so the text-only rank's padding forwards must run it (before, they skipped it and the ranks hung)."""
    merged, _ = _ranks(sharded, family)
    expected = one_process[f"{family}.lora"]
    assert "teacher_topk_log_probs" not in expected[0]
    for kind, name in enumerate(KINDS):
        for key in expected[0]:
            assert_close_at_scale(_by_kind(merged["lora"], key, kind), _by_kind(expected, key, kind),
                                  msg=f"{family} lora {name} {key}")
    ref, policy = (torch.cat([_by_kind(expected, key, k) for k in range(len(KINDS))])
                   for key in ("base_action_log_probs", "action_log_probs"))
    assert not close_at_scale(ref, policy)  # the adapters moved the policy away from its base
