"""The sampler's truncation (min-p, top-k, top-p) as a per-row logit threshold, for scoring what the engine sampled.

Why: vLLM reports (and samples from) the *processed* distribution: temperature, then min-p, then top-k, then top-p,
renormalised over what is left. A trainer that scores tokens under the full softmax computes the log-prob of a
different distribution: the ratio ``pi_trainer / mu_engine`` is then off by the kept probability mass of every
step (with top-k 20 on a real model, often most of the log-ratio). Scoring under the same truncation makes the two
agree again (``rollout.logprob_mode: sampled``, docs/algorithms.md).

Every truncation keeps the tokens whose logit is at least a per-row threshold, so the kept set of a row is one number:
:func:`kept_threshold` computes it from a [c, V] chunk of logits without sorting the vocabulary where it can, and
the chunked log-prob kernel (:mod:`mmrlhf.models.logprobs`) fills what lies below it with its excluded-token logit.
No [tokens, vocab] tensor is made: the work is per chunk, plus [c, K] candidates of top-p.

The rules, as vLLM 0.32 applies them (``vllm/v1/sample``: ``MinPLogitsProcessor``, ``apply_top_k_top_p``):

- min-p ``m``: drop tokens whose probability is below ``m`` times the row's largest, i.e. logits below
  ``max + log(m)``;
- top-k ``k``: keep tokens at least as large as the k-th largest logit. Ties AT the boundary are all kept (vLLM
  compares ``logits < kth``), so a row can keep more than k tokens;
- top-p ``p`` (over the distribution min-p and top-k left): keep the largest tokens until the mass of those strictly
  above a token reaches ``p``: the smallest prefix of the descending order whose mass is ``>= p``, the most likely
  token always. vLLM sorts ascending and drops tokens whose ascending cumulative mass is ``<= 1 - p``; that is the
  same set up to float rounding of the two cumulative sums (~1e-7 of the mass). Ties AT the top-p boundary: vLLM
  keeps as many of the tied tokens as its sort order reaches (its sort is not stable, so which ones is not defined);
  here all tied tokens are kept. The sampled token is then always inside, and the log-probs differ from the engine's
  by at most the tied tokens' extra mass, only in rows where the boundary falls on a tie.

Greedy decoding is never truncated (vLLM reports the untempered, untruncated distribution for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Candidates top-p examines per row first. A trained model's nucleus at p 0.7-0.95 is usually a few to a few hundred
# tokens, so one topk of this size settles most rows; only the others pay for more (``_top_p_threshold``).
TOP_P_FIRST_CANDIDATES = 256
# Row block of top-p's passes over whole rows (the floor's mass; a wide nucleus: a copy of the row and its sort), so
# that their temporaries stay far below the chunk's own [c, V] logits.
WIDE_ROWS_AT_ONCE = 32


@dataclass(frozen=True)
class Truncation:
    """The engine's truncation of the tempered distribution; the defaults truncate nothing."""

    top_k: int = -1  # <= 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def active(self) -> bool:
        """Whether anything is cut."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def describe(self) -> str:
        parts = [f"min_p={self.min_p}"] * (self.min_p > 0) + [f"top_k={self.top_k}"] * (self.top_k > 0)
        return ", ".join(parts + [f"top_p={self.top_p}"] * (self.top_p < 1.0)) or "none"


def _top_p_threshold(logits: torch.Tensor, floor: torch.Tensor, top_p: float,
                     candidates: torch.Tensor | None) -> torch.Tensor:
    """[c] threshold of the top-p set of the distribution ``logits >= floor`` renormalised.

    ``candidates`` [c, K] (descending): top-k's values, among which the kept set lies. Otherwise the
    ``TOP_P_FIRST_CANDIDATES`` largest logits first (a trained model's nucleus is usually smaller); the rows whose
    nucleus is larger (a flat distribution) then get a number of candidates that provably holds it (below), or their
    whole sorted row when that is over an eighth of the vocabulary. Only those rows pay for it.

    Masses are float64 sums of float32 terms ``exp(logit - max)``: the boundary is where a cumulative mass crosses
    p, and a float32 log-sum-exp (one ulp of a value near 10 is 1e-6 of the mass) moved it by several tail tokens at
    p 0.999, more than vLLM's own float32 arithmetic does."""
    vocab = logits.shape[-1]
    top = logits.amax(dim=-1)  # [c]
    if candidates is not None:
        # top-k's candidates come one beyond k (see kept_threshold). Unless the (k+1)-th ties with the k-th while the
        # k-th is the floor, the floor's set lies among the first k, and its mass needs no pass over the row.
        kept = candidates[:, :-1]  # [c, k]
        tied = (candidates[:, -1] == kept[:, -1]) & (floor <= kept[:, -1])  # [c]
        if not bool(tied.any()):
            terms = torch.where(kept >= floor[:, None], (kept - top[:, None]).exp(), 0.0)  # [c, k]
            return _prefix_threshold(kept, floor, top, terms.sum(dim=-1, dtype=torch.float64), top_p)
    mass = torch.cat([_floor_weights(logits[s:s + WIDE_ROWS_AT_ONCE], floor[s:s + WIDE_ROWS_AT_ONCE],
                                     top[s:s + WIDE_ROWS_AT_ONCE]).sum(dim=-1, dtype=torch.float64)
                      for s in range(0, logits.shape[0], WIDE_ROWS_AT_ONCE)])  # [c] mass of the floor's set
    if candidates is not None:  # ties at the k-th: the whole floor's set is summed above
        return _prefix_threshold(candidates, floor, top, mass, top_p)
    k = min(vocab, TOP_P_FIRST_CANDIDATES)
    vals = logits.topk(k, dim=-1).values  # [c, k] descending
    keep = _kept_prefix(vals, floor, top, mass, top_p)  # [c]
    threshold = vals.gather(-1, (keep - 1)[:, None])[:, 0]  # [c]
    wide = (keep >= k).nonzero()[:, 0] if k < vocab else keep.new_empty(0)  # rows whose nucleus may reach past k
    for part in wide.split(WIDE_ROWS_AT_ONCE) if wide.numel() else ():  # a few rows at a time: copies stay small
        # Tokens lighter than x = (1 - p) * mass / n (n: tokens in the floor's set) carry at most (1 - p) of the mass
        # together, so the tokens at least that heavy already reach p: the nucleus lies among them (x / 2: margin).
        sub, sub_floor = logits[part], floor[part]  # [w, V], [w]
        sub_w = _floor_weights(sub, sub_floor, top[part])  # [w, V]
        n = (sub >= sub_floor[:, None]).sum(dim=-1).clamp_min(1)  # [w]
        bound = ((1.0 - top_p) * mass[part] / n / 2).to(sub_w.dtype)  # [w]
        need = max(int((sub_w >= bound[:, None]).sum(dim=-1).max()), 2 * k)
        if need > vocab // 8:  # a sort beats a top-k this large; lighter tokens than the bound cannot be kept
            vals = sub.sort(dim=-1, descending=True).values[:, :need]
        else:
            vals = sub.topk(need, dim=-1).values
        threshold[part] = _prefix_threshold(vals, sub_floor, top[part], mass[part], top_p)
    return threshold


def _floor_weights(logits: torch.Tensor, floor: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """[w, V] float32 ``exp(logit - max)`` of the tokens at or above the row's floor, 0 below it. Called on a few
    rows at a time, so no temporary as large as the chunk's logits is made."""
    weights = logits - top[:, None]  # [w, V]
    if not bool(torch.isneginf(floor).all()):
        weights.masked_fill_(logits < floor[:, None], float("-inf"))
    return weights.exp_()


def _kept_prefix(vals: torch.Tensor, floor: torch.Tensor, top: torch.Tensor, mass: torch.Tensor,
                 top_p: float) -> torch.Tensor:
    """[c, K] descending candidates -> [c] size of each row's kept prefix (>= 1): the candidates whose strictly
    larger mass is below ``top_p`` (``mass``: the row's float64 sum of ``exp(logit - top)`` over the floor's set)."""
    inside = vals >= floor[:, None]  # [c, K] a prefix of each row
    probs = torch.where(inside, (vals.double() - top.double()[:, None]).exp() / mass[:, None], 0.0)  # [c, K]
    above = probs.cumsum(dim=-1) - probs  # [c, K] mass strictly above each candidate
    return ((above < top_p) & inside).sum(dim=-1).clamp_min(1)


def _prefix_threshold(vals: torch.Tensor, floor: torch.Tensor, top: torch.Tensor, mass: torch.Tensor,
                      top_p: float) -> torch.Tensor:
    """[c, K] descending candidates holding every row's kept set -> [c] the smallest kept logit."""
    keep = _kept_prefix(vals, floor, top, mass, top_p)
    return vals.gather(-1, (keep - 1)[:, None])[:, 0]


def kept_threshold(logits: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """[c, V] tempered float logits -> [c] per-row threshold: the truncation keeps exactly the tokens whose logit is
    ``>= threshold`` (-inf: everything). Excluded tokens (the kernel's very negative logit) have probability 0
    wherever the threshold falls (top-k larger than what is left of the vocabulary keeps them, at no mass)."""
    c, vocab = logits.shape
    floor = logits.new_full((c,), float("-inf"))  # [c]
    if truncation.min_p > 0.0:
        floor = torch.maximum(floor, logits.amax(dim=-1) + math.log(truncation.min_p))
    top = None
    if 0 < truncation.top_k < vocab:
        # one beyond k: top-p can then tell whether the k-th value is tied past k (see _top_p_threshold)
        top = logits.topk(min(truncation.top_k + 1, vocab), dim=-1).values  # [c, k + 1] descending
        floor = torch.maximum(floor, top[:, truncation.top_k - 1])
    if truncation.top_p < 1.0:
        floor = torch.maximum(floor, _top_p_threshold(logits, floor, truncation.top_p, top))
    return floor


def truncate_logits(logits: torch.Tensor, truncation: Truncation, fill: float = float("-inf")) -> torch.Tensor:
    """Reference form: [R, V] tempered logits with every token the truncation drops set to ``fill`` (a copy)."""
    if not truncation.active:
        return logits.clone()
    return logits.masked_fill(logits < kept_threshold(logits, truncation)[:, None], fill)
