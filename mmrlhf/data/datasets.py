"""Prompt datasets from local files: JSONL, Parquet, or a ``datasets.save_to_disk`` folder. Never the network.

Rows are read once into :class:`PromptRecord` s (text, labels, references and *references to* images / videos);
pixels are decoded later, batch by batch, by the processor. That keeps a large dataset's memory to its text, and
puts every vision guard rail (pixel limit before decoding, unreadable files) in one place with the record's name.
Relative image / video paths resolve against the folder of the file that holds the row.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional, Sequence

from mmrlhf.data.errors import DataError, SkipLog
from mmrlhf.data.records import record_from_row
from mmrlhf.data.types import PromptRecord

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


def read_rows(path: str) -> Iterator[dict]:
    """Rows of one source as plain dicts, in file order.

    Raises :class:`DataError` for a missing path, an unknown format, or a line that is not a JSON object.
    """
    if os.path.isdir(path):
        yield from _read_saved_dataset(path)
    elif not os.path.exists(path):
        raise DataError("prompt data path not found", reason="missing_file", file=path)
    elif path.endswith(JSONL_SUFFIXES):
        yield from _read_jsonl(path)
    elif path.endswith(PARQUET_SUFFIXES):
        yield from _read_parquet(path)
    else:
        raise DataError(f"unknown prompt data format; use {JSONL_SUFFIXES + PARQUET_SUFFIXES} files or a "
                        "datasets.save_to_disk folder", reason="bad_format", file=path)


def _read_jsonl(path: str) -> Iterator[dict]:
    """JSON lines; a ``.json`` file holding one JSON array of objects is accepted too."""
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            yield from _read_json_array(path)
            return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"line {lineno} is not valid JSON: {exc}", reason="bad_record", file=path) from exc
            if not isinstance(row, dict):
                raise DataError(f"line {lineno} is a JSON {type(row).__name__}, expected an object",
                                reason="bad_record", file=path)
            yield row


def _read_json_array(path: str) -> Iterator[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except json.JSONDecodeError as exc:
        raise DataError(f"not valid JSON: {exc}", reason="bad_format", file=path) from exc
    for k, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"element {k} is a JSON {type(row).__name__}, expected an object",
                            reason="bad_record", file=path)
        yield row


def _read_parquet(path: str) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for non-parquet files
        raise DataError(f"unreadable Parquet file: {exc}", reason="bad_format", file=path) from exc
    for batch in parquet.iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _read_saved_dataset(path: str) -> Iterator[dict]:
    import datasets

    try:
        data = datasets.load_from_disk(path)
    except Exception as exc:
        raise DataError(f"not a datasets.save_to_disk folder: {exc}", reason="bad_format", file=path) from exc
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"a DatasetDict without a 'train' split (splits: {', '.join(data)}); point at one "
                            "split's folder", reason="bad_format", file=path)
        data = data["train"]
    # Keep images encoded ({"bytes", "path"}): the vision loader checks the pixel limit before decoding.
    features = datasets.Features({name: _undecoded(f) for name, f in data.features.items()})
    if features != data.features:
        data = data.cast(features)
    yield from data


def _undecoded(feature: Any) -> Any:
    """``feature`` with every ``Image`` (also inside lists / dicts) set to ``decode=False``."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, datasets.List):
        return datasets.List(_undecoded(feature.feature), length=feature.length)
    if isinstance(feature, getattr(datasets, "LargeList", ())):
        return datasets.LargeList(_undecoded(feature.feature))
    if isinstance(feature, dict):
        return {k: _undecoded(v) for k, v in feature.items()}
    if isinstance(feature, list) and feature:
        return [_undecoded(feature[0])]
    return feature


HASH_WHOLE_BYTES = 64 << 20  # files up to this size are hashed whole; larger ones by their first and last 4 MiB
HASH_EDGE_BYTES = 4 << 20


def file_digest(path: str) -> str:
    """sha256 of a file's content (of its size, first and last 4 MiB beyond 64 MiB: a multi-GB parquet is not read
    whole at every start, and an edit changes its size or its footer)."""
    import hashlib

    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= HASH_WHOLE_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(str(size).encode())
            h.update(f.read(HASH_EDGE_BYTES))
            f.seek(size - HASH_EDGE_BYTES)
            h.update(f.read(HASH_EDGE_BYTES))
    return h.hexdigest()[:16]


def path_fingerprint(path: str) -> dict[str, str]:
    """``{relative file name: "size:digest"}`` of a data file, or of every file under a data folder."""
    if os.path.isdir(path):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
        return {os.path.relpath(f, path): f"{os.path.getsize(f)}:{file_digest(f)}" for f in files}
    return {os.path.basename(path): f"{os.path.getsize(path)}:{file_digest(path)}"}


def _base_dir(path: str) -> str:
    return os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path) or ".")


class PromptDataset:
    """All records of one or more sources, indexed ``0..len-1`` across sources in the order given.

    ``config``: a :class:`~mmrlhf.config.data.DataConfig` (column names, placeholders, ``on_bad_input``). A bad row
    raises naming it, or (``on_bad_input="skip"``) is left out, counted in :attr:`skips` and logged.
    """

    def __init__(self, paths: Sequence[str] | str, config: Any, skips: Optional[SkipLog] = None) -> None:
        self.config = config
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        if not self.paths:
            raise ValueError("no prompt data: set data.prompt_data to one or more files or folders")
        self.skips = skips if skips is not None else SkipLog(config.on_bad_input)
        self.records: list[PromptRecord] = []
        self._fingerprint: dict[str, Any] | None = None
        index = 0
        for path in self.paths:
            base_dir = _base_dir(path)
            for row in read_rows(path):
                try:
                    self.records.append(record_from_row(row, index, config, base_dir=base_dir, source=path))
                except DataError as err:
                    self.skips.handle(err)
                index += 1

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed stream checks it is walking the same data: the records kept and each path's files (name,
        size and a content hash; :func:`path_fingerprint`). Computed once (every checkpoint stores it)."""
        if self._fingerprint is None:
            self._fingerprint = {"records": len(self.records), "files": {p: path_fingerprint(p) for p in self.paths}}
        return self._fingerprint

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)

    def batches(self, batch_size: int) -> Iterator[list[PromptRecord]]:
        """Consecutive record batches (the last may be shorter)."""
        for start in range(0, len(self.records), batch_size):
            yield self.records[start:start + batch_size]
