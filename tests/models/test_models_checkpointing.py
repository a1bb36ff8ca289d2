"""``trainer.gradient_checkpointing`` (:mod:`mmrlhf.models.gradient_checkpointing`): checkpointing must change memory,
never results. Gradients with and without it are compared in fp32 (every layout, the critic, LoRA, bf16 autocast);
the controls show it is really on: every Linear layer of a checkpointed block runs twice per training step (once in
the forward, once recomputed in the backward), the activations autograd keeps shrink, and no-grad forwards never
enter the checkpoint. The FSDP2 case runs under torchrun in test_models_fsdp.py."""

from __future__ import annotations

import copy

import pytest
import torch
from models_testing import LinearCalls, batch_pieces, built_batches, random_value_head
from torch import nn

from mmrlhf.models import gradient_checkpointing as gc
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.critic import CriticVL
from mmrlhf.models.sharding import block_modules
from mmrlhf.testing.saved_tensors import saved_tensor_bytes
from mmrlhf.testing.tolerances import assert_close_at_scale
from mmrlhf.trainer.optim import freeze_vision


def _actor(bundle, *, tower: bool = False, **kw) -> ActorVL:
    """A fresh copy of the bundle's policy, eval mode (as the trainer runs it), the tower frozen unless ``tower``."""
    actor = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=5, **kw).eval()
    freeze_vision(actor.model, actor.adapter, tower=not tower, merger=False)
    return actor


def _built(bundle, layout: str):
    if layout == "grouped":
        from mmrlhf.experience.grouped import build_grouped_samples

        prompts, responses, vision, _ = batch_pieces(bundle)
        return build_grouped_samples(prompts, responses, pad_id=bundle.processor.tokenizer.pad_token_id,
                                     eos_id=bundle.eos_id, adapter=bundle.adapter, vision=vision)
    return built_batches(bundle)[layout]


def _loss_and_grads(model: nn.Module, built) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(model, CriticVL):
        loss = model(built.samples, vision_extra=built.vision_extra).sum()
    else:
        out = model(built.samples, vision_extra=built.vision_extra, return_entropy=True)
        loss = out.log_probs.sum() + 0.1 * out.entropy.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same_training(plain: nn.Module, ckpt: nn.Module, built, *, min_grads: int = 10) -> None:
    loss_a, grads_a = _loss_and_grads(plain, built)
    loss_b, grads_b = _loss_and_grads(ckpt, built)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) >= min_grads
    for name, g in grads_a.items():
        assert_close_at_scale(grads_b[name], g, rtol=1e-5, scale_tol=1e-6, msg=name)


@pytest.mark.parametrize("family,layout", [("qwen2_vl", "padded"), ("qwen2_vl", "packed"), ("qwen2_vl", "grouped"),
                                           ("qwen2_5_vl", "packed"), ("qwen3_vl", "padded")])
def test_same_gradients_and_the_decoder_runs_twice(bundles, family, layout):
    bundle = bundles[family]
    built = _built(bundle, layout)
    plain, ckpt = _actor(bundle), _actor(bundle)
    names = [n for n, _ in plain.named_parameters()]
    blocks = gc.checkpoint_blocks(ckpt)
    assert [n for n, _ in ckpt.named_parameters()] == names  # the weight sync and checkpoints see the same names
    # the frozen tower's blocks are left alone: nothing inside them is kept for a backward
    tower, _ = bundle.adapter.vision_parts(ckpt.model)
    assert len(blocks) == bundle.model.config.get_text_config().num_hidden_layers
    assert not any(gc.is_checkpointed(b) for b in tower.modules())
    calls_a, calls_b = LinearCalls(plain), LinearCalls(ckpt)
    _assert_same_training(plain, ckpt, built)
    # the control: recomputation really happens, in eval mode, and only where it saves memory
    assert calls_a.counts["language"] > 0 and calls_b.counts["language"] == 2 * calls_a.counts["language"]
    assert calls_a.counts["vision"] > 0 and calls_b.counts["vision"] == calls_a.counts["vision"]


def test_a_training_vision_tower_is_checkpointed_too(bundles):
    bundle = bundles["qwen2_5_vl"]
    plain, ckpt = _actor(bundle, tower=True), _actor(bundle, tower=True)
    assert len(gc.checkpoint_blocks(ckpt)) == len(block_modules(ckpt.model))
    calls_a, calls_b = LinearCalls(plain), LinearCalls(ckpt)
    _assert_same_training(plain, ckpt, built_batches(bundle)["padded"])
    assert calls_a.counts["vision"] > 0 and calls_b.counts["vision"] == 2 * calls_a.counts["vision"]


def test_critic_gradients_are_the_same(bundles):
    bundle = bundles["qwen2_vl"]
    hidden = bundle.model.config.get_text_config().hidden_size
    plain = CriticVL(_actor(bundle), random_value_head(hidden))
    ckpt = CriticVL(_actor(bundle), random_value_head(hidden))
    gc.checkpoint_blocks(ckpt)
    calls_a, calls_b = LinearCalls(plain.body), LinearCalls(ckpt.body)
    _assert_same_training(plain, ckpt, built_batches(bundle)["packed"])
    assert calls_a.counts["language"] > 0 and calls_b.counts["language"] == 2 * calls_a.counts["language"]


def test_lora_adapter_gradients_are_the_same(bundles):
    """LoRA: only the adapters train, so no block's input needs a gradient below the first adapter (the case the
    reentrant checkpoint gets wrong); with ``vision: tower`` the tower's adapters make its blocks worth it."""
    from mmrlhf.config.model import LoraConfig
    from mmrlhf.models.lora import apply_lora

    bundle = bundles["qwen2_vl"]
    actors = []
    for _ in range(2):
        actor = _actor(bundle)
        torch.manual_seed(0)  # peft draws A from the global generator
        apply_lora(actor, LoraConfig(rank=4, vision="tower"))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # non-zero B, so that A gets a gradient too
            for name, p in actor.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        actors.append(actor)
    plain, ckpt = actors
    assert len(gc.checkpoint_blocks(ckpt)) == len(block_modules(ckpt.model))  # the tower trains: all blocks
    _, grads = _loss_and_grads(plain, built_batches(bundle)["padded"])
    assert grads and all(".lora_" in n for n in grads) and any(".lora_A." in n and "visual" in n for n in grads)
    calls_a, calls_b = LinearCalls(plain), LinearCalls(ckpt)
    _assert_same_training(plain, ckpt, built_batches(bundle)["padded"])
    assert calls_b.counts["language"] == 2 * calls_a.counts["language"] > 0
    assert calls_b.counts["vision"] == 2 * calls_a.counts["vision"] > 0


def test_bf16_autocast_recomputes_under_the_same_autocast(bundles):
    """fp32 master weights, bf16 compute: the recomputation runs in bf16 as the forward did (else the recomputed
    activations would differ and torch's check of their dtypes would stop the backward)."""
    bundle = bundles["qwen2_vl"]
    plain, ckpt = _actor(bundle, compute_dtype=torch.bfloat16), _actor(bundle, compute_dtype=torch.bfloat16)
    first = gc.checkpoint_blocks(ckpt)[0]  # the first decoder layer
    states: list[tuple[bool, torch.dtype]] = []
    first.mlp.down_proj.register_forward_pre_hook(
        lambda *_: states.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    loss_a, grads_a = _loss_and_grads(plain, built_batches(bundle)["padded"])
    loss_b, grads_b = _loss_and_grads(ckpt, built_batches(bundle)["padded"])
    assert states == [(True, torch.bfloat16)] * 2  # the forward, then the recomputation in the backward
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for name, g in grads_a.items():  # the same bf16 operations in the same order
        assert_close_at_scale(grads_b[name], g, rtol=1e-5, scale_tol=1e-6, msg=name)


def test_no_grad_forwards_never_enter_the_checkpoint(bundles, monkeypatch):
    bundle = bundles["qwen2_vl"]
    built = built_batches(bundle)["packed"]
    plain, ckpt = _actor(bundle), _actor(bundle)
    n = len(gc.checkpoint_blocks(ckpt))
    entered = []
    real = gc.checkpoint
    monkeypatch.setattr(gc, "checkpoint", lambda *a, **k: entered.append(1) or real(*a, **k))
    with torch.no_grad():  # scoring (old log-probs, reference, values)
        a = plain(built.samples, vision_extra=built.vision_extra).log_probs
        b = ckpt(built.samples, vision_extra=built.vision_extra).log_probs
    with torch.inference_mode():
        ckpt(built.samples, vision_extra=built.vision_extra)
    assert entered == [] and torch.equal(a, b)
    ckpt(built.samples, vision_extra=built.vision_extra).log_probs.sum().backward()
    assert len(entered) == n  # the control: a training forward enters it once per block


def test_saved_activations_shrink(bundles):
    """What checkpointing buys, measured by what autograd keeps (docs/gpu.md quotes a larger shape)."""
    bundle = bundles["qwen2_vl"]
    built = built_batches(bundle)["padded"]
    kept = {}
    for name, actor in (("plain", _actor(bundle)), ("ckpt", _actor(bundle))):
        if name == "ckpt":
            gc.checkpoint_blocks(actor)
        out, kept[name] = saved_tensor_bytes(lambda a=actor: a(built.samples, vision_extra=built.vision_extra),
                                             exclude=actor.parameters())
        out.log_probs.sum().backward()
    assert 0 < kept["ckpt"] < 0.5 * kept["plain"], kept


def test_hf_gradient_checkpointing_is_off_in_eval_mode(bundles):
    """Why the module does not use transformers' own switch: it only acts in training mode, and the trainer
    forwards in eval mode. If transformers changes that, this test says the reason is gone."""
    bundle = bundles["qwen2_vl"]
    built = built_batches(bundle)["padded"]
    actor = _actor(bundle)
    actor.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = LinearCalls(actor)
    actor(built.samples, vision_extra=built.vision_extra).log_probs.sum().backward()
    once = calls.counts["language"]
    actor.train()
    actor(built.samples, vision_extra=built.vision_extra).log_probs.sum().backward()
    assert once > 0 and calls.counts["language"] - once == 2 * once  # recomputed in training mode only


def test_applied_once_and_a_copy_recomputes_its_own_block(bundles):
    bundle = bundles["qwen2_vl"]
    actor = _actor(bundle)
    gc.checkpoint_blocks(actor)
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing: .* is already checkpointed"):
        gc.checkpoint_blocks(actor)
    with pytest.raises(TypeError, match="expected an ActorVL or a CriticVL"):
        gc.checkpoint_blocks(actor.model)
    twin = copy.deepcopy(actor)  # e.g. a model copied after the switch: its blocks must run their own weights
    built = built_batches(bundle)["padded"]
    twin(built.samples, vision_extra=built.vision_extra).log_probs.sum().backward()
    assert all(p.grad is None for p in actor.parameters())
    assert all(gc.is_checkpointed(b) for b in gc.checkpointed_blocks(twin))
    assert sum(p.grad is not None for p in twin.parameters()) > 10
