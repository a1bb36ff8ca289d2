"""Log-probs of chosen tokens and per-token entropy from final hidden states, in chunks over tokens.

Why chunks: with a 151,936-token vocabulary, float32 logits cost 600 KB per token, so a batch of 8k response tokens
would need ~5 GB just for one [N, V] logits tensor (and autograd would keep it, plus the log-softmax, for the
backward). Here the lm_head is applied to at most ``chunk_size`` tokens at a time, each chunk is reduced to what is
needed ([c] log-prob, log-sum-exp, entropy) and freed. The backward recomputes each chunk's logits instead of
storing them (a custom autograd function), so training peaks at a few [chunk_size, V] tensors as well.

Numerics match the naive ``log_softmax(F.linear(h, W, b).float() / T)``: logits are computed in the weights' dtype
and upcast to float32 before the softmax, as the model's own lm_head + ``.float()`` does.

``excluded`` token ids (the tokens the rollout engines never sample: vision special tokens and the user's forbidden
list) get a logit of ``EXCLUDED_LOGIT``: their probability is exactly 0 in float32, so the log-probs and entropy
are those of the distribution the engine actually sampled from, renormalised over the allowed vocabulary.

``truncation`` (:mod:`mmrlhf.models.truncation`: min-p, top-k, top-p, as the engine applies them after the
temperature): each row's tokens below its kept threshold get a logit ``TRUNCATED_GAP`` below the row's largest, so
log-probs, entropy and their gradients are those of the truncated, renormalised distribution (the kept set is a
constant of the step, as it is for the sampler) to within e^-60 of the mass per token, which no float32 or float64
sum keeps (< 1e-21 of it over a 151,936-token vocabulary). Why not ``EXCLUDED_LOGIT`` there: the CPU's vectorised exp
leaves its fast path for inputs below about -87 (results that are subnormal or 0), measured 5x slower over a chunk
filled with -1e4 and 14x with subnormal results, and the truncation fills most of the vocabulary.

A row whose target lies OUTSIDE its kept set (the engine's and the trainer's logits disagree at the boundary, or the
scoring model is not the one that sampled) is scored under the untruncated distribution instead and flagged in the
returned ``outside`` mask: a finite log-prob, never -inf or NaN, for the caller to mask (the policy's loss) or count
(the reference). The thresholds ([N] floats) are kept for the backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mmrlhf.models.truncation import Truncation, kept_threshold, truncate_logits


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax dtype: float32, or float64 for float64 inputs (lets tests check the math to 1e-10)."""
    return torch.promote_types(dtype, torch.float32)


# A finite stand-in for -inf: exp() of it is exactly 0 in float32 and p * log p stays 0 (no 0 * -inf = NaN).
EXCLUDED_LOGIT = -1.0e4
# How far below its row's largest logit a truncated token is put (module docstring).
TRUNCATED_GAP = 60.0


def _cut_below(logits: torch.Tensor, thresholds: torch.Tensor) -> None:
    """In place: [c, V] logits below their row's [c] threshold -> the row's largest logit - ``TRUNCATED_GAP``."""
    fill = logits.amax(dim=-1) - TRUNCATED_GAP  # [c]
    torch.where(logits < thresholds[:, None], fill[:, None], logits, out=logits)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                  excluded: torch.Tensor | None = None) -> torch.Tensor:
    """[c, H] -> [c, V] float32 logits (matmul in the weights' dtype, like the model's lm_head)."""
    logits = F.linear(h, weight, bias)  # [c, V] in the weights' dtype
    logits = logits.to(_acc_dtype(logits.dtype))  # [c, V] float32 (float64 stays float64)
    if temperature != 1.0:
        logits.div_(temperature)  # in place: no second [c, V] buffer
    if excluded is not None and excluded.numel():
        logits.index_fill_(-1, excluded, EXCLUDED_LOGIT)
    return logits


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function: forward and backward both walk the tokens in chunks; nothing of size [N, V] is stored."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, with_entropy, excluded, truncation,
                extra, topk):
        # hidden [N, H], weight [V, H], bias [V] | None, targets [N] long, excluded [K] long | None,
        # extra [N, J] long | None (more ids scored at each row, differentiable), topk: the row's top-k kept (0: none)
        n, acc = hidden.shape[0], _acc_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        ids = targets[:, None] if extra is None else torch.cat([targets[:, None], extra], dim=1)  # [N, 1 + J]
        logp = hidden.new_empty(n, ids.shape[1], dtype=acc)  # [N, 1 + J]
        lse = hidden.new_empty(n, dtype=acc)  # [N] log-sum-exp of each token's (kept) logits
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)  # [N] | [0]
        top_logp = hidden.new_empty(n, topk, dtype=acc)  # [N, k] | [N, 0]
        top_ids = torch.empty(n, topk, dtype=torch.long, device=hidden.device)  # [N, k] | [N, 0]
        truncate = truncation is not None and truncation.active
        thresholds = hidden.new_empty(n if truncate else 0, dtype=acc)  # [N] | [0] kept threshold (-inf: all)
        outside = torch.zeros(n, dtype=torch.bool, device=hidden.device)  # [N]
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = _chunk_logits(hidden[s:e], weight, bias, temperature, excluded)  # [c, V]
            if truncate:
                tau = kept_threshold(logits, truncation)  # [c]
                out = logits.gather(-1, targets[s:e, None])[:, 0] < tau  # [c] the target is cut away
                tau = tau.masked_fill(out, float("-inf"))  # such a row is scored untruncated (and flagged)
                _cut_below(logits, tau)
                thresholds[s:e], outside[s:e] = tau, out
            chunk_lse = torch.logsumexp(logits, dim=-1)  # [c]
            lse[s:e] = chunk_lse
            logp[s:e] = logits.gather(-1, ids[s:e]) - chunk_lse[:, None]
            if topk:
                values, top_ids[s:e] = logits.topk(topk, dim=-1)  # [c, k] largest first
                top_logp[s:e] = values - chunk_lse[:, None]
                del values
            if with_entropy:
                logq = logits.sub_(chunk_lse[:, None])  # [c, V] log-probs, in place (same buffer)
                plogp = logq.exp().mul_(logq)  # [c, V] p log p: the only second buffer
                entropy[s:e] = -plogp.sum(-1)
                del logq, plogp
            del logits
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy, excluded, thresholds)
        ctx.set_materialize_grads(False)  # an unused output (e.g. a detached entropy) gets None: skip its term
        ctx.mark_non_differentiable(outside, top_logp, top_ids)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy = chunk_size, temperature, with_entropy
        # separate tensors, not views of one: autograd tracks each output on its own
        return logp[:, 0].clone(), logp[:, 1:].clone(), entropy, outside, top_logp, top_ids

    @staticmethod
    def backward(ctx, grad_logp, grad_extra, grad_entropy, _grad_outside, _grad_top_logp, _grad_top_ids):
        # grad_logp [N], grad_extra [N, J] | None, grad_entropy [N] | [0] | None
        hidden, weight, bias, ids, lse, entropy, excluded, thresholds = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, chunk, temp = hidden.shape[0], ctx.chunk_size, ctx.temperature
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        acc = lse.dtype
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None  # [V, H] accumulated in fp32
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None  # [V]
        use_ent = ctx.with_entropy and grad_entropy is not None
        # [N, 1 + J] the gradient of every scored id's log-prob (the target's first); None: 0
        grads = [lse.new_zeros(n, 1) if grad_logp is None else grad_logp[:, None].to(lse.dtype)]
        if ids.shape[1] > 1:
            grads.append(lse.new_zeros(n, ids.shape[1] - 1) if grad_extra is None else grad_extra.to(lse.dtype))
        grad_ids = torch.cat(grads, dim=1)  # [N, 1 + J]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            # d logp_i / dz = onehot(i) - p for every scored id i;  d H / dz = -p * (log p + H).  Two [c, V]
            # buffers, updated in place.
            logits = _chunk_logits(hidden[s:e], weight, bias, temp, excluded)  # [c, V]
            if thresholds.numel():  # the forward's kept sets (constants of the step)
                _cut_below(logits, thresholds[s:e])
            logq = logits.sub_(lse[s:e, None])  # [c, V] log-probs
            g = logq.exp()  # [c, V] probabilities p, turned into the logits' gradient below
            if use_ent:
                ent_term = logq.add_(entropy[s:e, None]).mul_(g).mul_(grad_entropy[s:e, None])  # [c, V] in logq
            g.mul_(-grad_ids[s:e].sum(-1, keepdim=True))  # [c, V] -p * sum_i dL/dlogp_i
            if use_ent:
                g.sub_(ent_term)
                del ent_term
            del logq
            g.scatter_add_(-1, ids[s:e], grad_ids[s:e].to(g.dtype))  # + dL/dlogp_i at each id (repeats add up)
            if excluded is not None and excluded.numel() and ids.shape[1] > 1:
                # an excluded id's logit is a constant (its log-prob still moves with the log-sum-exp): a targets-only
                # call never scores one, extra ids may
                g.index_fill_(-1, excluded, 0.0)
            if temp != 1.0:
                g.div_(temp)
            g_lin = g.to(weight.dtype)  # [c, V] grad of the linear output, in the matmul dtype (as autograd casts)
            if need_h:
                grad_h[s:e] = (g_lin @ weight).to(hidden.dtype)  # [c, H]
            if need_w:
                grad_w.add_(g_lin.t() @ hidden[s:e].to(weight.dtype))  # [V, H]
            if need_b:
                grad_b.add_(g_lin.sum(0))
            del g, g_lin
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    excluded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and (optionally) entropy of the next-token distribution at each hidden state.

    hidden [N, H] (rows = the positions that predict each target), weight [V, H] (the lm_head), bias [V] | None,
    targets [N] long, ``excluded`` [K] long token ids removed from the distribution (see the module docstring).
    Returns (log_probs [N] float32, entropy [N] float32 | None; float64 for float64 inputs).
    Differentiable w.r.t. hidden, weight and bias (entropy too: usable as a bonus term); peak extra memory is two
    [chunk_size, V] buffers in the forward and in the backward (plus the weight's gradient).
    The untruncated distribution; :func:`chunked_sampled_log_probs` scores a truncated one.
    """
    out = chunked_sampled_log_probs(hidden, weight, targets, bias=bias, chunk_size=chunk_size, temperature=temperature,
                                    return_entropy=return_entropy, excluded=excluded)
    return out.log_probs, out.entropy


class SampledLogProbs(NamedTuple):
    log_probs: torch.Tensor  # [N] float32 (float64 for float64 inputs)
    entropy: torch.Tensor | None  # [N] entropy of the (truncated) distribution, when asked for
    outside: torch.Tensor  # [N] bool: the target lay outside its kept set (scored untruncated); all False untruncated
    extra_log_probs: torch.Tensor | None = None  # [N, J] log-probs of ``extra_targets`` (differentiable), if given
    top_log_probs: torch.Tensor | None = None  # [N, k] the row's k largest log-probs, largest first (``topk`` > 0)
    top_ids: torch.Tensor | None = None  # [N, k] long: their token ids


def chunked_sampled_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    excluded: torch.Tensor | None = None,
    truncation: Truncation | None = None,
    extra_targets: torch.Tensor | None = None,
    topk: int = 0,
) -> SampledLogProbs:
    """:func:`chunked_log_probs` of the distribution the engine sampled from: tempered, ``excluded`` removed, then
    cut by ``truncation`` (min-p, top-k, top-p; None or inactive: nothing cut) and renormalised. Targets outside
    their row's kept set are scored untruncated and flagged in ``outside`` (module docstring). The truncation costs
    per chunk one top-k (and, for top-p, a top-k of the nucleus' candidates plus one masked log-sum-exp); no
    [N, V] tensor is made.

    Beyond the one target per row, for distillation over more than the sampled token
    (:mod:`mmrlhf.algorithms.distill_topk`): ``extra_targets`` [N, J] long, more ids scored at each row under the
    same distribution (row's truncation and normalisation as decided by its target), returned differentiable in
    ``extra_log_probs`` [N, J] (the backward adds ``onehot(id) - p`` per id: no [N, V] tensor either); ``topk`` > 0
    returns each row's ``topk`` largest log-probs and their ids (``top_log_probs`` / ``top_ids`` [N, k], not
    differentiable: a teacher's record). Both cost a gather / a top-k of each chunk's logits, already computed."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N, H] and targets [N], got {tuple(hidden.shape)}, {tuple(targets.shape)}")
    if extra_targets is not None and (extra_targets.ndim != 2 or extra_targets.shape[0] != hidden.shape[0]):
        raise ValueError(f"expected extra_targets [N, J] with N = {hidden.shape[0]}, got {tuple(extra_targets.shape)}")
    if not 0 <= topk <= weight.shape[0]:
        raise ValueError(f"topk must be in [0, vocabulary size {weight.shape[0]}], got {topk}")
    logp, extra, entropy, outside, top_logp, top_ids = _ChunkedLogProbs.apply(
        hidden, weight, bias, targets.long(), int(chunk_size), float(temperature), bool(return_entropy),
        None if excluded is None else excluded.to(device=hidden.device, dtype=torch.long),
        truncation if truncation is not None and truncation.active else None,
        None if extra_targets is None else extra_targets.to(device=hidden.device, dtype=torch.long), int(topk),
    )
    return SampledLogProbs(logp, entropy if return_entropy else None, outside,
                           extra if extra_targets is not None else None,
                           top_logp if topk else None, top_ids if topk else None)


def naive_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    excluded: torch.Tensor | None = None,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full [N, V] float32 logits at once. For tests and benchmarks only (memory O(N * V)).
    ``truncation``: the truncated distribution, by the reference rule of :func:`truncate_logits` (every target
    must lie inside its kept set)."""
    logits = F.linear(hidden, weight, bias)  # [N, V]
    logits = logits.to(_acc_dtype(logits.dtype)) / temperature  # [N, V] float32 (float64 stays float64)
    if excluded is not None:
        logits[:, excluded] = float("-inf")
    if truncation is not None:
        logits = truncate_logits(logits, truncation)
    logq = torch.log_softmax(logits, dim=-1)  # [N, V]
    logp = logq.gather(-1, targets.long()[:, None])[:, 0]  # [N]
    p = logq.exp()
    # [N]; excluded / truncated tokens: 0 log 0 = 0, with -inf kept out of the product (its backward would be NaN)
    entropy = -(p * torch.where(p > 0, logq, torch.zeros_like(logq))).sum(-1)
    return logp, entropy
