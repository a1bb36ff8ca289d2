"""Where a training run's prompts come from, in a resumable order.

Two kinds of source, one interface (``len`` and indexing by position):

- :class:`~mmrlhf.data.datasets.PromptDataset`: records from files, finite;
- :class:`GeneratedPrompts`: records made on the fly by a user function ``fn(index, *, split, **options) -> row``
  (a dict shaped like a JSONL row; images may be PIL images). Record ``i`` depends on ``i`` (and the split) only,
  so the stream is infinite, reproducible and resumes by its position alone. Splits keep evaluation prompts apart
  from training prompts (the toy tasks of ``mmrlhf.tasks`` derive their randomness from ``(split, index)``).

:class:`PromptStream` walks a source in batches: files in a fresh seeded permutation every epoch, generated
prompts in index order. Its ``state_dict`` is its position, so a resumed run continues with the next unseen prompt
instead of starting the data over.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from mmrlhf.data.errors import DataError
from mmrlhf.data.records import record_from_row
from mmrlhf.data.types import PromptRecord

logger = logging.getLogger(__name__)


class PromptSource(Protocol):
    def __getitem__(self, i: int) -> PromptRecord: ...


class GeneratedPrompts:
    """Records ``0, 1, 2, ...`` of ``fn`` for ``split`` (``len`` is None: the source never runs out).

    ``fn`` is resolved from ``package.module:function`` or ``path/to/file.py:function`` when given as a string;
    ``columns`` is a ``DataConfig`` (column names and placeholders, as for files).
    """

    def __init__(self, fn: str | Callable[..., Mapping[str, Any]], columns: Any, *, split: str = "train",
                 options: Mapping[str, Any] | None = None) -> None:
        if isinstance(fn, str):
            from mmrlhf.registry import import_object

            self.spec = fn
            fn = import_object(fn)
        else:
            self.spec = getattr(fn, "__qualname__", repr(fn))
        if not callable(fn):
            raise TypeError(f"prompt generator {self.spec!r} is not callable")
        self.fn, self.columns, self.split, self.options = fn, columns, split, dict(options or {})

    def __len__(self) -> int:
        raise TypeError("a generated prompt source has no length (it never runs out)")

    def __getitem__(self, i: int) -> PromptRecord:
        row = self.fn(int(i), split=self.split, **self.options)
        if not isinstance(row, Mapping):
            raise DataError(f"prompt generator returned {type(row).__name__}, expected a dict row", reason="bad_record",
                            index=int(i), file=self.spec)
        return record_from_row(dict(row), int(i), self.columns, source=f"{self.spec}[{self.split}]")


class PromptStream:
    """Batches of records from ``source``, endlessly, in a reproducible and resumable order.

    A sized source (files) is shuffled with ``seed + epoch`` when ``shuffle`` (a new permutation each epoch; batches
    run across epoch boundaries); an unsized one (a generator) is read in index order.
    """

    def __init__(self, source: Any, *, seed: int = 0, shuffle: bool = True,
                 restart_on_change: bool = False) -> None:
        self.source = source
        self.seed = int(seed)
        self.shuffle = shuffle
        self.restart_on_change = restart_on_change  # data.restart_stream_on_resume
        try:
            self.size: int | None = len(source)
        except TypeError:
            self.size = None
        if self.size == 0:
            raise ValueError("the prompt source is empty: every record was skipped or none was given")
        self.epoch = 0
        self.position = 0  # within the epoch (sized) or the absolute index (unsized)
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            assert self.size is not None
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.size, generator=g).tolist()
            else:
                self._order = list(range(self.size))
        return self._order

    def next_batch(self, size: int) -> list[PromptRecord]:
        """The next ``size`` records (never fewer)."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        out = []
        while len(out) < size:
            if self.size is None:
                out.append(self.source[self.position])
                self.position += 1
                continue
            order = self._epoch_order()
            take = order[self.position: self.position + size - len(out)]
            out.extend(self.source[i] for i in take)
            self.position += len(take)
            if self.position >= self.size:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    def fingerprint(self) -> dict[str, Any] | None:
        """The source's fingerprint (files: sizes, names and content hashes), or None (generated prompts: their
        spec and options are config keys, checked by the resume)."""
        probe = getattr(self.source, "fingerprint", None)
        return probe() if callable(probe) else None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"the checkpoint's data order used seed {state['seed']}, this run uses {self.seed}: "
                             "resume with the same trainer.seed")
        saved, now = state.get("fingerprint"), self.fingerprint()
        if saved is not None and now is not None and saved != now:
            what = describe_data_change(saved, now)
            if not self.restart_on_change:
                raise ValueError(f"the prompt data changed since the checkpoint ({what}): its saved position would "
                                 "point into another order. Restore the data, or start the prompt stream over on "
                                 "the new data with data.restart_stream_on_resume=true")
            logger.warning("the prompt data changed since the checkpoint (%s): the prompt stream starts over "
                           "(data.restart_stream_on_resume)", what)
            self.epoch, self.position, self._order = 0, 0, None
            return
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def describe_data_change(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """One line saying what differs between two dataset fingerprints."""
    parts = []
    if saved.get("records") != now.get("records"):
        parts.append(f"{saved.get('records')} -> {now.get('records')} records")
    old_files, new_files = saved.get("files", {}), now.get("files", {})
    for path in sorted(set(old_files) | set(new_files)):
        if path not in old_files:
            parts.append(f"{path} added")
        elif path not in new_files:
            parts.append(f"{path} removed")
        elif old_files[path] != new_files[path]:
            changed = sorted(k for k in set(old_files[path]) | set(new_files[path])
                             if old_files[path].get(k) != new_files[path].get(k))
            parts.append(f"{path}: {', '.join(changed)} changed")
    return "; ".join(parts) or "content changed"


def record_columns(records: Sequence[PromptRecord]) -> dict[str, list]:
    """Records as the experience maker's per-prompt columns (prompts, images, videos, references, labels, ids,
    record numbers in their files, base dirs, extra columns). Every launch mode (one process, torchrun ranks, Ray
    rollout actors, evaluation) hands records to the experience maker through this one function."""
    return {
        "prompts": [r.prompt for r in records],
        "images": [r.images for r in records],
        "videos": [r.videos for r in records],
        "references": [r.reference for r in records],
        "labels": [r.label for r in records],
        "record_ids": [r.record_id if r.record_id is not None else f"{r.source or 'row'}#{r.index}" for r in records],
        "record_indices": [r.index for r in records],  # each record's number in its file: what errors name
        "base_dirs": [r.base_dir for r in records],
        "extras": [r.extras for r in records],  # the records' own dicts (no copy)
    }
