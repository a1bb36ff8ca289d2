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

# First number of candidates top-p examines per row; grown 8x while any row's nucleus is larger. A trained model's
# nucleus at p 0.7-0.95 is usually a few to a few hundred tokens, so one topk of this size settles most chunks.
TOP_P_FIRST_CANDIDATES = 256


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


def _kept_mass(logits: torch.Tensor, floor: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """[c, V], [c], [c] row maxima -> [c] float64 sum of ``exp(logit - max)`` over the logits at or above the floor.

    Summed in float64 (each term is a float32 exp): top-p's boundary is where a cumulative mass crosses p, and a
    float32 log-sum-exp (one ulp of a value near 10 is 1e-6 of the mass) moved it by several tail tokens at p 0.999,
    more than vLLM's own float32 arithmetic does."""
    shifted = logits - top[:, None]  # [c, V] the one temporary
    if not bool(torch.isneginf(floor).all()):
        shifted.masked_fill_(logits < floor[:, None], float("-inf"))
    return shifted.exp_().sum(dim=-1, dtype=torch.float64)


def _top_p_threshold(logits: torch.Tensor, floor: torch.Tensor, top_p: float,
                     candidates: torch.Tensor | None) -> torch.Tensor:
    """[c] threshold of the top-p set of the distribution ``logits >= floor`` renormalised.

    ``candidates`` [c, K] (descending; e.g. top-k's values) when the kept set is known to lie among them; otherwise
    the largest logits are taken ``TOP_P_FIRST_CANDIDATES`` at first, more while the nucleus does not fit."""
    top = logits.amax(dim=-1)  # [c]
    mass = _kept_mass(logits, floor, top)  # [c] float64
    vocab = logits.shape[-1]
    k = candidates.shape[-1] if candidates is not None else min(vocab, TOP_P_FIRST_CANDIDATES)
    while True:
        vals = candidates if candidates is not None else logits.topk(k, dim=-1).values  # [c, K] descending
        inside = vals >= floor[:, None]  # [c, K] a prefix of each row
        # float64 (see _kept_mass): vLLM's ascending float32 sum adds the small tail first and stays accurate
        probs = torch.where(inside, (vals.double() - top.double()[:, None]).exp() / mass[:, None], 0.0)  # [c, K]
        above = probs.cumsum(dim=-1) - probs  # [c, K] mass strictly above each candidate
        keep = ((above < top_p) & inside).sum(dim=-1).clamp_min(1)  # [c] size of the kept prefix
        # keep < K: the boundary (or the end of the floor's set) lies among the candidates; K = V: all are there
        if candidates is not None or k >= vocab or bool((keep < k).all()):
            return vals.gather(-1, (keep - 1)[:, None])[:, 0]
        k = min(vocab, k * 8)


def kept_threshold(logits: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """[c, V] tempered float logits -> [c] per-row threshold: the truncation keeps exactly the tokens whose logit is
    ``>= threshold`` (-inf: everything). Excluded tokens (a very negative logit) fall below any real threshold."""
    c, vocab = logits.shape
    floor = logits.new_full((c,), float("-inf"))  # [c]
    if truncation.min_p > 0.0:
        floor = torch.maximum(floor, logits.amax(dim=-1) + math.log(truncation.min_p))
    top = None
    if 0 < truncation.top_k < vocab:
        top = logits.topk(truncation.top_k, dim=-1).values  # [c, k] descending
        floor = torch.maximum(floor, top[:, -1])
    if truncation.top_p < 1.0:
        floor = torch.maximum(floor, _top_p_threshold(logits, floor, truncation.top_p, top))
    return floor


def truncate_logits(logits: torch.Tensor, truncation: Truncation, fill: float = float("-inf")) -> torch.Tensor:
    """Reference form: [R, V] tempered logits with every token the truncation drops set to ``fill`` (a copy)."""
    if not truncation.active:
        return logits.clone()
    return logits.masked_fill(logits < kept_threshold(logits, truncation)[:, None], fill)
