"""The chunked head's distillation outputs (mmrlhf.models.logprobs): log-probs at extra ids per row (values and the
hand-written backward) and each row's top-k, against full log-softmax logits computed at once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmrlhf.models.logprobs import EXCLUDED_LOGIT, chunked_sampled_log_probs
from mmrlhf.models.truncation import Truncation


def _case(n=19, hidden=16, vocab=97, k=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()  # [N, H]
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.5).requires_grad_()  # [V, H]
    b = (torch.randn(vocab, generator=g, dtype=dtype) * 0.1).requires_grad_()  # [V]
    t = torch.randint(0, vocab, (n,), generator=g)  # [N] sampled tokens
    extra = torch.randint(0, vocab, (n, k), generator=g)  # [N, k]
    extra[:, 1] = t  # an extra id equal to the target, and
    extra[:, 2] = extra[:, 3]  # one id twice: their gradients add up
    return h, w, b, t, extra


def _reference(h, w, b, temperature, excluded):
    """All logits at once; an excluded token's is the same constant the chunked head gives it."""
    logits = F.linear(h, w, b) / temperature  # [N, V]
    if excluded is not None:
        logits = logits.index_fill(-1, excluded, EXCLUDED_LOGIT)
    return torch.log_softmax(logits, dim=-1)  # [N, V]


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_extra_ids_match_the_full_log_softmax_values_and_gradients(chunk_size, temperature):
    h, w, b, t, extra = _case()
    free = [i for i in range(w.shape[0]) if i not in set(t.tolist())]
    excluded = torch.tensor(free[:2])  # never a sampled token (the engine cannot sample them)
    extra[0, 0] = excluded[1]  # an excluded id scores ~ -1e4, with no gradient to speak of
    g = torch.Generator().manual_seed(1)
    g_t, g_x = torch.randn(t.shape, generator=g, dtype=h.dtype), torch.randn(extra.shape, generator=g, dtype=h.dtype)

    def grads(logp, extra_logp):
        for x in (h, w, b):
            x.grad = None
        ((logp * g_t).sum() + (extra_logp * g_x).sum()).backward()
        return [x.grad.clone() for x in (h, w, b)]

    out = chunked_sampled_log_probs(h, w, t, bias=b, chunk_size=chunk_size, temperature=temperature,
                                    excluded=excluded, extra_targets=extra)
    got = grads(out.log_probs, out.extra_log_probs)
    full = _reference(h, w, b, temperature, excluded)
    ref_t, ref_x = full.gather(-1, t[:, None])[:, 0], full.gather(-1, extra)
    torch.testing.assert_close(out.log_probs, ref_t, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.extra_log_probs, ref_x, rtol=0, atol=1e-9)  # ~1e4 for the excluded id
    assert float(out.extra_log_probs[0, 0].detach()) < EXCLUDED_LOGIT / 2
    torch.testing.assert_close(out.extra_log_probs[:, 1], out.log_probs, rtol=0, atol=0)
    want = grads(ref_t, ref_x)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)


def test_without_extra_ids_the_gradient_is_the_targets_alone():
    """The extra ids change nothing for a caller that passes none (the policy loss's own path)."""
    h, w, b, t, extra = _case(seed=2)
    g = torch.Generator().manual_seed(3)
    g_t = torch.randn(t.shape, generator=g, dtype=h.dtype)
    plain = chunked_sampled_log_probs(h, w, t, bias=b, chunk_size=5)
    (plain.log_probs * g_t).sum().backward()
    want = h.grad.clone()
    h.grad = None
    both = chunked_sampled_log_probs(h, w, t, bias=b, chunk_size=5, extra_targets=extra)
    (both.log_probs * g_t + 0.0 * both.extra_log_probs.sum(-1)).sum().backward()
    torch.testing.assert_close(h.grad, want, rtol=1e-12, atol=1e-14)
    assert plain.extra_log_probs is None and plain.top_log_probs is None and plain.top_ids is None


@pytest.mark.parametrize("chunk_size", [2, 1000])
def test_top_k_is_the_rows_largest_log_probs(chunk_size):
    h, w, b, t, _ = _case(seed=4)
    excluded = torch.tensor([7])
    out = chunked_sampled_log_probs(h, w, t, bias=b, chunk_size=chunk_size, temperature=0.8, excluded=excluded,
                                    topk=6)
    full = _reference(h, w, b, 0.8, excluded)
    values, ids = full.topk(6, dim=-1)
    torch.testing.assert_close(out.top_log_probs, values, rtol=0, atol=1e-12)
    assert torch.equal(out.top_ids, ids) and not out.top_log_probs.requires_grad
    assert not (out.top_ids == 7).any()


def test_top_k_under_a_truncation_is_the_truncated_distributions():
    """Sampled with top-k 4: the kept set's renormalised log-probs; the cut tokens sit ~60 nats below the best."""
    h, w, b, t, _ = _case(seed=5)
    trunc = Truncation(top_k=4)
    full = _reference(h, w, b, 1.0, None)
    kept = full.topk(4, dim=-1)
    t = kept.indices[:, 0]  # targets inside the kept set
    out = chunked_sampled_log_probs(h, w, t, bias=b, truncation=trunc, topk=6)
    torch.testing.assert_close(out.top_log_probs[:, :4], torch.log_softmax(kept.values, -1), rtol=0, atol=1e-12)
    assert torch.equal(out.top_ids[:, :4], kept.indices)
    assert (out.top_log_probs[:, 4:] < out.top_log_probs[:, :1] - 50).all()


def test_bad_shapes_are_refused():
    h, w, b, t, extra = _case()
    with pytest.raises(ValueError, match="extra_targets"):
        chunked_sampled_log_probs(h, w, t, extra_targets=extra[:-1])
    with pytest.raises(ValueError, match="topk"):
        chunked_sampled_log_probs(h, w, t, topk=w.shape[0] + 1)
