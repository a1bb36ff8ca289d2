"""The update loop with token-budget micro-batches on several ranks (threads meeting at every collective, no model
sharding): every rank runs as many forwards and backwards as the others, in every mini-batch, even when one holds
fewer samples (padding micro-batches of zero weight); each rank's gradient is the count split's; the split's metrics
are logged and agree over ranks."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.parallel.micro_batches import Layout, SampleCost
from mmrlhf.testing.lockstep import run_ranks
from mmrlhf.testing.tolerances import assert_close_at_scale
from mmrlhf.trainer.minibatch import GuardedStepper, run_minibatches

SIZES = [12, 7, 10]  # samples per rank: the second rank lost a prompt


class _Record(torch.optim.Optimizer):
    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.grads.append(torch.cat([p.grad.flatten() for g in self.param_groups for p in g["params"]]))


def _rank(world, tokens, layout):
    n = SIZES[world.rank]
    g = torch.Generator().manual_seed(world.rank)
    x = torch.randn(n, 5, generator=g)  # [N, 5] one feature row per sample
    counts = [float(1 + (3 * k + world.rank) % 7) for k in range(n)]  # tokens per sample
    costs = [SampleCost(30 + 200 * ((k + world.rank) % 3), int(c) * 40, 256 * (k % 2), 0, k // 2)
             for k, c in enumerate(counts)]
    model = torch.nn.Linear(5, 2)
    with torch.no_grad():  # the same weights on every rank and run (the global RNG is shared by the threads)
        model.weight.copy_(torch.randn(2, 5, generator=torch.Generator().manual_seed(0)))
        model.bias.copy_(torch.tensor([0.5, -0.25]))
    opt = _Record(list(model.parameters()))
    stepper = GuardedStepper(list(model.parameters()), opt, None, max_grad_norm=1e9, max_consecutive=2,
                             name="policy", world=world)
    forwards: list[list[int]] = []

    def micro_loss(micro, denom):
        forwards.append(list(micro))
        rows = x[[max(i, 0) for i in micro]]  # [b, 5]
        weight = torch.tensor([counts[max(i, 0)] for i in micro])  # [b]
        return (model(rows).pow(2).sum(-1) * weight).sum() / denom, {"pg_loss": 1.0}

    metrics = run_minibatches(counts, batch_size=18, micro_size=2, epochs=2, generator=torch.Generator().manual_seed(3),
                              stepper=stepper, micro_loss=micro_loss, prefix="policy/", groups=[c.group for c in costs],
                              costs=costs, layout=layout, max_tokens=tokens)
    return forwards, opt.grads, metrics


@pytest.mark.parametrize("layout", [Layout("padded"), Layout("grouped", 600)])
def test_ranks_run_the_same_forwards_and_the_count_split_gradients(layout):
    counted = run_ranks(lambda w: _rank(w, None, layout), len(SIZES))
    budgeted = run_ranks(lambda w: _rank(w, 1500, layout), len(SIZES))
    auto = run_ranks(lambda w: _rank(w, "auto", layout), len(SIZES))
    for runs in (counted, budgeted, auto):
        assert len({len(forwards) for forwards, _, _ in runs}) == 1  # the same number of forwards on every rank
        assert len({len(grads) for _, grads, _ in runs}) == 1  # and of optimiser steps (2 epochs x 2 mini-batches)
        assert {m["policy/micro_batches"] for *_, m in runs} == {float(len(runs[0][0]))}
    # the short rank pads: besides each of its samples once per epoch, forwards of zero weight (its first sample)
    assert sum(len(f) for f in budgeted[1][0]) > 2 * SIZES[1]
    assert sum(len(f) for f in budgeted[0][0]) == 2 * SIZES[0]
    assert budgeted[0][0] != counted[0][0]  # another split ...
    for (_, g_budget, m_budget), (_, g_count, m_count), (_, g_auto, _) in zip(budgeted, counted, auto):
        for a, b, c in zip(g_budget, g_count, g_auto):  # ... the same step on every rank
            assert_close_at_scale(a, b)
            assert_close_at_scale(c, b)
        assert m_budget["policy/micro_batch_tokens_max"] <= 1500 < m_count["policy/micro_batch_tokens_max"]
        assert m_budget["policy/oversized_micro_batches"] == 0
    assert len(auto[0][0]) <= len(counted[0][0])
    imbalance = {m["policy/micro_batch_rank_imbalance"] for *_, m in budgeted}
    assert len(imbalance) == 1 and imbalance.pop() >= 1.0
