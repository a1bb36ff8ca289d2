"""The data that flows into and out of the reward engine.

``RewardBatch`` is what the experience maker hands over; ``RewardResult`` is what it gets back. ``SourceScores``
is the uniform answer of one reward source (function, local model, remote server) for the samples it was given,
so the engine can apply one failure policy and one scatter-back to all of them.

Samples are named in every error by their ``index`` (position in the experience maker's batch, preserved through
sub-batch selection) and their label, so a failure deep inside a recipe still points at the right row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class RewardError(RuntimeError):
    """A reward could not be computed and the failure policy says to stop (the message names source and sample)."""


class RewardInputError(ValueError):
    """The batch handed to the reward engine is malformed (the message names the field and the sample)."""


@dataclass
class RewardBatch:
    """B samples to score. Text fields are always present; tensor / vision fields only where a source needs them."""

    responses: list[str]
    """Decoded response text only (rule rewards never look at the prompt)."""
    prompts: list[str]
    """Prompt text, kept separate from the response."""
    labels: list[str]
    """Per-sample label selecting the recipe (e.g. ``"math"``, ``"chart"``)."""
    references: list[Any]
    """Ground-truth answer per sample, as the dataset has it (str, number, list, ...; None where it has none).
    Remote sources receive the same values (JSON)."""
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """Further dataset columns, each a list of B values, passed to functions as keyword arguments."""
    sequences: torch.Tensor | None = None
    """[B, S] int64 prompt+response token ids, for local reward models."""
    attention_mask: torch.Tensor | None = None
    """[B, S] 0/1 mask matching ``sequences``."""
    vision: list[dict[str, torch.Tensor]] | None = None
    """B dicts of processor outputs, e.g. ``pixel_values`` [rows, D] and ``image_grid_thw`` [n_img, 3]; may be {}."""
    images: list[list[Any]] | None = None
    """B lists of raw (PIL) images, sent to remote servers."""
    index: list[int] | None = None
    """Position of each sample in the original batch (filled with 0..B-1 when omitted); used in error messages."""
    trajectories: list[Any] | None = None
    """Multi-turn rollouts: B :class:`mmrlhf.agents.types.Trajectory` objects (turns, tool calls and results, how it
    ended); ``responses`` are then each trajectory's final assistant message. Functions that declare a
    ``trajectories`` keyword receive them; others are called as for single-turn samples."""

    def __post_init__(self) -> None:
        n = len(self.responses)
        if self.index is None:
            self.index = list(range(n))
        columns: dict[str, Sequence[Any] | None] = {
            "prompts": self.prompts,
            "labels": self.labels,
            "references": self.references,
            "vision": self.vision,
            "images": self.images,
            "index": self.index,
            "trajectories": self.trajectories,
        }
        columns.update({f"extra[{k!r}]": v for k, v in self.extra.items()})
        for name, column in columns.items():
            if column is not None and len(column) != n:
                raise RewardInputError(f"RewardBatch.{name} has {len(column)} entries but responses has {n}")
        for name, tensor in (("sequences", self.sequences), ("attention_mask", self.attention_mask)):
            if tensor is not None and (tensor.dim() != 2 or tensor.shape[0] != n):
                raise RewardInputError(f"RewardBatch.{name} must be [B={n}, S], got shape {tuple(tensor.shape)}")
        if (
            self.sequences is not None
            and self.attention_mask is not None
            and self.sequences.shape != self.attention_mask.shape
        ):
            raise RewardInputError(
                f"RewardBatch.attention_mask shape {tuple(self.attention_mask.shape)} differs from sequences "
                f"shape {tuple(self.sequences.shape)}"
            )
        for i, (resp, label) in enumerate(zip(self.responses, self.labels)):
            if not isinstance(resp, str):
                raise RewardInputError(f"sample {self.index[i]}: responses must be str, got {type(resp).__name__}")
            if not isinstance(label, str):
                raise RewardInputError(f"sample {self.index[i]}: labels must be str, got {type(label).__name__}")

    def __len__(self) -> int:
        return len(self.responses)

    def describe(self, i: int) -> str:
        """``"sample 7 (label 'math')"`` for row ``i`` of this (possibly sub-) batch."""
        assert self.index is not None
        return f"sample {self.index[i]} (label {self.labels[i]!r})"

    def select(self, rows: Sequence[int]) -> "RewardBatch":
        """The sub-batch of ``rows`` (in that order); ``index`` keeps the original positions."""
        rows = list(rows)
        assert self.index is not None
        pick = torch.as_tensor(rows, dtype=torch.long)
        return RewardBatch(
            responses=[self.responses[r] for r in rows],
            prompts=[self.prompts[r] for r in rows],
            labels=[self.labels[r] for r in rows],
            references=[self.references[r] for r in rows],
            extra={k: [v[r] for r in rows] for k, v in self.extra.items()},
            sequences=None if self.sequences is None else self.sequences[pick],
            attention_mask=None if self.attention_mask is None else self.attention_mask[pick],
            vision=None if self.vision is None else [self.vision[r] for r in rows],
            images=None if self.images is None else [self.images[r] for r in rows],
            index=[self.index[r] for r in rows],
            trajectories=None if self.trajectories is None else [self.trajectories[r] for r in rows],
        )


@dataclass
class SourceScores:
    """One source's answer for the n samples it was given (all lists have n entries, in the order given).

    ``scores[i] is None`` with ``errors[i] is None`` means "does not apply"; ``errors[i]`` set means the sample
    failed (raised, NaN, wrong type) and the engine's failure policy decides what happens to it.
    """

    scores: list[float | None]
    parts: dict[str, list[float | None]] = field(default_factory=dict)
    errors: list[str | None] = field(default_factory=list)
    notes: dict[str, list[str | None]] = field(default_factory=dict)
    """Per-sample text to show with the sample in reports, by name (e.g. a judge's reply); None where absent."""

    def __post_init__(self) -> None:
        n = len(self.scores)
        if not self.errors:
            self.errors = [None] * n
        if len(self.errors) != n or any(len(v) != n for v in [*self.parts.values(), *self.notes.values()]):
            raise ValueError("SourceScores: scores, errors, every part and every note must have the same length")

    @classmethod
    def empty(cls, n: int) -> "SourceScores":
        return cls(scores=[None] * n, errors=[None] * n)


@dataclass
class RewardResult:
    """The engine's answer for a batch of B samples."""

    rewards: torch.Tensor
    """[B] float32 combined reward (sum of weight * source score over the sources that apply); 0 where invalid."""
    valid: torch.Tensor
    """[B] bool; False = masked out of the loss (a source failed under ``on_failure: mask``, or nothing applied)."""
    sources: dict[str, torch.Tensor]
    """source name -> [B] float32 score; NaN where the source was not run, did not apply, or failed."""
    parts: dict[str, torch.Tensor]
    """``"source/part"`` -> [B] float32 named part (e.g. ``"rule/format"``); NaN where absent."""
    metrics: dict[str, float]
    """Scalar logs: per-source and per-part means, counts, failures (goes to the experience's ``info``)."""
    notes: dict[str, list[str | None]] = field(default_factory=dict)
    """``"source/note"`` -> B texts a source attached to its samples (e.g. ``"judge/text"``, the judge's reply),
    shown in the rollout report; None where absent."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """source name -> [B] float32 weight of that source in each sample's recipe (0 where its recipe has no such
    term): with ``sources`` the recipe terms one by one, which per-component normalisation
    (``algorithm.reward_combination: per_component``) needs. Empty where a result was made by hand."""

    @property
    def info(self) -> dict[str, float]:
        """Alias of ``metrics`` under the name the experience maker uses."""
        return self.metrics

