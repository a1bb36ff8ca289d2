"""What one generation round produced, per sample, before any model scored it: :class:`Rollout` (ids, vision,
text, the engine's log-probs) and :class:`ScoredRollout` (the same plus rewards).

Why a stage of its own: dynamic sampling (DAPO) decides which groups to keep from their REWARDS alone, so the
expensive forwards (actor, reference, critic) should only run on the groups that survive, possibly gathered over
several rounds. ``ScoredRollout.select`` keeps rows, ``ScoredRollout.concat`` joins rounds (group ids stay unique),
and the experience maker turns the result into :class:`~mmrlhf.experience.types.ExperienceVL` micro-batches.
Plain data, no engine or model references.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mmrlhf.models.truncation import Truncation
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings

LOGPROB_MODES = ("sampled", "full")


@dataclass(frozen=True)
class ScoringDistribution:
    """The distribution a rollout's log-probs are taken under, by the maker's forwards (old log-probs), the
    update (new ones) and Ray's re-scoring alike: the sampling temperature and, with ``rollout.logprob_mode:
    sampled``, the sampler's truncation. Derived here only (:meth:`of`) and carried by the rollout and the step
    batch, so the three cannot disagree."""

    temperature: float = 1.0
    truncation: Truncation | None = None

    @classmethod
    def of(cls, sampling: SamplingSettings, logprob_mode: str = "sampled") -> "ScoringDistribution":
        """Greedy decoding (temperature 0) is scored at 1 and never truncated (vLLM reports its full
        distribution); ``full`` scores untruncated; ``sampled`` under the sampler's min-p / top-k / top-p."""
        if logprob_mode not in LOGPROB_MODES:
            raise ValueError(f"logprob_mode must be one of {LOGPROB_MODES}, got {logprob_mode!r}")
        if sampling.temperature <= 0:
            return cls()
        truncation = Truncation(top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p)
        return cls(sampling.temperature, truncation if logprob_mode == "sampled" and truncation.active else None)


@dataclass
class Rollout:
    """Per-sample results of generation, in sample order (only samples whose prompt was generated)."""

    sample_index: list[int]  # index into the processor's batch of this round
    group: list[int]  # prompt (group) id: samples of one prompt share it; unique across concatenated rounds
    prompt_ids: list[list[int]]  # the processor's (possibly truncated) prompt ids
    response_ids: list[list[int]]
    engine_logprobs: list[list[float] | None]  # per response token: the engine's log-prob (sampling distribution)
    finished: list[bool]  # the engine's word: stopped by EOS / a stop string (False: cut by max_new_tokens)
    vision: list[dict[str, torch.Tensor]]
    prompts: list[str]  # the chat-templated text of prompt_ids (truncation included): the prompt the policy saw
    labels: list[Any]
    references: list[Any]
    images: list[list[Any]]
    record_ids: list[Any]  # the caller's record id of each sample (None where none was given)
    # Multi-turn rollouts only (empty lists otherwise): per response token 1 policy / 0 observation, and the
    # trajectory (turns, calls, results, how it ended) reward functions and reports read.
    policy_masks: list[list[int]] = field(default_factory=list)
    trajectories: list[Any] = field(default_factory=list)
    # rollout.routing_replay (mixture-of-experts engines): per sample the experts the engine routed its prompt +
    # response tokens to, [tokens, L, k] int16 (empty list: not recorded)
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    # rollout.partial: per sample, per response token, the policy version that sampled it (empty list: one version)
    token_versions: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sample_index)

    @classmethod
    def empty(cls) -> "Rollout":
        """No rows: what a call whose every prompt was skipped produced."""
        return cls(*[[] for _ in dataclasses.fields(cls)])

    @property
    def multi_turn(self) -> bool:
        return bool(self.policy_masks)

    def policy_lengths(self) -> list[int]:
        """Policy tokens per sample (every response token of a single-turn sample)."""
        if not self.multi_turn:
            return [len(r) for r in self.response_ids]
        return [int(sum(m)) for m in self.policy_masks]

    def select(self, rows: Sequence[int] | range) -> "Rollout":
        rows = list(rows)
        return Rollout(*[[values[r] for r in rows] if values else []
                         for values in (getattr(self, f.name) for f in dataclasses.fields(self))])

    def describe(self, i: int) -> str:
        """``"sample 5 (record 'abc-7')"``: how errors name row ``i``."""
        rid = self.record_ids[i]
        return f"sample {self.sample_index[i]}" + (f" (record {rid!r})" if rid is not None else "")


@dataclass
class ScoredRollout:
    """A :class:`Rollout` with its rewards ``[N]`` and what generating it cost and reported."""

    rows: Rollout
    rewards: RewardResult
    sampling: SamplingSettings  # the call's sampling settings (the one source of temperature / max length)
    metrics: dict[str, float] = field(default_factory=dict)  # generation + reward metrics of what was SAMPLED
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds (prepare, generate, reward)
    logprob_mode: str = "sampled"  # rollout.logprob_mode of the maker that generated it
    # One line per prompt skipped in making it (its record and the reason: bad input, too long for the data limit or
    # the engine's context), for the error of a step that has nothing left to train.
    skipped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def distribution(self) -> ScoringDistribution:
        """What its log-probs, old and new, are taken under (see :class:`ScoringDistribution`)."""
        return ScoringDistribution.of(self.sampling, self.logprob_mode)

    @property
    def group_ids(self) -> torch.Tensor:
        return torch.tensor(self.rows.group, dtype=torch.long)  # [N]

    def select(self, rows: Sequence[int]) -> "ScoredRollout":
        """The rows ``rows`` (in that order); metrics still describe everything that was sampled."""
        rows = list(rows)
        pick = torch.as_tensor(rows, dtype=torch.long)
        r = self.rewards
        rewards = RewardResult(
            rewards=r.rewards[pick], valid=r.valid[pick], sources={k: v[pick] for k, v in r.sources.items()},
            parts={k: v[pick] for k, v in r.parts.items()}, metrics=dict(r.metrics),
            weights={k: v[pick] for k, v in r.weights.items()},
            notes={k: [v[i] for i in rows] for k, v in r.notes.items()})
        return ScoredRollout(self.rows.select(rows), rewards, self.sampling, dict(self.metrics), dict(self.seconds),
                             self.logprob_mode, list(self.skipped))

    @staticmethod
    def concat(parts: Sequence["ScoredRollout"]) -> "ScoredRollout":
        """Rounds joined in order (their sampling settings may differ in the seed only; the first round's are kept);
        group ids of later rounds are shifted so no two rounds share one. Metrics:
        counts and seconds add up, other values are averaged weighted by each round's sampled count
        (``samples``)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len(parts) == 1:
            return parts[0]
        # Each round draws from its own derived seed; rounds that differ only there are one setting (the seed
        # says where the noise came from, not what distribution the samples follow or how they are scored).
        settings = [dataclasses.replace(p.sampling, seed=None) for p in parts]
        other = next((p.sampling for p, s in zip(parts, settings) if s != settings[0]), None)
        if other is not None:
            raise ValueError(f"rounds sampled with different settings cannot be trained on together: "
                             f"{parts[0].sampling} vs {other}")
        if len({p.logprob_mode for p in parts}) > 1:
            raise ValueError("rounds scored under different rollout.logprob_mode cannot be trained on together")
        if len({p.rows.multi_turn for p in parts}) > 1:
            raise ValueError("single-turn and multi-turn rounds cannot be trained on together")
        cols: dict[str, list] = {f.name: [] for f in dataclasses.fields(Rollout)}
        offset = 0
        for p in parts:
            for f in dataclasses.fields(Rollout):
                values = getattr(p.rows, f.name)
                cols[f.name].extend([g + offset for g in values] if f.name == "group" else values)
            offset = max(cols["group"], default=-1) + 1
        rewards = RewardResult(
            rewards=torch.cat([p.rewards.rewards for p in parts]), valid=torch.cat([p.rewards.valid for p in parts]),
            sources=_cat_columns([p.rewards.sources for p in parts], [len(p) for p in parts]),
            parts=_cat_columns([p.rewards.parts for p in parts], [len(p) for p in parts]),
            metrics=merge_round_metrics([p.rewards.metrics for p in parts], [p.metrics.get("samples", len(p))
                                                                             for p in parts]),
            weights=_cat_columns([p.rewards.weights for p in parts], [len(p) for p in parts], fill=0.0),
            notes=_cat_notes([p.rewards.notes for p in parts], [len(p) for p in parts]),
        )
        seconds: dict[str, float] = {}
        for p in parts:
            for k, v in p.seconds.items():
                seconds[k] = seconds.get(k, 0.0) + v
        metrics = merge_round_metrics([p.metrics for p in parts], [p.metrics.get("samples", len(p)) for p in parts])
        return ScoredRollout(Rollout(**cols), rewards, parts[0].sampling, metrics, seconds, parts[0].logprob_mode,
                             [line for p in parts for line in p.skipped])


def describe_skips(lines: Sequence[str], limit: int = 5) -> str:
    """The first ``limit`` skip lines joined, and how many more: an error message's account of what was skipped."""
    if not lines:
        return "no prompt was given"
    shown = "; ".join(lines[:limit])
    return shown + (f"; and {len(lines) - limit} more" if len(lines) > limit else "")


# Metrics that are counts (they add up over rounds, ranks and rollout actors); everything else is a mean or a rate
# (docs/reports.md lists which is which).
_COUNT_SUFFIXES = ("/count", "/failures", "/not_applicable", "reward/masked", "reward/failed_samples",
                   "reward/no_applicable_source", "prompts", "samples", "skipped_prompts", "truncated_prompts",
                   "generated_tokens", "train/samples_trained", "groups/sampled")


def is_count_metric(key: str) -> bool:
    """Whether ``key`` counts things (summed when shares are merged) rather than averaging them."""
    return key.endswith(_COUNT_SUFFIXES)


def merge_share_metrics(metrics: Sequence[dict[str, float]], weights: Sequence[float]) -> dict[str, float]:
    """Metrics of the shares of ONE step computed side by side (torchrun ranks, Ray rollout actors) as the step's:
    counts summed, ``time/*`` the slowest share's (they ran in parallel), every other value averaged with
    ``weights`` (each share's sample count: a per-sample mean of the whole step). One share is the step's as it is
    (no rounding through the weights)."""
    if len(metrics) == 1:
        return {k: float(v) for k, v in metrics[0].items()}
    out: dict[str, float] = {}
    for key in sorted({k for m in metrics for k in m}):
        present = [(float(m[key]), float(w)) for m, w in zip(metrics, weights) if key in m]
        if is_count_metric(key):
            out[key] = sum(v for v, _ in present)
        elif key.startswith("time/"):
            out[key] = max(v for v, _ in present)
        else:
            total = sum(w for _, w in present)
            out[key] = sum(v * w for v, w in present) / total if total else sum(v for v, _ in present) / len(present)
    return out


def merge_round_metrics(metrics: Sequence[dict[str, float]], weights: Sequence[float]) -> dict[str, float]:
    """Metrics of several sampling rounds as one: counts summed, other values averaged with ``weights``
    (each over the rounds that report it)."""
    out: dict[str, float] = {}
    keys = sorted({k for m in metrics for k in m})
    for key in keys:
        present = [(m[key], w) for m, w in zip(metrics, weights) if key in m]
        if is_count_metric(key) or key.startswith("time/"):
            out[key] = float(sum(v for v, _ in present))
        else:
            total = sum(w for _, w in present)
            out[key] = float(sum(v * w for v, w in present) / total) if total else float(present[0][0])
    return out


def _cat_notes(columns: list[dict[str, list]], sizes: list[int]) -> dict[str, list]:
    """Per-sample texts of several rounds joined; a note a round lacks is None there."""
    names = sorted({k for c in columns for k in c})
    return {name: [text for c, n in zip(columns, sizes) for text in c.get(name, [None] * n)] for name in names}


def _cat_columns(columns: list[dict[str, torch.Tensor]], sizes: list[int],
                 fill: float = float("nan")) -> dict[str, torch.Tensor]:
    """[N_r] named columns of several rounds -> [sum N_r]; a column a round lacks is ``fill`` there."""
    names = sorted({k for c in columns for k in c})
    return {name: torch.cat([c.get(name, torch.full((n,), fill)) for c, n in zip(columns, sizes)])
            for name in names}
