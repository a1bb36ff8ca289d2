"""The per-step progress bar: reward, evaluation reward, KL, response length, the share of groups with reward
variance (GRPO's collapse warning: it falls towards 0 when every group answers alike), step time, and reward
failures when a source masked samples out."""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Iterator, Mapping

# (metric, label, format) in display order; absent metrics are left out.
FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("kl/mean", "kl", "{:.4f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("groups/with_variance_frac", "var_groups", "{:.2f}"),
    ("policy/entropy", "ent", "{:.2f}"),
    ("time/step", "s/step", "{:.2f}"),
)


def postfix(metrics: Mapping[str, float], last_eval: Mapping[str, float] | None = None) -> str:
    parts = []
    for key, label, fmt in FIELDS:
        value = metrics.get(key)
        if value is not None and math.isfinite(value):
            parts.append(f"{label}={fmt.format(value)}")
    if last_eval and "eval/reward/mean" in last_eval:
        parts.insert(1, f"eval={last_eval['eval/reward/mean']:.3f}")
    failed = metrics.get("reward/failed_samples", 0.0) + metrics.get("reward/no_applicable_source", 0.0)
    if failed:
        parts.append(f"REWARD_MASKED={int(failed)}")
    skipped = metrics.get("policy/skipped_steps", 0.0)
    if skipped:
        parts.append(f"NONFINITE_SKIPS={int(skipped)}")
    if metrics.get("train/empty_steps") is not None and "policy/optimizer_steps" not in metrics:
        parts.append("NO_UPDATE(all groups flat)")
    return " ".join(parts)


class ProgressBar:
    """A tqdm bar over rollout steps (a plain line per step when stderr is not a terminal)."""

    def __init__(self, total: int, *, initial: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = None
        self._tty = sys.stderr.isatty()
        if enabled and self._tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
        self.step, self.total = initial, total

    def update(self, metrics: Mapping[str, float], last_eval: Mapping[str, float] | None = None) -> None:
        self.step += 1
        if not self.enabled:
            return
        text = postfix(metrics, last_eval)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        else:
            print(f"step {self.step}/{self.total} {text}", file=sys.stderr, flush=True)

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


@contextmanager
def no_library_bars() -> Iterator[None]:
    """transformers' own progress bars off for the duration (e.g. ``Writing model shards`` at every checkpoint): a
    second bar drawn under the training bar breaks its line, and on a log file each becomes two lines per save."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
