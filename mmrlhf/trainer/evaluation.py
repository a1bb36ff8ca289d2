"""Periodic evaluation on held-out prompts: generate (greedy by default, one response per prompt), score with the
same reward engine, report ``eval/*`` metrics. Training state is untouched (no forward of the trainer's models).

With an agent, the rollout's ``agent/*`` metrics (tool calls per trajectory, turns, errors, endings, reward with and
without a tool) are reported as ``eval/agent/*``, under the names a training step uses: whether the policy calls its
tools on held-out prompts (greedy, by default) is otherwise invisible."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mmrlhf.data.errors import DataError
from mmrlhf.data.stream import record_columns
from mmrlhf.data.types import PromptRecord
from mmrlhf.experience.rollout import describe_skips
from mmrlhf.rollout.types import mix_seed

# Mixed into the run's seed for evaluations: their samples never share a stream with a training call's.
EVAL_STREAM = 0x6576616C  # "eval"


class Evaluator:
    """Scores the policy served by the maker's engine on ``records``.

    ``greedy``: temperature 0 (the policy's mode); otherwise the rollout temperature with ``n_samples`` responses per
    prompt and a fixed seed, so evaluations at different steps sample comparably.

    Every evaluation names its seed (:data:`EVAL_STREAM` mixed into ``seed``; greedy ones too), so it never draws
    from the run's per-call seed stream: a run's training samples are the same whatever ``trainer.eval_steps`` is.
    """

    def __init__(self, maker: Any, records: Sequence[PromptRecord], *, greedy: bool = True, n_samples: int = 1,
                 seed: int | None = 0) -> None:
        if not records:
            raise ValueError("evaluation needs at least one prompt")
        self.maker, self.records = maker, list(records)
        self.greedy, self.n_samples = greedy, n_samples
        self.seed = None if seed is None else mix_seed(seed, EVAL_STREAM)

    def run(self) -> dict[str, float]:
        overrides: dict[str, Any] = {"seed": self.seed}
        if self.greedy:
            overrides["temperature"] = 0.0
        rollout = self.maker.generate_rollout(**record_columns(self.records), n=1 if self.greedy else self.n_samples,
                                              **overrides)
        if not len(rollout):  # a held-out set that cannot be scored is the data's problem, said once
            raise DataError(f"evaluation: every held-out prompt was skipped ({describe_skips(rollout.skipped)})",
                            reason="evaluation_empty")
        r = rollout.rewards
        valid = r.valid
        out = {
            "eval/reward/mean": float(r.rewards[valid].mean()) if valid.any() else float("nan"),
            "eval/samples": float(len(rollout)),
            "eval/valid_frac": float(valid.float().mean()),
            "eval/response_length/mean": rollout.metrics["response_length/mean"],
        }
        labels = rollout.rows.labels
        for label in sorted({str(x) for x in labels if x is not None}):
            pick = torch.tensor([str(x) == label for x in labels]) & valid
            if pick.any():
                out[f"eval/reward/label/{label}/mean"] = float(r.rewards[pick].mean())
        out.update(agent_metrics(rollout.metrics))
        return out


def agent_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The rollout's ``agent/*`` metrics under ``eval/`` (none for a single-turn rollout)."""
    return {f"eval/{k}": float(v) for k, v in metrics.items() if k.startswith("agent/")}
