"""``model.lora.base_dtype``: a LoRA policy's frozen Linear weights stored in bf16 (no float32 master: they never
step). Under bf16 autocast the forwards and the adapters' gradients are the float32 base's bit for bit (autocast
computed those products from the same rounded values), per family and prompt kind; through the trainer a LoRA run
is the same run in half the base's memory. Embeddings, norms and the adapters stay float32."""

from __future__ import annotations

import copy

import pytest
import torch

from mmrlhf.config.model import LoraConfig
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.lora import apply_lora
from mmrlhf.models.precision import store_frozen_linears
from models_testing import built_batches

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe")


def _lora_actor(bundle, vision: str = "none") -> ActorVL:
    actor = ActorVL(copy.deepcopy(bundle.model).float(), bundle.adapter, compute_dtype=torch.bfloat16)
    # attention projections only: the MoE family's MLPs are routed experts (3-D weights, not adapted)
    apply_lora(actor, LoraConfig(rank=4, alpha=8.0, vision=vision,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():  # B = 0 at the start: values, so that the adapters change the products
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    return actor


def _step(actor: ActorVL, built) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs and the adapters' gradients of two accumulated micro-batches of a fixed loss."""
    actor.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        out = actor(built.samples, vision_extra=built.vision_extra)  # [B, A]
        (-(out.log_probs * torch.randn(out.log_probs.shape, generator=g))[out.action_mask].mean()).backward()
    return out.log_probs.detach(), {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_base_computes_what_autocast_computed_from_the_float32_one(bundles, family):
    bundle = bundles[family]
    vision = "both" if family == "qwen2_5_vl" else "none"  # adapters in the tower and merger too, once
    for layout in ("padded", "packed"):
        built = built_batches(bundle)[layout]
        reference = _lora_actor(bundle, vision)
        want_lp, want = _step(reference, built)
        actor = _lora_actor(bundle, vision)
        actor.load_state_dict(reference.state_dict())
        cast = store_frozen_linears(actor, torch.bfloat16)
        assert cast > 0
        got_lp, got = _step(actor, built)
        assert got.keys() == want.keys() and all("lora_" in n for n in got)
        assert torch.equal(got_lp, want_lp), (family, layout)
        different = [n for n in got if not torch.equal(got[n], want[n])]
        assert not different, (family, layout, different[:3])
        assert all(g.dtype == torch.float32 for g in got.values())


def test_what_is_stored_in_bf16_and_what_stays_float32(bundles):
    actor = _lora_actor(bundles["qwen2_vl"], vision="merger")
    before = sum(p.numel() * p.element_size() for p in actor.parameters())
    cast = store_frozen_linears(actor, torch.bfloat16)
    after = sum(p.numel() * p.element_size() for p in actor.parameters())
    assert before - after == 2 * cast
    for name, p in actor.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32, name  # the adapters: float32 masters
    linear = {id(p) for m in actor.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters(recurse=False)}
    for name, p in actor.named_parameters():
        if id(p) in linear and not p.requires_grad:
            assert p.dtype == torch.bfloat16, name  # bases, lm_head, tower blocks, the merger's adapted base
        elif not p.requires_grad and id(p) not in linear:
            assert p.dtype == torch.float32, name  # embeddings, norms, the patch embedding's convolution
    assert actor.model.get_input_embeddings().weight.dtype == torch.float32
    assert actor.model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert store_frozen_linears(actor, torch.bfloat16) == 0  # nothing left to cast


def test_a_head_tied_to_the_embeddings_keeps_its_dtype():
    from mmrlhf.testing.tiny_models import tiny_model_dir

    actor = ActorVL.from_pretrained(str(tiny_model_dir("qwen2_vl", tied=True)), dtype=torch.float32)
    apply_lora(actor, LoraConfig(rank=2))
    assert actor.model.get_output_embeddings().weight is actor.model.get_input_embeddings().weight
    assert store_frozen_linears(actor, torch.bfloat16) > 0
    assert actor.model.get_input_embeddings().weight.dtype == torch.float32


def test_auto_is_the_compute_dtype_on_an_accelerator_and_float32_on_the_cpu():
    from mmrlhf.config.model import ModelConfig
    from mmrlhf.models.precision import lora_base_dtype

    cfg = ModelConfig(dtype="bfloat16", lora={"rank": 4})
    assert cfg.lora.base_dtype == "auto"
    assert lora_base_dtype(cfg, "cpu") == torch.float32
    assert lora_base_dtype(cfg, torch.device("cuda", 0)) == torch.bfloat16  # resolved, not allocated
    assert lora_base_dtype(ModelConfig(dtype="float32", lora={"rank": 4}), "cuda") == torch.float32
    assert lora_base_dtype(ModelConfig(dtype="bfloat16", lora={"rank": 4, "base_dtype": "bfloat16"}),
                           "cpu") == torch.bfloat16


def test_the_merged_sync_keeps_a_small_update_a_bf16_base_would_round_away(bundles):
    from mmrlhf.models.lora import merged_weights

    actor = _lora_actor(bundles["qwen2_vl"])
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.mul_(1e-4)  # an update far below a bf16 ulp of the weights
    store_frozen_linears(actor, torch.bfloat16)
    for name, merged in merged_weights(actor.model):
        if name.endswith("q_proj.weight"):
            assert merged.dtype == torch.float32
            base = actor.model.get_submodule(name[: -len(".weight")]).get_base_layer().weight
            # the update survives in (nearly) every entry; rounded to bf16 it would be gone from nearly all (control)
            assert float((merged != base.float()).float().mean()) > 0.9
            assert float((merged.to(torch.bfloat16) != base).float().mean()) < 0.05
            break
    else:
        pytest.fail("no adapted q_proj in the merged weights")
