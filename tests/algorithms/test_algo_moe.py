"""Mixture-of-experts math (mmrlhf.algorithms.moe) against formulas written out here, transformers' own
load-balancing loss, and hand-made cases; and the routed-experts layout of the sample builders."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.algorithms.moe import (expert_load, load_balancing_loss, load_imbalance, routing_agreement,
                                   routing_metrics)
from mmrlhf.experience.samples import routed_rows
from mmrlhf.models.routing import replay_scores


def _switch_loss_loop(logits_per_layer, top_k, mask):
    """E * sum_{j, e} f_{j, e} P_e over the (layer, token) pairs that count, written as loops."""
    num_experts = logits_per_layer[0].shape[-1]
    rows = [(l, n) for l in range(len(logits_per_layer)) for n in range(logits_per_layer[0].shape[0]) if mask[n]]
    f = torch.zeros(top_k, num_experts)
    p = torch.zeros(num_experts)
    for l, n in rows:
        probs = torch.softmax(logits_per_layer[l][n].double(), -1)
        for j, e in enumerate(torch.topk(probs, top_k).indices.tolist()):
            f[j, e] += 1
        p += probs.float()
    f, p = f / len(rows), p / len(rows)
    return num_experts * float((f * p[None]).sum())


def test_load_balancing_loss_matches_the_formula_and_transformers():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(7, 6, generator=g) for _ in range(3)]  # 3 layers, 7 tokens, 6 experts
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    ours = float(load_balancing_loss(logits, 2, mask))
    assert ours == pytest.approx(_switch_loss_loop(logits, 2, mask), rel=1e-5)
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    theirs = load_balancing_loss_func(tuple(logits), 6, 2, attention_mask=mask[None].long())
    assert ours == pytest.approx(float(theirs), rel=1e-5)
    unmasked = load_balancing_loss_func(tuple(logits), 6, 2)
    assert float(load_balancing_loss(logits, 2)) == pytest.approx(float(unmasked), rel=1e-5)


def test_load_balancing_loss_bounds_and_gradient():
    """A uniform router scores top_k, a collapsed one E; the gradient reaches the logits."""
    assert float(load_balancing_loss([torch.zeros(10, 4)], 2)) == pytest.approx(2.0)
    collapsed = torch.full((10, 4), -1e4)
    collapsed[:, 0] = 0.0
    assert float(load_balancing_loss([collapsed], 2)) == pytest.approx(4.0, rel=1e-4)
    logits = torch.randn(5, 4, requires_grad=True)
    load_balancing_loss([logits], 2).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_expert_load_and_imbalance():
    idx = torch.tensor([[[0, 1]], [[0, 2]], [[0, 1]], [[-1, -1]]])  # [N=4, L=1, k=2]; the last token not routed
    load = expert_load(idx, 4)
    assert torch.allclose(load, torch.tensor([[3 / 6, 2 / 6, 1 / 6, 0.0]]))
    assert float(load_imbalance(load)[0]) == pytest.approx(0.5 / 0.25)
    m = routing_metrics(idx, 4)
    assert m["moe/load_max_frac"] == pytest.approx(0.5) and "moe/routing_agree_set" not in m


def test_routing_agreement_counts_sets_not_order():
    engine = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [-1, -1]]])  # [N=2, L=2, k=2]
    trainer = torch.tensor([[[1, 0], [2, 1]], [[3, 0], [0, 1]]])
    agree = routing_agreement(engine, trainer)
    assert agree["pairs"] == 3  # the engine's (token 1, layer 1) is not routed
    assert agree["set"] == pytest.approx(1 / 3)  # {0,1}=={1,0}; {2,3}!={2,1}; {1,2}!={3,0}
    assert agree["overlap"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert routing_agreement(engine[:0], trainer[:0])["set"] == 1.0


def test_replay_scores_equal_the_routers_own_at_its_own_top_k():
    logits = torch.randn(6, 5)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    top, idx = torch.topk(probs, 2, dim=-1)
    assert torch.equal(replay_scores(logits, idx), top / top.sum(-1, keepdim=True))
    assert torch.equal(replay_scores(logits, idx, renormalise=False), top)


def test_routed_rows_cover_prompt_and_response_and_builders_place_them():
    from mmrlhf.experience.samples import build_packed_samples, build_padded_samples

    engine = [torch.arange(4 * 2 * 2).reshape(4, 2, 2), None]  # sample 0: 5 tokens, engine ran 4; sample 1: none
    rows = routed_rows(engine, [5, 3])
    assert rows[0].shape == (5, 2, 2) and torch.equal(rows[0][:4].long(), engine[0]) and (rows[0][4] == -1).all()
    assert (rows[1] == -1).all()
    assert routed_rows([None, None], [5, 3]) is None
    adapter = get_adapter_for_test()
    prompts, responses = [[1, 2, 3], [4]], [[5, 6], [7, 8]]
    padded = build_padded_samples(prompts, responses, pad_id=0, eos_id=(), adapter=adapter,
                                  routed_experts=engine).samples
    assert padded.routed_experts.shape == (2, 5, 2, 2)  # [B, S, L, k], S = 3 + 2
    assert torch.equal(padded.routed_experts[0, :4].long(), engine[0])
    assert (padded.routed_experts[1] == -1).all()
    packed = build_packed_samples(prompts, responses, pad_id=0, eos_id=(), adapter=adapter,
                                  routed_experts=engine).samples
    assert packed.routed_experts.shape == (1, 8, 2, 2)  # [1, T, L, k]
    assert torch.equal(packed.routed_experts[0, :4].long(), engine[0]) and (packed.routed_experts[0, 4:] == -1).all()


def get_adapter_for_test():
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return get_adapter(tiny_model_dir("qwen3_vl_moe"))
