"""Turning the trainer's last step into the curves PNG and the HTML rollout report (``report.py`` draws them).

Files: ``output_dir/curves.png`` and ``output_dir/report.html`` (the latest), plus ``output_dir/reports/
step-00000100.html`` per report step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from mmrlhf.agents.types import Trajectory
from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.rollout import ScoredRollout
from mmrlhf.trainer.curves import plot_curves
from mmrlhf.trainer.report import ReportSample, write_rollout_report


class StepReporter:
    def __init__(self, output_dir: str | Path, tokenizer: Any, *, groups: int = 8, title: str = "") -> None:
        self.out = Path(output_dir)
        self.tokenizer, self.groups, self.title = tokenizer, groups, title

    @property
    def curves_path(self) -> Path:
        return self.out / "curves.png"

    @property
    def report_path(self) -> Path:
        return self.out / "report.html"

    def write(self, step: int, history: Sequence[Mapping[str, Any]], rollout: ScoredRollout | None,
              items: Sequence[TrainItem], metrics: Mapping[str, float]) -> None:
        plot_curves(history, self.curves_path, title=self.title)
        if rollout is None:
            return
        samples = self.samples(rollout, items)
        (self.out / "reports").mkdir(parents=True, exist_ok=True)
        per_step = self.out / "reports" / f"step-{step:08d}.html"
        write_rollout_report(samples, per_step, step=step, title=self.title, metrics=metrics)
        write_rollout_report(samples, self.report_path, step=step, title=self.title, metrics=metrics)

    def samples(self, rollout: ScoredRollout, items: Sequence[TrainItem]) -> list[ReportSample]:
        """The first ``groups`` groups of the rollout (items are in rollout order: one per sample).

        A multi-turn row carries its trajectory: the card shows its turns, ``response`` is its final answer (the
        decoded ids would mix in the observations) and ``images`` keeps the prompt's images only (the row's list
        ends with the tool images, which the turns show where they were returned)."""
        rows, r = rollout.rows, rollout.rewards
        keep_groups = list(dict.fromkeys(rows.group))[: self.groups]
        chosen = set(keep_groups)
        if rows.multi_turn and len(rows.trajectories) != len(rows):
            raise ValueError(f"multi-turn rollout has {len(rows.trajectories)} trajectories for {len(rows)} rows")
        trajectories = rows.trajectories if rows.multi_turn else [None] * len(rows)
        shown = [i for i in range(len(rows)) if rows.group[i] in chosen]
        plain = [i for i in shown if trajectories[i] is None]
        texts = dict(zip(plain, self.tokenizer.batch_decode([rows.response_ids[i] for i in plain],
                                                            skip_special_tokens=True)))
        out = []
        for i in shown:
            trajectory = trajectories[i]
            if trajectory is None:
                response, images = texts[i], list(rows.images[i])
            else:
                response = trajectory.final_answer
                images = _prompt_images(list(rows.images[i]), trajectory, rows.describe(i))
            adv = None
            if i < len(items):
                mask = items[i].token["loss_mask"]
                adv = float(items[i].token["advantages"][mask].mean()) if mask.any() else None
            parts = {name: _value(col[i]) for name, col in {**r.sources, **r.parts}.items()}
            notes = {name: texts[i] for name, texts in r.notes.items() if texts[i] is not None}
            out.append(ReportSample(
                prompt=rows.prompts[i], response=response, reward=float(r.rewards[i]), advantage=adv,
                images=images, parts=parts, label=None if rows.labels[i] is None else str(rows.labels[i]),
                reference=None if rows.references[i] is None else str(rows.references[i]), group=rows.group[i],
                valid=bool(r.valid[i]), trajectory=trajectory, notes=notes))
        return out


def _prompt_images(images: list[Any], trajectory: Trajectory, where: str) -> list[Any]:
    """A multi-turn row's images without the tool images at their end (the row holds prompt images + tool images)."""
    n_tool = sum(len(t.images) for t in trajectory.turns if t.role == "tool")
    if n_tool > len(images):
        raise ValueError(f"{where}: the trajectory returned {n_tool} tool images but the row holds {len(images)}")
    return images[: len(images) - n_tool]


def _value(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v  # NaN: the source / part did not apply
