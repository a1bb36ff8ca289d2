"""Where the trainer's scalar metrics go: ``metrics.jsonl`` (the record), TensorBoard and, optionally, W&B.

Why a tracker of our own rather than a logging library: an RL run is judged from its curves, and a crashed or
resumed run must leave exactly one row per step behind. So the JSONL file is the source of truth: one JSON
object per ``log`` call, flushed and fsynced before ``log`` returns (a crash loses nothing logged), read back
on resume, and cut back with :meth:`MetricsTracker.truncate_after` to the step of the checkpoint the run
resumes from, so the replayed steps are not recorded twice. TensorBoard and W&B are views of the same rows.

A metric is a real number. NaN and +/-inf are kept as JSON ``null`` in the file (and ``None`` in
:meth:`MetricsTracker.history`), with a warning the first time a key goes non-finite, and are not sent to
TensorBoard or W&B (both would plot them as spikes or gaps without saying why). Anything else (a string, a
list, ``None``) is an error naming the key: a silently dropped metric is the kind of loss this module exists
to prevent.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import numbers
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id.txt"
_WANDB_MODES = ("online", "offline", "disabled")


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``: a reader (or a crash)
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    # os.open with 0o666 (not mkstemp's 0o600) so the file gets the umask's usual permissions.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases run settings (``pip install wandb`` to use them)."""

    project: str
    """W&B project name."""
    entity: str | None = None
    """W&B team or user; ``None``: the logged-in user's default."""
    run_name: str | None = None
    """Display name of the run; ``None``: W&B picks one."""
    mode: str = "online"
    """``online``, ``offline`` (sync later with ``wandb sync``) or ``disabled`` (W&B calls become no-ops)."""

    def __post_init__(self) -> None:
        if not self.project:
            raise ValueError("WandbSettings.project must be a non-empty project name")
        if self.mode not in _WANDB_MODES:
            raise ValueError(f"WandbSettings.mode must be one of {_WANDB_MODES}, got {self.mode!r}")


def _import_wandb() -> Any:
    """The ``wandb`` module, imported only when W&B settings are given (it is an optional dependency)."""
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise ImportError(
            "Weights & Biases logging was requested (WandbSettings given) but the 'wandb' package is not "
            "installed: run `pip install wandb` (or `pip install mmrlhf[wandb]`), or drop the W&B settings"
        ) from e


def _as_metric(key: Any, value: Any) -> float | None:
    """The value as a float, ``None`` when non-finite; an error naming the key for anything that is not a number."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"metric names must be non-empty strings, got {key!r}")
    if key == "step":
        raise ValueError("'step' is reserved for the step column; pass the step as log(step, ...)")
    if not isinstance(value, numbers.Number) and hasattr(value, "item"):  # a one-element tensor or array
        size = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)
        if size != 1:
            raise TypeError(f"metric {key!r} must be a number, got a tensor/array of {size} elements")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsTracker:
    """Logs scalar metrics per step to ``output_dir/metrics.jsonl``, ``output_dir/tensorboard`` and W&B.

    Usage: ``with MetricsTracker(out, resume=resuming) as t: [t.truncate_after(ckpt_step) if resuming]; t.log(step,
    metrics)``. ``resume=True`` reads the existing rows back (into :meth:`history`) and appends; ``resume=False`` on
    an output folder that already holds metrics is an error unless ``overwrite=True`` (a previous run's record is
    never replaced silently).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        tensorboard: bool = True,
        jsonl: bool = True,
        wandb: WandbSettings | None = None,
        run_config: dict | None = None,
        resume: bool = False,
        overwrite: bool = False,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path: Path | None = self.output_dir / METRICS_FILE if jsonl else None
        self._rows: list[dict] = []
        self._warned_nonfinite: set[str] = set()
        self._closed = False
        self._file = None
        self._tb = None
        self._wandb_run = None
        wandb_module = _import_wandb() if wandb is not None else None  # fail before anything is written
        if self.jsonl_path is not None:
            exists = self.jsonl_path.exists() and self.jsonl_path.stat().st_size > 0
            if resume and exists:
                self._rows = self._read_rows(self.jsonl_path)
            elif exists and not overwrite:
                raise FileExistsError(
                    f"{self.jsonl_path} already holds metrics of a previous run: pass resume=True to continue it, "
                    "overwrite=True to replace it, or choose another output_dir")
            self._file = open(self.jsonl_path, "a" if resume else "w", encoding="utf-8")
        try:
            if tensorboard:
                self._open_tensorboard(purge_step=None)
                if run_config:
                    text = json.dumps(run_config, indent=2, default=str)
                    self._tb.add_text("run_config", "```\n" + text + "\n```")
            if wandb is not None:
                self._wandb_run = self._init_wandb(wandb_module, wandb, run_config, resume)
        except BaseException:
            self.close(failed=True)
            raise

    # ---- backends -------------------------------------------------------------------------------------------------

    def _open_tensorboard(self, purge_step: int | None) -> None:
        # Imported here: TensorBoard's import costs about a second and is not needed with tensorboard=False.
        from torch.utils.tensorboard import SummaryWriter

        # purge_step makes TensorBoard hide the earlier event files' points at steps >= purge_step (resume).
        self._tb = SummaryWriter(log_dir=str(self.output_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def _init_wandb(self, wandb: Any, settings: WandbSettings, run_config: dict | None, resume: bool) -> Any:
        # The run id is kept next to the metrics so a resumed run continues the same W&B run.
        id_file = self.output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        run = wandb.init(project=settings.project, entity=settings.entity, name=settings.run_name,
                         mode=settings.mode, config=dict(run_config or {}), dir=str(self.output_dir),
                         id=run_id, resume="allow" if run_id else None)
        if getattr(run, "id", None):
            atomic_write(id_file, str(run.id))
        return run

    # ---- reading back ---------------------------------------------------------------------------------------------

    @staticmethod
    def _read_rows(path: Path) -> list[dict]:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        rows: list[dict] = []
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise ValueError("not an object with an integer 'step'")
            except ValueError as e:
                if i == len(lines) and not line.endswith("\n"):
                    # A crash in the middle of the last write: that row was never complete, so drop it.
                    logger.warning("%s: dropping the incomplete last line %d (%s)", path, i, e)
                    atomic_write(path, "".join(lines[:-1]))
                    break
                raise ValueError(f"{path}: line {i} is not a metrics row ({e}): {line[:200]!r}") from e
            rows.append(row)
        return rows

    # ---- public API -----------------------------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` at ``step``: one JSONL row (flushed), TensorBoard scalars and a W&B log."""
        if self._closed:
            raise RuntimeError("MetricsTracker.log called after close()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        values = {k: _as_metric(k, v) for k, v in metrics.items()}  # validate everything before writing anything
        for k, v in values.items():
            if v is None and k not in self._warned_nonfinite:
                self._warned_nonfinite.add(k)
                logger.warning("metric %r is not finite at step %d (%r): recorded as null", k, step, metrics[k])
        row = {"step": step, **values}
        if self._file is not None:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        self._rows.append(row)
        finite = {k: v for k, v in values.items() if v is not None}
        if self._tb is not None:
            for k, v in finite.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(finite, step=step)

    def truncate_after(self, step: int) -> int:
        """Forget rows with a step above ``step`` (the checkpoint a run resumes from); returns how many went.

        The file is rewritten atomically; TensorBoard is told to hide its points after ``step``. W&B cannot
        delete points: after a resume it ignores re-logged steps at or below the last one it saw (the JSONL file
        and TensorBoard hold the replayed values)."""
        if self._closed:
            raise RuntimeError("MetricsTracker.truncate_after called after close()")
        kept = [r for r in self._rows if r["step"] <= step]
        dropped = len(self._rows) - len(kept)
        self._rows = kept
        if self._file is not None and self.jsonl_path is not None:
            self._file.close()
            atomic_write(self.jsonl_path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
            self._file = open(self.jsonl_path, "a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._open_tensorboard(purge_step=step + 1)
        return dropped

    def history(self) -> list[dict]:
        """Every row logged (read back ones included on resume), in order, each ``{"step": k, **metrics}``;
        non-finite values are ``None`` as in the file."""
        return [dict(r) for r in self._rows]

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every backend (idempotent); ``failed=True`` marks the W&B run as failed."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=1 if failed else 0)

    def __enter__(self) -> MetricsTracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(failed=exc_type is not None)


class SilentTracker:
    """The metrics tracker of ranks > 0: rank 0 writes the run's metrics (already merged over ranks)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:  # noqa: ARG002
        return None

    def truncate_after(self, step: int) -> int:  # noqa: ARG002
        return 0

    def history(self) -> list[dict]:
        return []

    def close(self, *, failed: bool = False) -> None:  # noqa: ARG002
        return None

    def __enter__(self) -> "SilentTracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None
