"""Atomic checkpoints: ``<root>/step-00000100/`` folders that are either complete or absent.

A save writes everything into a private ``.tmp-...`` folder, syncs it to disk, renames it into place (one atomic
``rename`` on POSIX) and only then repoints ``<root>/latest`` (a one-line file, itself replaced atomically). A kill
at any moment therefore leaves the previous checkpoint intact and ``latest`` pointing at it; the orphaned
temporary folder is removed by the next save. ``keep_last`` prunes the oldest complete checkpoints after a save.

Before the sync, the save records every file's size and checksum in the folder's ``manifest.json``
(:mod:`~mmrlhf.trainer.checkpoint_manifest`); :meth:`CheckpointManager.resume_point` checks the latest checkpoint
against it before a resume trusts it, and falls back to the newest intact one (setting the damaged ones aside as
``step-NNNNNNNN.damaged``) or refuses by name.

What goes inside is the trainer's business (see ``loop.Trainer.write_checkpoint``): the model in Hugging Face
format (loadable by transformers and vLLM), optimiser and scheduler state (``torch.save`` of tensors and plain
values, read back with ``weights_only=True``), RNG states and the trainer state as JSON.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from mmrlhf.trainer.checkpoint_manifest import MANIFEST, Checksums, Verdict, local_checksums, split_by_size, \
    verify_checkpoint, write_manifest

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointSpaceError(OSError):
    """A checkpoint could not be written for lack of disk space (the message says how much is needed)."""


class CheckpointDamagedError(ValueError):
    """``--resume`` found no checkpoint it may trust (the message names each one checked and its damaged file)."""


DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint set aside by a resume that fell back: step-NNNNNNNN.damaged
DAMAGE_NOTE = "DAMAGED.txt"  # inside it: what was found, and when


def _tree_bytes(path: Path | None) -> int:
    """Bytes of the files under ``path`` (0 if it is gone)."""
    if path is None or not Path(path).exists():
        return 0
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_tree(path: Path) -> None:
    """Flush every file (and folder entry) under ``path`` to disk before the rename makes it visible."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CheckpointManager:
    """Saves, lists, finds and prunes checkpoints under ``root``."""

    def __init__(self, root: str | Path, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, write: Callable[[Path], None], *, checksums: Checksums | None = None) -> Path:
        """Run ``write(folder)`` into a fresh temporary folder, record its manifest (``checksums``: how the files'
        checksums are computed, default in this process) and publish it as the checkpoint of ``step``."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_orphans()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write(tmp)  # every rank's files are in tmp when it returns (save_collective)
            write_manifest(tmp, checksums)
            _fsync_tree(tmp)
        except BaseException as exc:
            written = _tree_bytes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # at once: a half-written folder only takes more of the disk
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise self._space_error(final, written) from exc
            raise
        if final.exists():  # the same step saved again (e.g. after an interrupt): replace it
            stale = self.root / f".old-{final.name}-{os.getpid()}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        self._point_latest(final.name)
        self._prune()
        return final

    def _space_error(self, final: Path, written: int) -> "CheckpointSpaceError":
        """The disk-full error: the path, what a checkpoint needs (the previous one's size, or at least what this
        one had written) and what is free now."""
        previous = self.latest()
        needed = max(_tree_bytes(previous) if previous is not None else 0, written)
        free = shutil.disk_usage(self.root).free
        return CheckpointSpaceError(
            f"no space left on device while saving {final}: a checkpoint takes about {_human(needed)} "
            f"({'the size of ' + previous.name if previous is not None else 'written before the failure'}), "
            f"{_human(free)} is free on that disk. The half-written folder was removed and the previous checkpoint "
            f"is intact: free space (or lower trainer.keep_last), then continue with --resume")

    def remove_orphans(self) -> None:
        """Remove what interrupted saves left behind (at start-up, under the output folder's lock, and before each
        save)."""
        if self.root.is_dir():
            self._remove_orphans()

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, or (if that file is missing or dangling) the newest complete one."""
        pointer = self.root / "latest"
        if pointer.is_file():
            target = self.root / pointer.read_text().strip()
            if target.is_dir() and _NAME.match(target.name):
                return target
            logger.warning("%s names %r, which is missing; using the newest checkpoint instead", pointer, target.name)
        found = self.checkpoints()
        return found[-1] if found else None

    def resume_point(self, *, strict: bool = False) -> Path:
        """The checkpoint ``--resume`` continues from: :meth:`latest` when it is intact (its files match its
        manifest). A damaged one is logged (folder, file, why); then, unless ``strict``, the older checkpoints are
        checked newest first and the first intact one is used: the damaged newer ones are set aside (renamed
        ``step-NNNNNNNN.damaged``, with a note of what was found; never deleted) and ``latest`` is repointed, so
        that pruning and the next saves see only the checkpoints the run continues from. Raises
        :class:`CheckpointDamagedError` naming every checkpoint checked and its first damaged file when none is
        intact (or, ``strict``, when the latest is not), and ``FileNotFoundError`` when there is no checkpoint."""
        latest = self.latest()
        if latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.root} (nothing to resume)")
        older = [p for p in reversed(self.checkpoints()) if self.step_of(p) < self.step_of(latest)]
        damaged: list[Verdict] = []
        for folder in [latest, *older]:
            verdict = verify_checkpoint(folder)
            if verdict.intact:
                break
            if strict:
                raise CheckpointDamagedError(
                    f"--resume: the latest checkpoint {folder} is damaged: {verdict.file}: {verdict.reason}; "
                    "trainer.resume_strict=true does not fall back to an older checkpoint (restore the file, or "
                    "set trainer.resume_strict=false to resume from the newest intact one)")
            logger.warning("checkpoint %s is damaged: %s: %s", folder, verdict.file, verdict.reason)
            damaged.append(verdict)
        else:
            raise CheckpointDamagedError(
                f"--resume: no intact checkpoint under {self.root}: "
                + "; ".join(d.describe() for d in damaged)
                + " (restore the files from a copy, or start over from a policy with model.pretrain)")
        if not verdict.verified:
            logger.warning("checkpoint %s has no %s (written by a version before checkpoints carried one): its "
                           "files cannot be verified; resuming it as it is", folder, MANIFEST)
        if damaged:
            for bad in damaged:
                self._set_aside(bad, folder)
            self._point_latest(folder.name)
            logger.warning("resuming from %s (step %d), the newest intact checkpoint, instead of the damaged %s",
                           folder, self.step_of(folder), ", ".join(d.folder.name for d in damaged))
        return folder

    def _set_aside(self, verdict: Verdict, instead: Path) -> Path:
        """Rename a damaged checkpoint out of the listing (``step-NNNNNNNN.damaged``, numbered if taken) and leave
        a note in it: the run's later saves and pruning no longer see it; what to do with it is the user's call."""
        target = verdict.folder.with_name(verdict.folder.name + DAMAGED_SUFFIX)
        n = 1
        while target.exists():
            n += 1
            target = verdict.folder.with_name(f"{verdict.folder.name}{DAMAGED_SUFFIX}-{n}")
        os.rename(verdict.folder, target)
        (target / DAMAGE_NOTE).write_text(
            f"{verdict.folder.name} was found damaged by a --resume and set aside:\n  {verdict.file}: "
            f"{verdict.reason}\nThe run resumed from {instead.name}. Nothing reads this folder any more: delete it "
            "once you no longer need its files.\n")
        logger.warning("set the damaged checkpoint aside as %s", target)
        return target

    @staticmethod
    def step_of(path: str | Path) -> int:
        m = _NAME.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path} is not a checkpoint folder (step-NNNNNNNN)")
        return int(m.group(1))

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".latest-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / "latest")

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        found = self.checkpoints()
        latest = self.latest()
        for old in found[: max(len(found) - self.keep_last, 0)]:
            if old != latest:
                shutil.rmtree(old, ignore_errors=True)

    def _remove_orphans(self) -> None:
        """Temporary folders of saves that were killed (any process's: only one run writes a root at a time)."""
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-", ".old-", ".latest-")):
                logger.warning("removing %s, left by an interrupted save", p)
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` (empty if it has none)."""
    import json

    state_file = Path(folder) / "trainer_state.json"
    return json.loads(state_file.read_text()) if state_file.exists() else {}


def checkpoint_mode(folder: Path) -> tuple[str, int, int]:
    """``(launch mode, ranks, schema)`` that wrote a checkpoint, read from its ``trainer_state.json``."""
    state = read_trainer_state(folder)
    schema = int(state.get("schema", 1))
    if schema == 1:  # before the one loop: each mode wrote its own
        if state.get("launch") == "ray":
            return "ray", 1, 1
        return ("torchrun", int(state["world_size"]), 1) if "world_size" in state else ("single", 1, 1)
    return str(state["launch"]), int(state["world_size"]), schema


def check_resume_mode(folder: Path, *, launch: str, world_size: int) -> None:
    """Every launch mode resumes every other's checkpoint (one format, DCP re-shards the optimiser); refused, naming
    the mode that wrote it: a checkpoint of a newer schema, and the Ray mode's before the one loop (it kept no data
    position)."""
    from mmrlhf.trainer.run_checkpoint import SCHEMA

    mode, ranks, schema = checkpoint_mode(folder)
    if schema > SCHEMA:
        raise ValueError(f"{folder} was written by a newer version (trainer_state schema {schema} > {SCHEMA}): upgrade "
                         "mmrlhf to resume it")
    if mode == "ray" and schema == 1:
        raise ValueError(f"{folder} was written by the Ray mode of an older mmrlhf, which recorded no data position: "
                         "start a new run from its policy with model.pretrain=" + str(Path(folder) / "model"))
    if (mode, ranks) != (launch, world_size):
        logger.warning("resuming a checkpoint written by %s with %d rank(s) as %s with %d", mode, ranks, launch,
                       world_size)


def save_collective(world: Any, manager: CheckpointManager, step: int, write: Callable[[Path], None]) -> Path:
    """``manager.save(step, write)`` run by every rank: rank 0 owns the (temporary) folder and tells the others where
    it is; ``write(folder)`` runs on every rank; once all have returned, every rank checksums its share of the files
    (:func:`_hash_share`), rank 0 writes the one manifest and renames the folder into place. Returns the final path.
    In a world of one rank it is ``manager.save`` itself."""
    if world.is_main:
        def write_all(tmp: Path) -> None:
            world.broadcast_object(str(tmp))
            write(tmp)
            world.barrier()

        def shared(folder: Path, names: list[str]) -> dict[str, str]:
            return _hash_share(world, folder, names)

        path = manager.save(step, write_all, checksums=shared if world.world_size > 1 else None)
        world.broadcast_object(str(path))
        return path
    tmp = Path(world.broadcast_object(None))
    write(tmp)
    world.barrier()
    if world.world_size > 1:
        _hash_share(world, tmp, None)
    return Path(world.broadcast_object(None))


def _hash_share(world: Any, folder: Path, names: list[str] | None) -> dict[str, str]:
    """Every rank checksums its share of the checkpoint's files (rank 0 deals ``names`` by size): a save of many
    ranks reads each file once, spread over the ranks' nodes, instead of rank 0 reading a sharded optimiser's every
    byte. Rank 0 gets every checksum (the others an empty dict). A rank that cannot read its share answers with the
    error (no rank is left waiting); rank 0 raises it."""
    parts = None
    if world.is_main:
        names = names or []
        parts = split_by_size(names, [(folder / n).stat().st_size for n in names], world.world_size)
    mine = world.scatter_objects(parts)
    try:
        result: dict[str, str] | str = local_checksums(folder, mine)
    except OSError as exc:
        result = f"rank {world.rank}: {exc}"
    gathered = world.gather_objects(result)
    if not world.is_main:
        return {}
    errors = [g for g in gathered if isinstance(g, str)]
    if errors:
        raise OSError(f"checksumming the checkpoint's files in {folder} failed: " + "; ".join(errors))
    return {name: digest for part in gathered for name, digest in part.items()}
