"""Turning the trainer's last step into the curves PNG and the HTML rollout report (``curves.py`` and ``report.py``
draw them).

Files: ``output_dir/curves.png`` and ``output_dir/report.html`` (the latest), plus ``output_dir/reports/
step-00000100.html`` per report step.

What the report shows of a step is built by :func:`report_samples` from the rollout and its train items, wherever
they are: the loop does it at report time from the step batch's rollout (one process, torchrun rank 0), and a
producer whose rollout stays in another process (a Ray rollout actor) does it there, for report steps only
(:func:`is_report_step`), and sends the result, :func:`compact` (the first ``groups`` groups, images no larger than
the page shows them): plain data, so the step batch holds no reference to an engine or a model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from PIL import Image

from mmrlhf.agents.types import Trajectory
from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.rollout import ScoredRollout
from mmrlhf.trainer.curves import plot_curves
from mmrlhf.trainer.report import MAX_IMAGE_SIDE, ReportSample, write_rollout_report


def is_report_step(step: int, report_steps: int, max_steps: int) -> bool:
    """Whether the loop reports after ``step`` finished steps: every ``report_steps`` and at the last step (a stop
    request reports too, which only the loop knows)."""
    return bool(report_steps and step % report_steps == 0) or step == max_steps


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

    def write(self, step: int, history: Sequence[Mapping[str, Any]], samples: Sequence[ReportSample] | None,
              metrics: Mapping[str, float]) -> None:
        """The curves, and when the step's samples are known the step's page and ``report.html``."""
        plot_curves(history, self.curves_path, title=self.title)
        if samples is None:
            return
        (self.out / "reports").mkdir(parents=True, exist_ok=True)
        per_step = self.out / "reports" / f"step-{step:08d}.html"
        write_rollout_report(samples, per_step, step=step, title=self.title, metrics=metrics)
        write_rollout_report(samples, self.report_path, step=step, title=self.title, metrics=metrics)

    def shown(self, batch: Any) -> list[ReportSample] | None:
        """What the report shows of a :class:`~mmrlhf.trainer.rollouts.StepBatch`: the samples its producer built
        (``report``), else built here from its rollout and items; None when it has neither."""
        if batch is None:
            return None
        if batch.report is not None:
            return list(batch.report)
        if batch.rollout is None:
            return None
        return self.samples(batch.rollout, batch.items)

    def samples(self, rollout: ScoredRollout, items: Sequence[TrainItem]) -> list[ReportSample]:
        return report_samples(rollout, items, self.tokenizer, self.groups)


def report_samples(rollout: ScoredRollout, items: Sequence[TrainItem], tokenizer: Any,
                   groups: int) -> list[ReportSample]:
    """The first ``groups`` groups of the rollout (items are in rollout order: one per sample; an item's advantage is
    its mean over the tokens its loss mask keeps).

    A multi-turn row carries its trajectory: the card shows its turns, ``response`` is its final answer (the
    decoded ids would mix in the observations) and ``images`` keeps the prompt's images only (the row's list
    ends with the tool images, which the turns show where they were returned)."""
    rows, r = rollout.rows, rollout.rewards
    chosen = set(list(dict.fromkeys(rows.group))[:groups])
    if rows.multi_turn and len(rows.trajectories) != len(rows):
        raise ValueError(f"multi-turn rollout has {len(rows.trajectories)} trajectories for {len(rows)} rows")
    trajectories = rows.trajectories if rows.multi_turn else [None] * len(rows)
    shown = [i for i in range(len(rows)) if rows.group[i] in chosen]
    plain = [i for i in shown if trajectories[i] is None]
    texts = dict(zip(plain, tokenizer.batch_decode([rows.response_ids[i] for i in plain],
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
        notes = {name: notes[i] for name, notes in r.notes.items() if notes[i] is not None}
        out.append(ReportSample(
            prompt=rows.prompts[i], response=response, reward=float(r.rewards[i]), advantage=adv,
            images=images, parts=parts, label=None if rows.labels[i] is None else str(rows.labels[i]),
            reference=None if rows.references[i] is None else str(rows.references[i]), group=rows.group[i],
            valid=bool(r.valid[i]), trajectory=trajectory, notes=notes))
    return out


def compact(samples: Sequence[ReportSample], max_side: int = MAX_IMAGE_SIDE) -> list[ReportSample]:
    """``samples`` ready to travel to another process: every image (the prompt's and the tools') no larger than the
    page draws it, each source image shrunk once and shared where it was shared (a group's prompt image is one
    object for its samples, so it is sent once); a trajectory keeps what the page shows (its ``info``, free-form
    environment data, stays behind)."""
    cache: dict[int, Any] = {}

    def small(image: Any) -> Any:
        if id(image) not in cache:
            if isinstance(image, Image.Image) and max(image.size) > max_side:
                thumb = image.copy()
                thumb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
                cache[id(image)] = thumb
            else:
                cache[id(image)] = image
        return cache[id(image)]

    out = []
    for s in samples:
        trajectory = s.trajectory
        if trajectory is not None:
            turns = [dataclasses.replace(t, images=[small(im) for im in t.images]) for t in trajectory.turns]
            trajectory = dataclasses.replace(trajectory, turns=turns, info={})
        out.append(dataclasses.replace(s, images=[small(im) for im in s.images], trajectory=trajectory))
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
