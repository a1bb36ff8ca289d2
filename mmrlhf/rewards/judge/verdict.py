"""Scores from a judge's output, three ways (``scoring``):

- ``verdict``: the first verdict word of the judge's final answer (thinking stripped), whole word, case-blind,
  mapped to its score (``{yes: 1, no: 0}`` by default).
- ``number``: the last number in the final answer, which must lie in ``score_range`` ``[lo, hi]``; the score is
  ``(x - lo) / (hi - lo)``, in [0, 1].
- ``verdict_prob``: no parsing and no sampling noise: from the top log-probs of the judge's FIRST generated token,
  the verdict-weighted mean ``sum_w p(w) * score(w) / sum_w p(w)`` over the verdict words (tokens whose text,
  stripped and lower-cased, is a verdict word; variants such as ``yes`` and `` yes`` add up). With ``{yes: 1, no:
  0}`` this is ``p(yes) / (p(yes) + p(no))``. No verdict word among the top tokens is a parse failure.

A parse failure raises :class:`VerdictError`; the source turns it into that sample's error (the failure policy
decides) and counts it.
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from mmrlhf.rewards.rules import final_answer

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


class VerdictError(ValueError):
    """The judge's output holds no usable verdict."""


def _word_pattern(verdicts: Mapping[str, float]) -> re.Pattern:
    words = sorted(verdicts, key=len, reverse=True)  # "incorrect" before "correct"
    return re.compile(r"(?<![\w-])(" + "|".join(re.escape(w) for w in words) + r")(?![\w-])", re.I)


def parse_verdict(text: str, verdicts: Mapping[str, float]) -> tuple[float, str]:
    """(score, verdict word) of the first verdict word in ``text``'s final answer."""
    answer = final_answer(text)
    match = _word_pattern(verdicts).search(answer)
    if match is None:
        raise VerdictError(f"no verdict word ({', '.join(verdicts)}) in the judge's answer {answer[-200:]!r}")
    lowered = {k.lower(): v for k, v in verdicts.items()}
    word = match.group(1).lower()
    return float(lowered[word]), word


def parse_number(text: str, score_range: tuple[float, float]) -> tuple[float, str]:
    """(score in [0, 1], the number as written) of the last number in ``text``'s final answer."""
    lo, hi = score_range
    answer = final_answer(text)
    numbers = _NUMBER.findall(answer)
    if not numbers:
        raise VerdictError(f"no number in the judge's answer {answer[-200:]!r}")
    value = float(numbers[-1])
    if not lo <= value <= hi:
        raise VerdictError(f"the judge's number {numbers[-1]} is outside score_range [{lo:g}, {hi:g}]")
    return (value - lo) / (hi - lo), numbers[-1]


def verdict_probability(top_logprobs: Mapping[str, float], verdicts: Mapping[str, float]) -> tuple[float, str]:
    """(verdict-weighted score, most probable verdict word) from the first token's ``{token text: log-prob}``."""
    lowered = {k.lower(): v for k, v in verdicts.items()}
    mass: dict[str, float] = {}
    for token, logprob in top_logprobs.items():
        word = token.strip().lower()
        if word in lowered and math.isfinite(logprob):
            mass[word] = mass.get(word, 0.0) + math.exp(logprob)
    total = sum(mass.values())
    if total <= 0.0:
        shown = ", ".join(repr(t) for t in list(top_logprobs)[:8])
        raise VerdictError(f"no verdict token ({', '.join(verdicts)}) among the first token's top log-probs "
                           f"({shown} ...)")
    score = sum(p * lowered[w] for w, p in mass.items()) / total
    return score, max(mass, key=mass.__getitem__)


def score_output(scoring: str, text: str, top_logprobs: Mapping[str, float] | None,
                 verdicts: Mapping[str, float], score_range: tuple[float, float]) -> tuple[float, str]:
    """(score, verdict) of one judge output under ``scoring`` (``verdict`` | ``number`` | ``verdict_prob``)."""
    if scoring == "verdict":
        return parse_verdict(text, verdicts)
    if scoring == "number":
        return parse_number(text, score_range)
    if scoring == "verdict_prob":
        if top_logprobs is None:
            raise VerdictError("scoring 'verdict_prob' needs the first token's log-probs; the judge sent none")
        return verdict_probability(top_logprobs, verdicts)
    raise ValueError(f"unknown judge scoring {scoring!r}; valid: verdict, number, verdict_prob")
