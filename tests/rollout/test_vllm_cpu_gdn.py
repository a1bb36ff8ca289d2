"""The float32 Gated DeltaNet core that lets a Qwen3.5 vLLM engine run in float32 on the CPU (vLLM's own CPU
kernels take bfloat16 only), checked against transformers' implementation of the same layer.

The engine calls the core once per scheduler step with that step's tokens: decodes first (one token each, continuing
their cached states), then prefills (fresh, or continuing where a prefix was computed). The test replays such steps
on one fake layer, including the step that mixes a decode with a fresh prefill (the order a busy engine produces),
and compares every output with transformers' chunked rule run on each whole sequence; the control runs the same
steps with the mixed step's initial-state flags shifted, which must fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from mmrlhf.rollout import vllm_cpu_gdn  # noqa: E402

HK, HV, DK, DV, W = 2, 4, 8, 8, 4  # key heads, value heads (2 per key head), head dims, conv kernel
KEY, VALUE = HK * DK, HV * DV
DIM = 2 * KEY + VALUE


def _layer(slots: int = 4) -> SimpleNamespace:
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    gen = torch.Generator().manual_seed(0)
    conv = (torch.zeros(slots, DIM, W - 1) if is_conv_state_dim_first() else torch.zeros(slots, W - 1, DIM))
    return SimpleNamespace(
        prefix="layer.0", tp_size=1, key_dim=KEY, value_dim=VALUE, head_k_dim=DK, head_v_dim=DV,
        conv1d=SimpleNamespace(weight=torch.randn(DIM, 1, W, generator=gen) * 0.5, bias=None),
        A_log=torch.randn(HV, generator=gen) * 0.5, dt_bias=torch.randn(HV, generator=gen) * 0.5,
        kv_cache=[conv, torch.full((slots, HV, DV, DK), float("nan"))],  # stale slots must not leak
    )


def _reference(layer, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3.5 layer math on one whole sequence: [L, DIM], [L, HV] x2 -> [L, HV, DV]."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    x = hf.causal_conv1d_fn(qkv.T[None], layer.conv1d.weight.squeeze(1), None, activation="silu")[0].T  # [L, DIM]
    q, k, v = x.split([KEY, KEY, VALUE], dim=-1)
    q, k = (t.reshape(1, -1, HK, DK).repeat_interleave(HV // HK, dim=2) for t in (q, k))
    g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    out, _ = hf.torch_chunk_gated_delta_rule(q, k, v.reshape(1, -1, HV, DV), g=g[None], beta=b.sigmoid()[None],
                                             use_qk_l2norm_in_kernel=True)
    return out[0]


def _step(monkeypatch, layer, pieces, slots, has_initial):
    """One scheduler step over ``pieces`` [(qkv, a, b), ...] (decodes first); returns the outputs per piece."""
    import vllm.forward_context as fc

    lengths = [p[0].shape[0] for p in pieces]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    meta = SimpleNamespace(num_actual_tokens=sum(lengths), spec_sequence_masks=None, non_spec_query_start_loc=starts,
                           non_spec_state_indices_tensor=torch.tensor(slots),
                           has_initial_state=None if has_initial is None else torch.tensor(has_initial))
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={layer.prefix: meta}))
    qkv, a, b = (torch.cat([p[i] for p in pieces]) for i in range(3))
    out = torch.zeros(qkv.shape[0], HV, DV)
    vllm_cpu_gdn.gdn_core(layer, qkv, b, a, out)
    return list(out.split(lengths))


def _run(monkeypatch, shift_flags: bool = False) -> float:
    """Sequences A (6 prompt tokens) and B (9): step 1 prefills A; step 2 decodes A and prefills B fresh (B gets the
    slot A's predecessor left dirty); step 3 decodes both. Returns the worst |core - transformers|."""
    gen = torch.Generator().manual_seed(1)
    seq = {name: (torch.randn(n, DIM, generator=gen), torch.randn(n, HV, generator=gen),
                  torch.randn(n, HV, generator=gen)) for name, n in (("A", 8), ("B", 10))}
    layer = _layer()
    cut = lambda name, i, j: tuple(t[i:j] for t in seq[name])  # noqa: E731
    got = {"A": [], "B": []}
    (a1,) = _step(monkeypatch, layer, [cut("A", 0, 6)], [1], [False])
    got["A"].append(a1)
    flags = [False, True] if shift_flags else [True, False]  # over every sequence of the step, the decode first
    a2, b1 = _step(monkeypatch, layer, [cut("A", 6, 7), cut("B", 0, 9)], [1, 2], flags)
    got["A"].append(a2), got["B"].append(b1)
    a3, b2 = _step(monkeypatch, layer, [cut("A", 7, 8), cut("B", 9, 10)], [1, 2], None)  # decodes only
    got["A"].append(a3), got["B"].append(b2)
    errors = [(torch.cat(got[name]) - ref).abs().max() / ref.abs().max()  # sized by the output's scale
              for name, ref in ((n, _reference(layer, *seq[n])) for n in ("A", "B"))]
    return float(torch.stack(errors).max())  # NaN (a stale slot read) propagates


def test_steps_that_mix_decodes_and_prefills_match_transformers(monkeypatch):
    assert _run(monkeypatch) < 1e-5  # float32 on both sides: summation order only (measured ~1e-7)


def test_control_a_prefill_reading_a_stale_state_is_caught(monkeypatch):
    worst = _run(monkeypatch, shift_flags=True)
    assert not worst < 1e-2, worst  # NaN (the stale slot) or a large error
