"""The compute copy (``trainer.compute_copy``, :mod:`mmrlhf.models.compute_copy`): bf16 copies of the Linear
weights cast once per optimiser step give the float32 master weights the gradients autocast gave them, per family
and prompt kind (the batch holds text, image, two-image and video samples), with gradient checkpointing and LoRA.

Both sides run the same bf16 matrix products on the same values and add each micro-batch's weight gradient into
the float32 master in the same order, so they must agree bit for bit (measured: 0.0 for every family, both
layouts). A weight read by two consumers of which only one is a Linear (tied embeddings) could add its two
gradients in the other order; no model here ties them. The control: float32 against bf16 compute differs by
1-6% of the largest gradient, so the comparison sees a copy that is not autocast's cast."""

from __future__ import annotations

import copy

import pytest
import torch

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.compute_copy import ComputeCopy
from models_testing import built_batches

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe")
REL = 0.0  # of each gradient tensor's largest entry: bit for bit


def _gradients(actor: ActorVL, built, micro_batches: int, copies: ComputeCopy | None) -> dict[str, torch.Tensor]:
    """The masters' accumulated gradients of ``micro_batches`` forwards + backwards of one fixed loss each."""
    actor.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    context = copies.active() if copies is not None else torch.enable_grad()
    with context:
        for _ in range(micro_batches):
            out = actor(built.samples, vision_extra=built.vision_extra)  # [B, A]
            adv = torch.randn(out.log_probs.shape, generator=g)  # [B, A]
            (-(out.log_probs * adv)[out.action_mask].mean()).backward()
    return {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.grad is not None}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest max |a - b| / max |b| over the tensors (and which)."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    worst = max(((float((a[n] - b[n]).abs().max()) / max(float(b[n].abs().max()), 1e-30), n) for n in a))
    return worst


def _actor(bundle, **kwargs) -> ActorVL:
    return ActorVL(copy.deepcopy(bundle.model).float(), bundle.adapter, compute_dtype=torch.bfloat16, **kwargs)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_copy_gives_the_masters_autocasts_gradients(bundles, family, layout):
    bundle = bundles[family]
    built = built_batches(bundle)[layout]
    reference = _actor(bundle)
    for p in reference.model.parameters():
        p.requires_grad_(True)  # the vision tower too: its Linear layers go through the copy as well
    want = _gradients(reference, built, 2, None)

    actor = _actor(bundle)
    actor.load_state_dict(reference.state_dict())
    for p in actor.model.parameters():
        p.requires_grad_(True)
    copies = ComputeCopy(actor, torch.bfloat16)
    assert copies.slots and copies.numel > 0
    got = _gradients(actor, built, 2, copies)
    assert all(p.dtype == torch.float32 and type(p) is torch.nn.Parameter for p in actor.parameters())
    assert all(g.dtype == torch.float32 for g in got.values())
    worst, name = _worst(got, want)
    assert worst <= REL, (worst, name)

    # control: float32 compute against bf16 compute, the same comparison, must fail the tolerance
    fp32 = ActorVL(copy.deepcopy(actor.model), bundle.adapter)
    control, _ = _worst(_gradients(fp32, built, 2, None), want)
    assert control > 1e-3, control


def test_gradient_checkpointing_recomputes_with_the_copies(bundles):
    from mmrlhf.models.gradient_checkpointing import checkpoint_blocks

    bundle = bundles["qwen2_5_vl"]
    built = built_batches(bundle)["packed"]
    reference = _actor(bundle)
    want = _gradients(reference, built, 2, None)
    actor = _actor(bundle)
    actor.load_state_dict(reference.state_dict())
    assert checkpoint_blocks(actor)
    copies = ComputeCopy(actor, torch.bfloat16)
    casts: list[torch.dtype] = []
    # every Linear inside the recomputed blocks sees a bf16 weight: nothing is cast from float32 in the backward
    hooks = [m.register_forward_pre_hook(lambda mod, args: casts.append(mod.weight.dtype))
             for m in actor.modules() if isinstance(m, torch.nn.Linear)]
    got = _gradients(actor, built, 2, copies)
    for h in hooks:
        h.remove()
    assert casts and set(casts) == {torch.bfloat16}, set(casts)
    worst, name = _worst(got, want)
    assert worst <= REL, (worst, name)


def test_lora_adapters_and_frozen_bases_go_through_the_copy(bundles):
    from mmrlhf.config.model import LoraConfig
    from mmrlhf.models.lora import apply_lora

    bundle = bundles["qwen2_vl"]
    built = built_batches(bundle)["padded"]
    cfg = LoraConfig(rank=4, alpha=8.0)
    reference = _actor(bundle)
    apply_lora(reference, cfg)
    with torch.no_grad():  # B = 0 at the start: give the adapters values so their gradients are not trivial
        for n, p in reference.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    want = _gradients(reference, built, 2, None)
    actor = _actor(bundle)
    apply_lora(actor, cfg)
    actor.load_state_dict(reference.state_dict())
    copies = ComputeCopy(actor, torch.bfloat16)
    frozen = [s for s in copies.slots if not s.master.requires_grad]
    assert frozen and len(frozen) < len(copies.slots)  # the bases (frozen) and the adapters (trained)
    got = _gradients(actor, built, 2, copies)
    assert set(got) == set(want) and all("lora_" in n for n in got)
    worst, name = _worst(got, want)
    assert worst <= REL, (worst, name)


def test_a_copy_is_cast_again_only_when_its_master_changed(bundles):
    bundle = bundles["qwen2_vl"]
    built = built_batches(bundle)["padded"]
    actor = _actor(bundle)
    trained = {id(p) for p in actor.parameters() if p.requires_grad}
    with torch.no_grad():  # a frozen part, as the vision tower is by default
        for p in actor.adapter.vision_parts(actor.model)[0].parameters():
            p.requires_grad_(False)
    copies = ComputeCopy(actor, torch.bfloat16)
    n_trained = sum(1 for s in copies.slots if s.master.requires_grad)
    assert 0 < n_trained < len(copies.slots)
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-3)
    with copies.active() as cast:
        assert cast == len(copies.slots)  # the first activation casts everything
    with copies.active() as cast:
        assert cast == 0  # nothing changed
    _gradients(actor, built, 1, copies)
    opt.step()
    with copies.active() as cast:
        assert cast == n_trained  # the optimiser moved the trained masters only
        # the copies hold the stepped masters' values
        assert all(torch.equal(s.copy, s.master.detach().to(torch.bfloat16)) for s in copies.slots)
    copies.release()
    assert all(s.copy is None for s in copies.slots)
    with copies.active() as cast:
        assert cast == len(copies.slots)
    assert trained  # (the model had trainable parameters to begin with)


def test_nested_activation_and_release_inside_are_refused(bundles):
    actor = _actor(bundles["qwen2_vl"])
    copies = ComputeCopy(actor, torch.bfloat16)
    with copies.active():
        with pytest.raises(RuntimeError, match="already entered"):
            with copies.active():
                pass
        with pytest.raises(RuntimeError, match="inside active"):
            copies.release()
    # after the region the modules hold their masters again
    assert all(s.module._parameters[s.name] is s.master for s in copies.slots)
    assert ComputeCopy(ActorVL(copy.deepcopy(bundles["qwen2_vl"].model).to(torch.bfloat16),
                               bundles["qwen2_vl"].adapter), torch.bfloat16).slots == []
