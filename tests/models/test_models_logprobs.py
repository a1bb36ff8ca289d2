"""Chunked log-probs / entropy against the naive full-logits computation: values and gradients."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.models.logprobs import chunked_log_probs, naive_log_probs
from mmrlhf.testing.tolerances import assert_close_at_scale


def _case(n, hidden, vocab, *, bias, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()  # [N, H]
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_()  # [V, H]
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None  # [V]
    t = torch.randint(0, vocab, (n,), generator=g)  # [N]
    gl = torch.randn(n, generator=g)  # [N] upstream grads of log-probs
    ge = torch.randn(n, generator=g)  # [N] upstream grads of entropy
    return h, w, b, t, gl, ge


def _grads(fn, h, w, b, t, gl, ge, **kw):
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    logp, ent = fn(h, w, t, bias=b, **kw)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    return logp.detach(), ent.detach(), [None if x is None else x.grad.clone() for x in (h, w, b)]


def _check(got, ref, *, atol_value, rtol_grad, atol_grad):
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=atol_value)  # log-probs
    torch.testing.assert_close(got[1], ref[1], rtol=atol_value, atol=atol_value)  # entropy (up to log V ~ 12)
    for g_got, g_ref in zip(got[2], ref[2]):
        if g_ref is not None:
            torch.testing.assert_close(g_got, g_ref, rtol=rtol_grad, atol=atol_grad)


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_matches_naive_exactly_in_float64(chunk_size, temperature, bias):
    """float64 end to end: the chunked math (incl. the hand-written backward) equals autograd to rounding."""
    h, w, b, t, gl, ge = _case(23, 32, 257, bias=bias, dtype=torch.float64)
    gl, ge = gl.double(), ge.double()
    ref = _grads(naive_log_probs, h, w, b, t, gl, ge, temperature=temperature)
    got = _grads(lambda *a, **k: chunked_log_probs(*a, **k, chunk_size=chunk_size, return_entropy=True),
                 h, w, b, t, gl, ge, temperature=temperature)
    assert got[0].dtype == torch.float64
    _check(got, ref, atol_value=1e-12, rtol_grad=1e-10, atol_grad=1e-12)


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_chunked_matches_naive_float32(chunk_size):
    h, w, b, t, gl, ge = _case(29, 48, 1000, bias=True, seed=7)
    ref = _grads(naive_log_probs, h, w, b, t, gl, ge)
    got = _grads(lambda *a, **k: chunked_log_probs(*a, **k, chunk_size=chunk_size, return_entropy=True),
                 h, w, b, t, gl, ge)
    assert got[0].dtype == torch.float32
    _check(got, ref, atol_value=1e-5, rtol_grad=1e-4, atol_grad=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qwen_sized_vocab_values_and_grads(dtype):
    """The real Qwen vocabulary (151,936) with a small hidden size; chunk size does not divide N."""
    h, w, b, t, gl, ge = _case(37, 16, 151_936, bias=False, seed=1, dtype=dtype)
    gl, ge = gl.to(dtype), ge.to(dtype)
    ref = _grads(naive_log_probs, h, w, b, t, gl, ge)
    got = _grads(lambda *a, **k: chunked_log_probs(*a, **k, chunk_size=8, return_entropy=True), h, w, b, t, gl, ge)
    if dtype == torch.float64:
        _check(got, ref, atol_value=1e-11, rtol_grad=1e-9, atol_grad=1e-11)
    else:  # float32: sums over 152k terms in a different order -> rounding at ~1e-5 of the gradient scale
        _check(got, ref, atol_value=1e-5, rtol_grad=1e-4, atol_grad=5e-5)


def test_logprob_only_grads_and_entropy_off():
    h, w, b, t, gl, _ = _case(19, 24, 301, bias=True, seed=2)
    logp, ent = chunked_log_probs(h, w, t, bias=b, chunk_size=5)
    assert ent is None and logp.dtype == torch.float32 and logp.shape == (19,)
    (logp * gl).sum().backward()
    got = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad = None
    ref_logp, _ = naive_log_probs(h, w, t, bias=b)
    (ref_logp * gl).sum().backward()
    torch.testing.assert_close(logp.detach(), ref_logp.detach(), rtol=0, atol=1e-5)
    for g_got, x in zip(got, (h, w, b)):
        assert_close_at_scale(g_got, x.grad)  # chunked vs whole: another summation order


def test_frozen_weights_only_hidden_gets_grad():
    h, w, _, t, gl, _ = _case(9, 16, 100, bias=False, seed=3)
    w = w.detach()
    logp, _ = chunked_log_probs(h, w, t, chunk_size=4)
    (logp * gl).sum().backward()
    ref_h = h.detach().clone().requires_grad_()
    (naive_log_probs(ref_h, w, t)[0] * gl).sum().backward()
    assert_close_at_scale(h.grad, ref_h.grad)


def test_bf16_weights_match_naive():
    """bf16 hidden/weights: logits are computed in bf16 then upcast, exactly like the naive path."""
    h, w, _, t, _, _ = _case(21, 64, 500, bias=False, dtype=torch.bfloat16, seed=4)
    logp, ent = chunked_log_probs(h, w, t, chunk_size=6, return_entropy=True)
    ref_logp, ref_ent = naive_log_probs(h, w, t)
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=0, atol=1e-3)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-3)


def test_autograd_saves_nothing_vocab_sized():
    """The graph must not keep [N, V] logits for the backward (that is the whole memory saving)."""
    n, vocab = 64, 4096
    h, w, _, t, _, _ = _case(n, 16, vocab, bias=False, seed=5)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logp, ent = chunked_log_probs(h, w, t, chunk_size=16, return_entropy=True)
    assert max(saved) <= vocab * 16  # the weight itself, nothing of size N * V
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        saved.clear()
        naive_log_probs(h, w, t)
    assert max(saved) >= n * vocab  # the check can fail: the naive graph does keep full logits


def test_rejects_bad_arguments():
    h, w, _, t, _, _ = _case(4, 8, 10, bias=False)
    with pytest.raises(ValueError):
        chunked_log_probs(h, w, t, chunk_size=0)
    with pytest.raises(ValueError):
        chunked_log_probs(h, w, t[:3])


def test_detached_entropy_leaves_logprob_grads_exact():
    """Entropy returned for logging only (detached): the backward skips its term and log-prob grads stay exact."""
    h, w, b, t, gl, _ = _case(17, 16, 211, bias=False, seed=6, dtype=torch.float64)
    logp, ent = chunked_log_probs(h, w, t, chunk_size=4, return_entropy=True)
    (logp * gl.double() + 0 * ent.detach()).sum().backward()
    got = h.grad.clone()
    h.grad = None
    (naive_log_probs(h, w, t)[0] * gl.double()).sum().backward()
    torch.testing.assert_close(got, h.grad, rtol=1e-10, atol=1e-12)
