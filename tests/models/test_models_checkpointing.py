"""``distributed.activation_checkpointing`` (``mmrlhf.models.sharding.checkpoint_blocks``) and the FSDP2 mixed
precision switch: checkpointing must change memory, never results; parameter names stay as they are."""

from __future__ import annotations

import copy

import pytest
import torch
from models_testing import built_batches

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.sharding import block_modules, checkpoint_blocks
from mmrlhf.testing.tolerances import assert_close_at_scale


def _loss_and_grads(actor: ActorVL, built) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = actor(built.samples, vision_extra=built.vision_extra, return_entropy=True)
    loss = out.log_probs.sum() + 0.1 * out.entropy.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_checkpointed_blocks_give_the_same_gradients(bundles, family):
    bundle = bundles[family]
    built = built_batches(bundle)["padded"]
    plain = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=5)
    names = [n for n, _ in plain.named_parameters()]
    ckpt = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=5)
    n_blocks = checkpoint_blocks(ckpt)
    assert n_blocks == len(block_modules(ckpt.model)) > 0
    assert [n for n, _ in ckpt.named_parameters()] == names  # weight sync and checkpoints see the same names

    # the recomputation really happens: a checkpointed block runs its forward again in the backward
    calls = {"plain": 0, "ckpt": 0}
    first = block_modules(plain.model)[0], block_modules(ckpt.model)[0]
    # (pre-hooks: the recomputation stops as soon as it has what the backward needs, before any post-hook)
    first[0].register_forward_pre_hook(lambda *a: calls.__setitem__("plain", calls["plain"] + 1))
    first[1].register_forward_pre_hook(lambda *a: calls.__setitem__("ckpt", calls["ckpt"] + 1))

    loss_a, grads_a = _loss_and_grads(plain, built)
    loss_b, grads_b = _loss_and_grads(ckpt, built)
    assert calls["plain"] >= 1 and calls["ckpt"] == 2 * calls["plain"], calls
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name, g in grads_a.items():
        assert_close_at_scale(grads_b[name], g, rtol=1e-5, scale_tol=1e-6, msg=name)  # recomputed activations
