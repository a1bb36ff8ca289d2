"""The shaping's step-wide means (``maker_metrics.shaped_means``) over ranks: each rank logs the step's
``reward/shaped_mean`` and ``kl/mean`` (the whole step's, as one process computes them), not its own share's, so the
step merge of the ranks' metrics (weighted by their sample counts) cannot move them."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.experience.maker_metrics import shaped_means
from mmrlhf.experience.rollout import merge_share_metrics
from mmrlhf.parallel.world import single
from mmrlhf.testing.lockstep import run_ranks


def _step(seed: int = 0) -> dict:
    """A step of 6 samples: [N] shaped rewards and validity (sample 4 masked out), [N, A] KL and a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.tensor([True, True, True, True, False, True])
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 4, 2, 3, 5])[:, None]  # [6, 5]
    mask &= valid[:, None]
    kl = torch.rand(6, 5, generator=g) * mask
    return {"seq_reward": torch.randn(6, generator=g), "valid": valid, "kl": kl, "mask": mask,
            "metrics": {"kl": 0.0}}


def _part(step: dict, rows: list[int]) -> dict:
    return {**{k: step[k][rows] for k in ("seq_reward", "valid", "kl", "mask")}, "metrics": dict(step["metrics"])}


def test_every_rank_logs_the_whole_steps_means():
    step = _step()
    whole = shaped_means(step, single())
    valid, mask = step["valid"], step["mask"]
    assert whole["reward/shaped_mean"] == pytest.approx(float(step["seq_reward"][valid].double().mean()), rel=1e-12)
    assert whole["kl/mean"] == pytest.approx(float(step["kl"][mask].double().mean()), rel=1e-12)
    assert whole["kl"] == whole["kl/mean"]  # (a KL term in the reward: its per-token mean is the same)
    shares = ([0, 1], [2, 3, 4, 5])  # unequal token and sample counts, the masked sample on rank 1
    ranks = run_ranks(lambda world: shaped_means(_part(step, shares[world.rank]), world), 2)
    for got in ranks:
        for key, value in whole.items():
            assert got[key] == pytest.approx(value, rel=1e-12), key
    # rank 0's sample count as the Ray trainer actors' merge weighs it (what dynamic sampling dropped added)
    merged = merge_share_metrics(ranks, [2.0 + 10.0, 4.0])
    assert merged["kl/mean"] == pytest.approx(whole["kl/mean"], rel=1e-12)
    # the control: the ranks' own means, merged so, are not the step's
    own = [shaped_means(_part(step, rows), single()) for rows in shares]
    assert abs(merge_share_metrics(own, [12.0, 4.0])["kl/mean"] - whole["kl/mean"]) > 1e-3 * whole["kl/mean"]


def test_without_a_kl_term_only_the_shaped_reward_is_reported():
    step = {**_step(1), "kl": None, "metrics": {}}
    assert set(shaped_means(step, single())) == {"reward/shaped_mean"}
    nothing = {**step, "valid": torch.zeros(6, dtype=torch.bool)}
    assert shaped_means(nothing, single()) == {"reward/shaped_mean": 0.0}
