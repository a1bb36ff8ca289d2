"""A checkpoint's manifest: every file's size and checksum, recorded at the save and checked before a resume trusts it.

The atomic save (:class:`~mmrlhf.trainer.checkpoint.CheckpointManager`) guarantees a checkpoint folder is complete
when it appears, on a file system that keeps its promises. Clusters break them: a preempted node whose network
file system had not flushed, a copy cut short, a disk that filled up under a sync. What is left looks like a
checkpoint and fails deep inside safetensors or torch. So every save records ``manifest.json`` once all ranks'
files exist (size and SHA-256 of each file, relative path -> entry) and a resume compares the folder with it first:
a damaged checkpoint is named with its first damaged file and why, before anything loads.

SHA-256 because OpenSSL computes it with the CPU's SHA instructions (x86 SHA-NI: AMD Zen, Intel since Ice Lake;
ARMv8), which today's GPU nodes have: 1.46 GB/s a core measured here against 0.85 GB/s for BLAKE2b
(docs/training.md); an older Xeon without them hashes at about half BLAKE2b's speed. The manifest names its
algorithm, so another can follow without breaking older checkpoints. The files are hashed on several threads
(hashlib releases the GIL), and a save of several ranks splits them over the ranks
(:func:`~mmrlhf.trainer.checkpoint.save_collective`), so no one process reads a sharded optimiser's every byte. The
manifest carries a checksum of its own entries, so an edited or corrupted manifest is caught as surely as a
truncated one.

A checkpoint without a manifest was written before manifests existed (accepted, unverified) unless its
``trainer_state.json`` says it has one (:data:`STATE_KEY`): then the manifest was lost, and the checkpoint is
damaged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_KEY = "manifest"  # trainer_state.json's key that says the checkpoint was written with a manifest
ALGORITHM = "sha256"
FORMAT = 1
_CHUNK = 4 << 20  # read size while hashing: large enough that the hash, not the syscalls, sets the speed
_THREADS = 8

Checksums = Callable[[Path, list[str]], dict[str, str]]  # (folder, relative names) -> name -> hex checksum


@dataclass(frozen=True)
class Verdict:
    """What checking one checkpoint folder found: intact (``file`` is None) or the first damaged file and why.
    ``verified`` is False for a checkpoint written before manifests existed (accepted, nothing to compare)."""

    folder: Path
    file: str | None = None  # relative to the folder, as the manifest names it
    reason: str = ""
    verified: bool = True

    @property
    def intact(self) -> bool:
        return self.file is None

    def describe(self) -> str:
        """``step-00000004/model/model.safetensors: 812 bytes, the manifest records 1654904 (truncated)``, or
        ``step-00000004: intact`` (``intact, unverified: no manifest.json``)."""
        if self.intact:
            return f"{self.folder.name}: intact" + ("" if self.verified else f", unverified: no {MANIFEST}")
        return f"{self.folder.name}/{self.file}: {self.reason}"


def file_checksum(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes as the file system returns them, read in chunks."""
    digest = hashlib.new(ALGORITHM)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _entries_checksum(files: dict[str, Any]) -> str:
    """The manifest's checksum of its own entries (canonical JSON), so that an edited manifest is caught."""
    canonical = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return hashlib.new(ALGORITHM, canonical.encode()).hexdigest()


def local_checksums(folder: Path, names: Sequence[str]) -> dict[str, str]:
    """Checksums of ``names`` (relative to ``folder``), on several threads of this process."""
    if not names:
        return {}
    workers = max(1, min(len(names), os.cpu_count() or 1, _THREADS))
    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-hash") as pool:
        return dict(zip(names, pool.map(lambda name: file_checksum(folder / name), names)))


def split_by_size(names: Sequence[str], sizes: Sequence[int], parts: int) -> list[list[str]]:
    """``names`` dealt into ``parts`` lists of about equal bytes (largest first, each to the lightest list)."""
    out: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for size, name in sorted(zip(sizes, names), key=lambda pair: (-pair[0], pair[1])):
        lightest = load.index(min(load))
        out[lightest].append(name)
        load[lightest] += size
    return out


def checkpoint_files(folder: Path) -> list[str]:
    """Every regular file under ``folder`` but the manifest, as sorted POSIX paths relative to it."""
    found = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return sorted(name for name in found if name != MANIFEST)


def write_manifest(folder: str | Path, checksums: Checksums | None = None) -> dict[str, Any]:
    """Record every file under ``folder`` (size and checksum) in ``folder/manifest.json``; returns the manifest.

    Called by the save once every rank's files are in the (temporary) folder, before it is synced and renamed into
    place; ``checksums`` computes them (default: this process, :func:`local_checksums`; a save of several ranks
    spreads the work over them). Also the way to re-seal a checkpoint after editing one of its files on purpose."""
    folder = Path(folder)
    t0 = time.perf_counter()
    names = checkpoint_files(folder)
    sums = (checksums or local_checksums)(folder, names)
    if sorted(sums) != names:
        raise RuntimeError(f"checksums of {folder}: {len(sums)} files hashed, {len(names)} listed")
    files = {name: {"size": (folder / name).stat().st_size, ALGORITHM: sums[name]} for name in names}
    manifest = {"format": FORMAT, "algorithm": ALGORITHM, "files": files, "checksum": _entries_checksum(files)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(entry["size"] for entry in files.values())
    logger.info("checkpoint manifest: %d files, %.1f MiB hashed in %.2f s", len(files), total / 2**20,
                time.perf_counter() - t0)
    return manifest


def verify_checkpoint(folder: str | Path, *, checksums: bool = True) -> Verdict:
    """Compare ``folder`` with its manifest: the manifest itself (present, readable, its own checksum), then every
    file's presence and size (cheap: a truncation is found without reading anything), then every file's checksum
    (reads the whole checkpoint; ``checksums=False`` skips it). Files the manifest does not list are ignored."""
    folder = Path(folder)
    manifest, problem = _read_manifest(folder)
    if manifest is None:
        return problem
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name in sorted(files):
        path, want = folder / name, int(files[name]["size"])
        if not path.is_file():
            return Verdict(folder, name, "missing" if not path.exists() else "not a regular file")
        have = path.stat().st_size
        if have != want:
            how = "truncated" if have < want else "longer than written"
            return Verdict(folder, name, f"{have} bytes, the manifest records {want} ({how})")
    if checksums:
        sums = local_checksums(folder, sorted(files))
        for name in sorted(files):
            if sums[name] != files[name][ALGORITHM]:
                return Verdict(folder, name, f"its {ALGORITHM} differs from the manifest's (same size, other "
                                             "bytes: the file changed after the save)")
    return Verdict(folder)


def _read_manifest(folder: Path) -> tuple[dict[str, Any] | None, Verdict]:
    """(the manifest, ...) when it is sound; else (None, the verdict: damaged, or an unverifiable older checkpoint)."""
    path = folder / MANIFEST
    if not path.exists():
        return None, _without_manifest(folder)
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, Verdict(folder, MANIFEST, f"unreadable ({type(exc).__name__}: {exc}; truncated?)")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, Verdict(folder, MANIFEST, "not a checkpoint manifest (no 'files' table)")
    if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
        return None, Verdict(folder, MANIFEST, f"format {manifest.get('format')!r} with checksum "
                                               f"{manifest.get('algorithm')!r}: not one this mmrlhf reads (written by "
                                               "a newer version?)")
    if manifest.get("checksum") != _entries_checksum(manifest["files"]):
        return None, Verdict(folder, MANIFEST, "its own checksum does not match its entries (edited or corrupted)")
    for name, entry in manifest["files"].items():
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or not isinstance(entry, dict) or ALGORITHM not in entry \
                or not isinstance(entry.get("size"), int):
            return None, Verdict(folder, MANIFEST, f"a malformed entry {name!r}")
    return manifest, Verdict(folder)


def _without_manifest(folder: Path) -> Verdict:
    """No manifest: an older checkpoint (accepted, unverified) unless its trainer state says it had one."""
    state_file = folder / "trainer_state.json"
    if not state_file.exists():
        return Verdict(folder, MANIFEST, "missing, and so is trainer_state.json")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Verdict(folder, MANIFEST, f"missing, and trainer_state.json is unreadable ({type(exc).__name__})")
    if isinstance(state, dict) and state.get(STATE_KEY):
        return Verdict(folder, MANIFEST, "missing (trainer_state.json records that the save wrote one)")
    return Verdict(folder, verified=False)
