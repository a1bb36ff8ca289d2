"""Nothing hard-codes a device: outputs live where the inputs live.

On the ``meta`` device (no data) every function without data-dependent control flow must run and return meta
tensors: a tensor created on the CPU inside would make the op fail or land on the wrong device. The CUDA variant
runs everything (group statistics and dynamic sampling included) where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

import mmrlhf.algorithms as A
from mmrlhf.algorithms.dynamic_sampling import SampledGroups


def _tensors(device, b=4, a=5):
    g = torch.Generator().manual_seed(0)
    mk = lambda: torch.randn(b, a, generator=g).to(device)  # noqa: E731
    mask = (torch.arange(a).unsqueeze(0) < torch.tensor([[5], [3], [1], [0]])).to(device)
    return mk(), mk(), mk(), mask


def _dense_outputs(device):
    lp, old, adv, m = _tensors(device)
    outs = []
    for name in ("ppo", "gspo", "cispo", "cpgd", "sapo"):
        loss, metrics = A.policy_loss(name, lp, old, adv, m, entropy=lp.abs(), entropy_coef=0.01)
        outs += [loss, *metrics.values()]
    outs += [A.value_loss(lp, old, adv, m)[0]]
    for est in ("k1", "k2", "k3"):
        outs += [A.kl_loss(lp, old, m, estimator=est)[0]]
    outs += list(A.kl_penalized_rewards(adv, lp, old, m, 0.1)[1].values())
    outs += [A.whiten_advantages(adv, m)[0], A.clip_advantages(adv, m, 1.0)[0]]
    outs += [A.cross_batch_normalize([adv], [m])[0][0]]
    outs += [A.overlong_penalty(torch.arange(4, device=device), 3, 2)[0]]
    outs += [A.token_level_rewards(adv[:, 0], m), A.entropy_from_logits(torch.zeros(4, 5, 7, device=device))]
    for name in ("gae", "reinforce"):
        outs += list(A.compute_advantages(name, adv, m, values=lp))
    return outs


def test_meta_device():
    for out in _dense_outputs("meta"):
        assert out.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device():
    outs = _dense_outputs("cuda")
    lp, old, adv, m = _tensors("cuda")
    gids = torch.tensor([5, 5, -2, -2], device="cuda")
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_baseline", "cpgd"):
        outs += list(A.compute_advantages(name, adv, m, group_ids=gids))
    outs += [A.high_entropy_mask(lp, m, 0.5)]
    outs += [A.per_component_rewards(torch.stack([adv[:, 0], lp[:, 0]], 1), torch.ones(4, 2, device="cuda"), gids)]
    for out in outs:
        assert out.device.type == "cuda" and not out.isnan().any()
    res = A.fill_batch(lambda: SampledGroups(adv[:, 0], gids), target_groups=2, max_extra_rounds=0)
    assert res.full and res.parts[0].indices.device.type == "cuda"
