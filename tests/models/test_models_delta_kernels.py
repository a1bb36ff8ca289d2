"""The kernel choice for the Gated DeltaNet layers (``model.linear_attention_kernel``,
:mod:`mmrlhf.models.delta_kernels`), on the CPU: ``auto`` resolves to the torch (gather) path here and to ``fla`` on
CUDA only where the package is installed and the doctor proved it there (tests/test_proofs.py); naming ``fla`` where
it cannot run is refused by name.

The variable-length path (every sequence's tokens in one row, boundaries and initial states handed to the kernel)
runs here through a fake kernel registered for the test: each sequence through the layer module's own torch chunked
rule, from its initial state. Through it, packed rows, padded batches and shared-prompt rows score what the gather
path scores (log-probs and parameter gradients, float32, per family), and the control, a kernel that drops the
initial states, moves the shared-prompt rows' responses. The models are slow-decay copies of the tiny ones (their
own forget the recurrent state at the next token: ``models_testing.slow_decay``).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from models_testing import batch_pieces, slow_decay

from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models import delta_kernels, linear_attention
from mmrlhf.models.actor import ActorVL
from mmrlhf.registry import Registry
from mmrlhf.testing.tolerances import assert_close_at_scale

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
ATOL = 1e-5  # fp32 vs fp32, another summation order only
CAUGHT = 1e-3
QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"


def _sequential(module, calls: list, drop_state: bool = False):
    """A fake varlen rule: each sequence through ``module``'s torch chunked rule from its own initial state."""

    def rule(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state):
        calls.append((len(cu_seqlens) - 1, initial_state is not None))
        outs, finals = [], []
        for i in range(len(cu_seqlens) - 1):
            a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            init = None if initial_state is None or drop_state else initial_state[i: i + 1]
            out, final = module.torch_chunk_gated_delta_rule(
                q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=init,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None

    return rule


@pytest.fixture()
def fake(monkeypatch):
    """Registers ``fake`` (and ``fake_cold``, which drops initial states) in a fresh kernel registry; yields the
    calls the fake kernels saw."""
    calls: list = []
    registry = Registry("linear-attention kernel")
    registry.add("fla", delta_kernels.fla_rule)

    module = importlib.import_module(QWEN3_5)  # its rule is the MoE module's too (the same computation)
    registry.add("fake", lambda: _sequential(module, calls))
    registry.add("fake_cold", lambda: _sequential(module, calls, drop_state=True))
    monkeypatch.setattr(delta_kernels, "VARLEN_RULES", registry)
    return calls


_SLOW: dict = {}


def _slow(bundles, family: str):
    if family not in _SLOW:
        _SLOW[family] = slow_decay(bundles[family])
    return _SLOW[family]


def _batch(bundle, layout: str):
    prompts, responses, vision, _ = batch_pieces(bundle)
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id, adapter=bundle.adapter,
              vision=vision)
    build = {"packed": build_packed_samples, "padded": build_padded_samples, "grouped": build_grouped_samples}
    return build[layout](prompts, responses, **kw)


def _grads(actor, built):
    actor.model.zero_grad(set_to_none=True)
    out = actor(built.samples, vision_extra=built.vision_extra)
    out.log_probs.sum().backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.model.zero_grad(set_to_none=True)
    return out.log_probs.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["packed", "padded", "grouped"])
def test_varlen_path_equals_the_gather_path(bundles, fake, family, layout, monkeypatch):
    """Log-probs and gradients, both paths through the layer module's token-by-token delta rule: the chunked one's
    float32 decay gradients depend on what its 64-token chunks hold (the gather path's padding is in them, the
    varlen row's is not; test_models_shared_prompt.py measures it), which is not what this test compares."""
    bundle = _slow(bundles, family)
    built = _batch(bundle, layout)
    for name in {type(linear_attention.recurrent_layers(bundle.model)[0]).__module__, QWEN3_5}:  # the fake's too
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", module.torch_recurrent_gated_delta_rule)
    gather = ActorVL(bundle.model, bundle.adapter, chunk_size=5, linear_attention_kernel="torch")
    varlen = ActorVL(bundle.model, bundle.adapter, chunk_size=5, linear_attention_kernel="fake")
    assert gather.delta_kernel() == "torch" and varlen.delta_kernel() == "fake"
    ref, ref_grads = _grads(gather, built)
    assert not fake  # the gather path never calls a varlen kernel
    got, got_grads = _grads(varlen, built)
    layers = len(linear_attention.recurrent_layers(bundle.model))
    if layout == "grouped":  # per layer: the prompts from zero, then the responses from their prompts' states
        rows, samples = built.samples.num_rows, built.samples.batch_size
        assert fake[:2] == [(rows, False), (samples, True)] and len(fake) >= 2 * layers
    else:
        assert fake[0] == (built.samples.response_length.numel(), False) and len(fake) >= layers
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
    assert got_grads.keys() == ref_grads.keys() and any(".linear_attn." in n for n in got_grads)
    for name in ref_grads:
        assert_close_at_scale(got_grads[name], ref_grads[name], msg=f"{layout}: {name}")


def test_a_kernel_without_the_compute_dtype_leaves_the_forward_to_the_gather_path(bundles, fake, monkeypatch):
    """fla has no float32 kernel: a rule that lists its dtypes is skipped in a forward of another dtype (here the
    fake, said to run bf16 only, in a float32 forward), which then takes the torch path and scores the same."""
    bundle = _slow(bundles, "qwen3_5")
    built = _batch(bundle, "grouped")
    rule = _sequential(importlib.import_module(QWEN3_5), fake)
    rule.dtypes = (torch.bfloat16,)
    registry = Registry("linear-attention kernel")
    registry.add("bf16_only", lambda: rule)
    monkeypatch.setattr(delta_kernels, "VARLEN_RULES", registry)
    assert delta_kernels.rule_runs(rule, torch.bfloat16) and not delta_kernels.rule_runs(rule, torch.float32)
    with torch.no_grad():
        got = ActorVL(bundle.model, bundle.adapter, linear_attention_kernel="bf16_only")(
            built.samples, vision_extra=built.vision_extra).log_probs
        ref = ActorVL(bundle.model, bundle.adapter, linear_attention_kernel="torch")(
            built.samples, vision_extra=built.vision_extra).log_probs
    assert not fake  # never called
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_a_kernel_that_drops_the_prompt_state_is_caught(bundles, fake):
    """Control: responses that start from zero instead of their prompt's state score differently."""
    bundle = _slow(bundles, "qwen3_5")
    built = _batch(bundle, "grouped")
    with torch.no_grad():
        good = ActorVL(bundle.model, bundle.adapter, linear_attention_kernel="fake")(
            built.samples, vision_extra=built.vision_extra).log_probs
        cold = ActorVL(bundle.model, bundle.adapter, linear_attention_kernel="fake_cold")(
            built.samples, vision_extra=built.vision_extra).log_probs
    assert float((cold - good).abs().max()) > CAUGHT


def test_the_choice_is_made_in_one_place(monkeypatch):
    """``auto`` takes fla only where the doctor proved it on this machine (tests/test_proofs.py): importable is
    not enough, since fla has never run where the suite runs."""
    resolve = delta_kernels.resolve_delta_kernel
    monkeypatch.setattr(delta_kernels, "fla_available", lambda: False)
    delta_kernels.auto_kernel.cache_clear()
    assert resolve("auto", "cpu") == "torch" and resolve("auto", "cuda") == "torch"  # no package
    assert resolve("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="linear_attention_kernel=fla, but flash-linear-attention is not installed"):
        resolve("fla", "cuda")
    assert "torch (each sequence gathered into a padded batch; flash-linear-attention not installed)" == \
        delta_kernels.describe("auto", "cuda")
    monkeypatch.setattr(delta_kernels, "fla_available", lambda: True)
    delta_kernels.auto_kernel.cache_clear()
    assert resolve("auto", "cuda") == "torch" and resolve("auto", "cpu") == "torch"  # installed, not proven here
    assert resolve("fla", "cuda") == "fla"  # asked for by name: runs without the doctor's proof
    assert resolve("torch", "cuda") == "torch"  # asked for: the reference path even where fla could run
    assert "fla is installed but has not been checked on this machine" in delta_kernels.describe("auto", "cuda")
    assert delta_kernels.describe("auto", "cpu") == "torch (each sequence gathered into a padded batch; not CUDA)"
    delta_kernels.auto_kernel.cache_clear()
    with pytest.raises(ValueError, match="linear_attention_kernel=fla runs on CUDA only, not on cpu"):
        resolve("fla", "cpu")
    with pytest.raises(ValueError, match="linear_attention_kernel='flash'.*choose auto, torch or one of fla"):
        resolve("flash", "cpu")


def test_the_actor_refuses_an_unknown_kernel_at_once_and_a_device_where_it_computes(bundles, monkeypatch):
    bundle = bundles["qwen3_5"]
    with pytest.raises(ValueError, match="linear_attention_kernel='nope'"):
        ActorVL(bundle.model, bundle.adapter, linear_attention_kernel="nope")
    monkeypatch.setattr(delta_kernels, "fla_available", lambda: True)
    actor = ActorVL(bundle.model, bundle.adapter, linear_attention_kernel="fla")  # built on the CPU, moved later
    with pytest.raises(ValueError, match="runs on CUDA only, not on cpu"):
        actor.delta_kernel()
