"""The sampler's truncation (min-p, top-k, top-p) as the trainer scores it: the kept sets equal vLLM's own
functions', ties follow the documented rule, and the chunked log-probs of the truncated distribution (values, entropy
and gradients) equal a naive float64 computation; a target outside its kept set is flagged and scored untruncated,
never -inf or NaN."""

from __future__ import annotations

import math

import pytest
import torch

from mmrlhf.models.logprobs import EXCLUDED_LOGIT, chunked_sampled_log_probs, naive_log_probs
from mmrlhf.models.truncation import Truncation, kept_threshold, truncate_logits

SETTINGS = [Truncation(top_k=5), Truncation(top_p=0.7), Truncation(top_k=5, top_p=0.7), Truncation(top_p=0.95),
            Truncation(min_p=0.1), Truncation(top_k=20, top_p=0.9, min_p=0.05), Truncation(top_p=0.3)]


def _vllm_kept(logits: torch.Tensor, t: Truncation) -> torch.Tensor:
    """[R, V] bool: what vLLM 0.32 keeps (its min-p processor's rule, then its own top-k / top-p function)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = logits.clone()
    if t.min_p > 0:  # vllm/v1/sample/logits_processor/builtin.py MinPLogitsProcessor.apply
        p = z.softmax(-1)
        z = z.masked_fill(p < p.amax(-1, keepdim=True) * t.min_p, float("-inf"))
    rows = z.shape[0]
    k = torch.full((rows,), t.top_k) if t.top_k > 0 else None
    p = torch.full((rows,), t.top_p, dtype=z.dtype) if t.top_p < 1 else None
    return ~torch.isinf(apply_top_k_top_p_pytorch(z, k, p))


@pytest.mark.vllm
@pytest.mark.parametrize("vocab", [64, 320, 5000])
@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])
def test_kept_sets_equal_vllms(vocab, scale):
    """Random float32 logits (no ties): every setting keeps exactly vLLM's set, row by row, whatever the spread."""
    pytest.importorskip("vllm")
    z = torch.randn(48, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    for t in SETTINGS:
        ours = ~torch.isinf(truncate_logits(z, t))
        assert torch.equal(ours, _vllm_kept(z, t)), (t, (ours != _vllm_kept(z, t)).sum())


def test_top_p_boundary_is_computed_like_exact_arithmetic():
    """p = 0.999 over 5,000 tokens: the float64 reference rule and ours keep the same tail (a float32 cumulative
    sum moved the boundary by up to 10 tokens here)."""
    z = torch.randn(64, 5000, generator=torch.Generator().manual_seed(3)) * 3
    t = Truncation(top_p=0.999)
    exact = ~torch.isinf(truncate_logits(z.double(), t))
    assert torch.equal(~torch.isinf(truncate_logits(z, t)), exact)
    # independent float64 form of the rule: keep the tokens whose strictly-larger mass is below p
    p, order = z.double().softmax(-1).sort(dim=-1, descending=True)  # [R, V] (no ties in random floats)
    above = torch.zeros_like(p).scatter_(-1, order, p.cumsum(-1) - p)  # [R, V] mass strictly above each token
    assert torch.equal(exact, above < 0.999)


def test_nucleus_larger_than_the_first_candidates():
    """A flat distribution: the top-p set spans thousands of tokens, more than the first topk looks at."""
    z = torch.randn(4, 20000, generator=torch.Generator().manual_seed(5)) * 0.01
    kept = ~torch.isinf(truncate_logits(z, Truncation(top_p=0.9)))
    counts = kept.sum(-1)
    assert bool((counts > 17000).all()) and bool((counts < 19000).all()), counts
    mass = (z.softmax(-1) * kept).sum(-1)
    assert bool((mass >= 0.9).all())
    smallest_kept = torch.where(kept, z.softmax(-1), torch.ones_like(z)).amin(-1)
    assert bool((mass - smallest_kept < 0.9).all())  # minimal: dropping the smallest kept token falls below p


def test_ties_at_the_boundaries():
    """top-k keeps every token tied with the k-th (vLLM's ``logits < kth`` rule: here 4 tokens for k=2); top-p
    keeps every token tied with its boundary token (vLLM keeps a sort-order-dependent subset of them)."""
    z = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0 + 1e-9]]))
    assert (~torch.isinf(truncate_logits(z, Truncation(top_k=2)))).tolist() == [[True] * 4 + [False]]
    assert (~torch.isinf(truncate_logits(z, Truncation(top_p=0.5)))).tolist() == [[True] * 4 + [False]]
    assert (~torch.isinf(truncate_logits(z, Truncation(top_p=0.4)))).tolist() == [[True] + [False] * 4]
    # top-k's tie kept, then top-p over the four it left (renormalised: 0.4 / 0.2 / 0.2 / 0.2 of 1.0)
    assert (~torch.isinf(truncate_logits(z, Truncation(top_k=2, top_p=0.9)))).tolist() == [[True] * 4 + [False]]
    assert (~torch.isinf(truncate_logits(z, Truncation(top_k=2, top_p=0.5)))).tolist() == [[True] * 4 + [False]]
    assert (~torch.isinf(truncate_logits(z, Truncation(top_k=1, top_p=0.5)))).tolist() == [[True] + [False] * 4]
    # the most likely token always stays, and min-p compares with the largest probability
    assert (~torch.isinf(truncate_logits(z, Truncation(top_p=1e-6)))).tolist() == [[True] + [False] * 4]
    assert (~torch.isinf(truncate_logits(z, Truncation(min_p=0.5)))).tolist() == [[True] * 4 + [False]]
    assert (~torch.isinf(truncate_logits(z, Truncation(min_p=0.51)))).tolist() == [[True] + [False] * 4]


def test_excluded_tokens_never_count():
    """Tokens the engine never samples (the kernel's excluded logit) stay out even when k exceeds the rest."""
    z = torch.tensor([[3.0, 2.0, 1.0, EXCLUDED_LOGIT, EXCLUDED_LOGIT]])
    assert float(kept_threshold(z, Truncation(top_k=4))[0]) == EXCLUDED_LOGIT  # k-th is an excluded token
    lp = torch.log_softmax(truncate_logits(z, Truncation(top_k=4)), -1)
    assert torch.allclose(lp[0, :3], torch.log_softmax(z[0, :3], -1))  # exp(-1e4) is 0: renormalised over three


def test_settings_are_checked():
    assert not Truncation().active and Truncation(top_k=1).active and Truncation(min_p=0.1).active
    with pytest.raises(ValueError, match="top_p"):
        Truncation(top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        Truncation(min_p=1.5)
    assert Truncation(top_k=5, top_p=0.7).describe() == "top_k=5, top_p=0.7"


def _case(n, hidden, vocab, *, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()  # [N, H]
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_()  # [V, H]
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_()  # [V]
    return h, w, b, g


def _inside_targets(h, w, b, t: Truncation, temperature: float, g) -> torch.Tensor:
    """[N] a token of each row's kept set, drawn from the truncated distribution (what the engine samples)."""
    with torch.no_grad():
        probs = torch.softmax(truncate_logits((h @ w.T + b) / temperature, t), -1)
    return torch.multinomial(probs.float(), 1, generator=g)[:, 0]


@pytest.mark.parametrize("t", SETTINGS, ids=str)
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_truncated_log_probs_equal_the_naive_ones_in_float64(t, chunk_size):
    """Values, entropy and the hand-written backward of the truncated distribution against autograd through a
    full-vocabulary float64 computation (the kept set a constant, as for the sampler)."""
    h, w, b, g = _case(23, 16, 257, seed=1)
    temperature = 0.7
    tgt = _inside_targets(h, w, b, t, temperature, g)
    gl, ge = torch.randn(23, generator=g, dtype=torch.float64), torch.randn(23, generator=g, dtype=torch.float64)

    def grads(fn):
        for x in (h, w, b):
            x.grad = None
        logp, ent = fn()
        ((logp * gl).sum() + (ent * ge).sum()).backward()
        return logp.detach(), ent.detach(), [x.grad.clone() for x in (h, w, b)]

    ref = grads(lambda: naive_log_probs(h, w, tgt, bias=b, temperature=temperature, truncation=t))
    out = {}

    def chunked():
        r = chunked_sampled_log_probs(h, w, tgt, bias=b, chunk_size=chunk_size, temperature=temperature,
                                      return_entropy=True, truncation=t)
        out["outside"] = r.outside
        return r.log_probs, r.entropy

    got = grads(chunked)
    assert not bool(out["outside"].any())
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    for a, e in zip(got[2], ref[2]):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    full = naive_log_probs(h, w, tgt, bias=b, temperature=temperature)[0].detach()
    assert float((got[0] - full).min()) > 1e-3  # control: truncation raises every kept token's log-prob


def test_a_target_outside_its_kept_set_is_flagged_and_scored_untruncated():
    """top-k 3 and targets that are each row's LEAST likely token: flagged, finite, equal to the untruncated
    log-prob (and entropy) of that row; the other rows are unaffected; gradients are finite."""
    h, w, b, g = _case(12, 16, 200, dtype=torch.float32, seed=2)
    t = Truncation(top_k=3)
    with torch.no_grad():
        logits = h @ w.T + b
    tgt = _inside_targets(h, w, b, t, 1.0, g)
    tgt[::3] = logits.argmin(-1)[::3]  # rows 0, 3, 6, 9 sampled a token the truncation drops
    r = chunked_sampled_log_probs(h, w, tgt, bias=b, chunk_size=4, return_entropy=True, truncation=t)
    flagged = torch.zeros(12, dtype=torch.bool)
    flagged[::3] = True
    assert torch.equal(r.outside, flagged)
    assert bool(torch.isfinite(r.log_probs).all()) and bool(torch.isfinite(r.entropy).all())
    full_lp, full_ent = naive_log_probs(h, w, tgt, bias=b)
    trunc_lp, trunc_ent = naive_log_probs(h, w, tgt, bias=b, truncation=t)
    torch.testing.assert_close(r.log_probs[flagged], full_lp[flagged].detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(r.entropy[flagged], full_ent[flagged].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.log_probs[~flagged], trunc_lp[~flagged].detach(), rtol=0, atol=1e-5)
    assert bool(torch.isinf(trunc_lp[flagged]).all())  # what an unguarded computation gives: -inf
    (r.log_probs.sum() + r.entropy.sum()).backward()
    assert all(bool(torch.isfinite(x.grad).all()) for x in (h, w, b))


def test_no_truncation_is_the_plain_distribution():
    h, w, b, g = _case(9, 8, 50, dtype=torch.float32, seed=4)
    tgt = torch.randint(0, 50, (9,), generator=g)
    plain = chunked_sampled_log_probs(h, w, tgt, bias=b, temperature=0.8)
    off = chunked_sampled_log_probs(h, w, tgt, bias=b, temperature=0.8, truncation=Truncation())
    assert torch.equal(plain.log_probs, off.log_probs) and not bool(off.outside.any())
    # the kept mass is what `full` misses: log p_sampled - log p_full = -log(kept mass) for every kept token
    t = Truncation(top_k=10)
    tgt = _inside_targets(h, w, b, t, 0.8, g)
    s = chunked_sampled_log_probs(h, w, tgt, bias=b, temperature=0.8, truncation=t).log_probs
    f = chunked_sampled_log_probs(h, w, tgt, bias=b, temperature=0.8).log_probs
    with torch.no_grad():
        p = torch.softmax((h @ w.T + b) / 0.8, -1)
        kept = (p * ~torch.isinf(truncate_logits((h @ w.T + b) / 0.8, t))).sum(-1)
    torch.testing.assert_close((s - f).detach(), -torch.log(kept), rtol=1e-5, atol=1e-5)
    assert math.isclose(float(kept.mean()), float(torch.exp(f - s).detach().mean()), rel_tol=1e-4)
