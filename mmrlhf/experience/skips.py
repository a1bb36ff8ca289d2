"""A call whose every prompt was skipped: what it reports and the error of scoring it.

Why a module of its own: an empty share is not an error where it is made (a torchrun rank or a Ray rollout actor
whose prompts were all skipped trains an inert sample beside the others, :meth:`~mmrlhf.trainer.rollouts.
LocalRollouts._cover`), so the maker returns it with the lines that say why, and only scoring it is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.experience.kinds.base import Generated
from mmrlhf.rewards.types import RewardResult


class NothingToScoreError(ValueError):
    """A rollout with no sample reached the scoring stage (every prompt of it was skipped)."""


def skipped_lines(batch: Any, out: Generated, kind: Any) -> list[str]:
    """One line per prompt a call skipped: the processor's (bad input, over ``prompt_max_len``) and the engine's
    (over its context), each naming its record and the reason; and where prompts were left that gave no sample
    (trajectories that all ended before their first turn), one line saying so."""
    lines = [s.message for s in batch.skipped]
    lines += [f"{batch.describe_sample(i * batch.n_samples_per_prompt)}: {reason}"
              for i, reason in sorted(out.skipped.items())]
    left = len(batch) // max(batch.n_samples_per_prompt, 1) - len(out.skipped)
    if not len(out.rows) and left > 0:
        lines.append(f"the rollout kind {type(kind).__name__} made no sample of the {left} prompt(s) left (multi-turn: "
                     "every trajectory ended before its first turn, see agent/ended/before_first_turn/count)")
    return lines


def empty_rewards() -> RewardResult:
    """The reward result of no sample."""
    return RewardResult(rewards=torch.zeros(0), valid=torch.zeros(0, dtype=torch.bool), sources={}, parts={},
                        metrics={})
