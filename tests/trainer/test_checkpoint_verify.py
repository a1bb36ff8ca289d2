"""A checkpoint is verified before it is trusted: the save records every file's size and checksum
(``manifest.json``), and ``--resume`` falls back from a damaged latest checkpoint to the newest intact one, or
refuses by name. Fast: synthetic checkpoints through the real :class:`CheckpointManager` (no model); the same on a
real run's checkpoints in tests/trainer/test_resume_damaged.py and in the torchrun and Ray tests."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from mmrlhf.trainer.checkpoint import CheckpointDamagedError, CheckpointManager, save_collective
from mmrlhf.trainer.checkpoint_manifest import MANIFEST, STATE_KEY, checkpoint_files, verify_checkpoint, \
    write_manifest
from trainer_helpers import flip_a_byte, truncate


def _write(step: int, *, marker: bool = True):
    """A checkpoint's shape: weights in a sub-folder, optimiser shards, a trainer state that records the manifest."""
    def write(folder: Path) -> None:
        (folder / "model").mkdir()
        (folder / "model" / "model.safetensors").write_bytes(bytes(range(256)) * (40 + step))
        (folder / "optimizer").mkdir()
        for rank in (0, 1):
            (folder / "optimizer" / f"__{rank}_0.distcp").write_bytes(f"rank {rank} step {step}".encode() * 500)
        state = {"schema": 2, "trainer": {"step": step}, **({STATE_KEY: MANIFEST} if marker else {})}
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=1))
    return write


def _saved(root: Path, steps=(2, 4), **kwargs) -> CheckpointManager:
    mgr = CheckpointManager(root, **kwargs)
    for step in steps:
        mgr.save(step, _write(step))
    return mgr


def _edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


# ---- the manifest --------------------------------------------------------------------------------------------
def test_the_save_records_every_file_and_an_intact_checkpoint_verifies(tmp_path):
    mgr = _saved(tmp_path / "ck")
    folder = mgr.latest()
    manifest = json.loads((folder / MANIFEST).read_text())
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [n for n in on_disk if n != MANIFEST] == checkpoint_files(folder)
    assert set(manifest["files"]) >= {"model/model.safetensors", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp",
                                      "trainer_state.json"}
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    verdict = verify_checkpoint(folder)
    assert verdict.intact and verdict.verified and verdict.file is None  # control: nothing is flagged
    assert verdict.describe() == "step-00000004: intact"
    assert verify_checkpoint(mgr.checkpoints()[0]).intact


DAMAGES = {  # name -> (what is done to the latest checkpoint, the file named, words of the reason)
    "weights truncated": (lambda f: truncate(f / "model/model.safetensors"), "model/model.safetensors", "truncated"),
    "shard truncated": (lambda f: truncate(f / "optimizer/__1_0.distcp"), "optimizer/__1_0.distcp", "truncated"),
    "shard missing": (lambda f: (f / "optimizer/__0_0.distcp").unlink(), "optimizer/__0_0.distcp", "missing"),
    "shard grown": (lambda f: (f / "optimizer/__0_0.distcp").write_bytes(b"x" * 20_000), "optimizer/__0_0.distcp",
                    "longer than written"),
    "same size, other bytes": (lambda f: flip_a_byte(f / "model/model.safetensors"), "model/model.safetensors",
                               "differs from the manifest"),
    "state truncated": (lambda f: truncate(f / "trainer_state.json"), "trainer_state.json", "truncated"),
    "manifest truncated": (lambda f: truncate(f / MANIFEST), MANIFEST, "unreadable"),
    "manifest missing": (lambda f: (f / MANIFEST).unlink(), MANIFEST, "records that the save wrote one"),
    "manifest and state missing": (lambda f: [(f / n).unlink() for n in (MANIFEST, "trainer_state.json")], MANIFEST,
                                   "so is trainer_state.json"),
    "manifest edited": (lambda f: _edit_manifest(f, lambda m: m["files"]["trainer_state.json"].update(size=1)),
                        MANIFEST, "own checksum"),
    "manifest not one": (lambda f: (f / MANIFEST).write_text("[]"), MANIFEST, "not a checkpoint manifest"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=str)
def test_each_damage_is_named_with_its_file_and_why(tmp_path, damage):
    do, name, why = DAMAGES[damage]
    folder = _saved(tmp_path / "ck").latest()
    do(folder)
    verdict = verify_checkpoint(folder)
    assert not verdict.intact and verdict.file == name and why in verdict.reason, verdict
    assert verdict.describe().startswith(f"step-00000004/{name}: ")


def test_a_manifest_entry_outside_the_folder_is_refused_even_with_a_matching_checksum(tmp_path):
    """A manifest names files inside its checkpoint only (a crafted ``../`` entry would make a resume read
    elsewhere): refused as malformed though its own checksum was recomputed to match."""
    from mmrlhf.trainer.checkpoint_manifest import _entries_checksum

    folder = _saved(tmp_path / "ck").latest()

    def escape(manifest):
        manifest["files"]["../elsewhere"] = {"size": 1, "sha256": "0" * 64}
        manifest["checksum"] = _entries_checksum(manifest["files"])

    _edit_manifest(folder, escape)
    verdict = verify_checkpoint(folder)
    assert verdict.file == MANIFEST and "malformed entry '../elsewhere'" in verdict.reason


def test_a_checkpoint_from_before_manifests_is_accepted_unverified_with_one_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(3, _write(3, marker=False))
    (mgr.latest() / MANIFEST).unlink()  # what an older mmrlhf wrote: no manifest, no marker in the trainer state
    verdict = verify_checkpoint(mgr.latest())
    assert verdict.intact and not verdict.verified
    assert verdict.describe() == "step-00000003: intact, unverified: no manifest.json"
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.checkpoint"):
        assert mgr.resume_point() == mgr.latest()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "step-00000003 has no manifest.json" in warnings[0], warnings
    assert "cannot be verified" in warnings[0]


# ---- the resume's choice ---------------------------------------------------------------------------------------
def test_a_damaged_latest_falls_back_to_the_newest_intact_and_is_set_aside(tmp_path, caplog):
    root = tmp_path / "ck"
    mgr = _saved(root, steps=(2, 4, 6))
    truncate(root / "step-00000006/optimizer/__1_0.distcp")
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.checkpoint"):
        chosen = mgr.resume_point()
    assert chosen == root / "step-00000004"
    text = caplog.text
    assert f"checkpoint {root / 'step-00000006'} is damaged: optimizer/__1_0.distcp:" in text and "truncated" in text
    assert "resuming from" in text and "(step 4)" in text
    # set aside, not deleted; out of the listing that pruning and the next saves read; latest points at the choice
    assert [p.name for p in mgr.checkpoints()] == ["step-00000002", "step-00000004"]
    aside = root / "step-00000006.damaged"
    assert (aside / "optimizer/__1_0.distcp").exists()
    note = (aside / "DAMAGED.txt").read_text()
    assert "optimizer/__1_0.distcp" in note and "resumed from step-00000004" in note
    assert (root / "latest").read_text().strip() == "step-00000004" and mgr.latest() == chosen


def test_several_damaged_checkpoints_are_passed_over_newest_first(tmp_path):
    root = tmp_path / "ck"
    mgr = _saved(root, steps=(2, 4, 6))
    flip_a_byte(root / "step-00000006/model/model.safetensors")
    (root / "step-00000004/trainer_state.json").unlink()
    assert mgr.resume_point() == root / "step-00000002"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "step-00000002", "step-00000004.damaged", "step-00000006.damaged"]


def test_strict_refuses_a_damaged_latest_by_name_and_changes_nothing(tmp_path, caplog):
    root = tmp_path / "ck"
    mgr = _saved(root)
    truncate(root / "step-00000004/model/model.safetensors")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointDamagedError) as err, caplog.at_level(logging.WARNING):
        mgr.resume_point(strict=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the error alone says it, once
    text = str(err.value)
    assert f"the latest checkpoint {root / 'step-00000004'} is damaged: model/model.safetensors:" in text
    assert "trainer.resume_strict=true" in text and "\n" not in text
    assert sorted(p.name for p in root.iterdir()) == before
    assert mgr.resume_point(strict=False) == root / "step-00000002"  # control: without strictness it falls back


def test_no_intact_checkpoint_is_refused_naming_each_and_its_first_damaged_file(tmp_path):
    root = tmp_path / "ck"
    mgr = _saved(root)
    truncate(root / "step-00000004/trainer_state.json")
    truncate(root / f"step-00000002/{MANIFEST}")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointDamagedError) as err:
        mgr.resume_point()
    text = str(err.value)
    assert f"no intact checkpoint under {root}: step-00000004/trainer_state.json: " in text
    assert f"; step-00000002/{MANIFEST}: unreadable" in text and "\n" not in text
    assert sorted(p.name for p in root.iterdir()) == before  # nothing set aside: the user decides
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        CheckpointManager(tmp_path / "empty").resume_point()


def test_after_a_fall_back_pruning_always_leaves_an_intact_checkpoint(tmp_path):
    """keep_last=2 with the newest damaged: the resume continues from the older one, and the next saves prune around
    it without ever leaving the run with no intact checkpoint (the damaged one no longer counts as one of the
    two); a second damage of the same step is set aside beside the first."""
    root = tmp_path / "ck"
    mgr = _saved(root, steps=(1, 2, 3), keep_last=2)
    assert [p.name for p in mgr.checkpoints()] == ["step-00000002", "step-00000003"]
    truncate(root / "step-00000003/model/model.safetensors")
    assert mgr.resume_point() == root / "step-00000002"
    for step in (3, 4):  # the resumed run saves again
        mgr.save(step, _write(step))
        intact = [p.name for p in mgr.checkpoints() if verify_checkpoint(p).intact]
        assert intact == [p.name for p in mgr.checkpoints()] and len(intact) == 2
    truncate(root / "step-00000004/model/model.safetensors")
    assert mgr.resume_point() == root / "step-00000003"
    assert (root / "step-00000003.damaged").is_dir() and (root / "step-00000004.damaged").is_dir()
    mgr.save(4, _write(4))
    truncate(root / "step-00000004/trainer_state.json")
    assert mgr.resume_point() == root / "step-00000003"
    assert (root / "step-00000004.damaged-2/DAMAGED.txt").exists()


def test_re_sealing_an_edited_checkpoint_makes_it_intact_again(tmp_path):
    folder = _saved(tmp_path / "ck").latest()
    (folder / "trainer_state.json").write_text(json.dumps({"schema": 2, STATE_KEY: MANIFEST, "edited": True}))
    assert verify_checkpoint(folder).file == "trainer_state.json"
    write_manifest(folder)
    assert verify_checkpoint(folder).intact


# ---- several ranks ----------------------------------------------------------------------------------------------
class _ThreadWorld:
    """Two ranks as two threads of this process: what ``save_collective`` needs of a world."""

    def __init__(self, rank: int, shared: dict, barrier: threading.Barrier) -> None:
        self.rank, self.shared, self._barrier = rank, shared, barrier
        self.world_size, self.is_main = 2, rank == 0

    def broadcast_object(self, obj):
        if self.is_main:
            self.shared["obj"] = obj
        self._barrier.wait()
        out = self.shared["obj"]
        self._barrier.wait()
        return out

    def scatter_objects(self, parts):
        return self.broadcast_object(parts)[self.rank]

    def gather_objects(self, obj):
        self.shared[f"gather-{self.rank}"] = obj
        self._barrier.wait()
        out = [self.shared[f"gather-{r}"] for r in (0, 1)]
        self._barrier.wait()
        return out

    def barrier(self) -> None:
        self._barrier.wait()


def _as_two_ranks(rank, barrier: threading.Barrier) -> dict[int, BaseException]:
    """``rank(r)`` on threads ``rank-0`` and ``rank-1``; what each raised (a thread's exception would otherwise
    vanish; the barrier is aborted so the other rank stops waiting)."""
    errors: dict[int, BaseException] = {}

    def guarded(r):
        try:
            rank(r)
        except BaseException as exc:
            errors[r] = exc
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(r,), name=f"rank-{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_a_collective_save_records_every_ranks_files_once_all_exist_and_the_ranks_share_the_hashing(
        tmp_path, monkeypatch):
    """Rank 1 writes its shard late: the manifest (written once, by rank 0's save) still lists it; each rank
    checksummed part of the files (dealt by size), and every checksum is right."""
    import mmrlhf.trainer.checkpoint as checkpoint

    mgr = CheckpointManager(tmp_path / "ck")
    shared, barrier, paths, hashed = {}, threading.Barrier(2), {}, {}
    real = checkpoint.local_checksums

    def recording(folder, names):
        hashed[threading.current_thread().name] = sorted(names)
        return real(folder, names)

    monkeypatch.setattr(checkpoint, "local_checksums", recording)

    def write(world):
        def into(folder: Path) -> None:
            if world.rank == 1:
                time.sleep(0.3)
            (folder / "optimizer").mkdir(exist_ok=True)
            (folder / "optimizer" / f"__{world.rank}_0.distcp").write_bytes(b"s" * (1000 + world.rank))
            if world.is_main:
                (folder / "trainer_state.json").write_text("{}")
        return into

    def rank(r):
        world = _ThreadWorld(r, shared, barrier)
        paths[r] = save_collective(world, mgr, 7, write(world))

    errors = _as_two_ranks(rank, barrier)
    assert not errors, errors
    assert paths[0] == paths[1] == tmp_path / "ck" / "step-00000007"
    manifest = json.loads((paths[0] / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["optimizer/__0_0.distcp", "optimizer/__1_0.distcp", "trainer_state.json"]
    assert manifest["files"]["optimizer/__1_0.distcp"]["size"] == 1001
    # the largest file to one rank, the next two to the other; every file hashed once
    assert hashed == {"rank-0": ["optimizer/__1_0.distcp"], "rank-1": ["optimizer/__0_0.distcp", "trainer_state.json"]}
    assert verify_checkpoint(paths[0]).intact


def test_a_rank_that_cannot_read_its_share_fails_the_save_on_rank_0_and_nothing_is_published(tmp_path, monkeypatch):
    import mmrlhf.trainer.checkpoint as checkpoint

    real = checkpoint.local_checksums

    def failing_on_rank_1(folder, names):
        if threading.current_thread().name == "rank-1":
            raise OSError(5, "Input/output error")
        return real(folder, names)

    monkeypatch.setattr(checkpoint, "local_checksums", failing_on_rank_1)
    mgr = CheckpointManager(tmp_path / "ck")
    shared, barrier = {}, threading.Barrier(2)

    # rank 0 raises; rank 1 then waits for a path that never comes (aborted by the harness)
    errors = _as_two_ranks(lambda r: save_collective(
        _ThreadWorld(r, shared, barrier), mgr, 1,
        lambda folder: (folder / f"rank{r}.bin").write_bytes(b"x" * (10 + r))), barrier)
    assert isinstance(errors[0], OSError) and "failed: rank 1: [Errno 5] Input/output error" in str(errors[0])
    assert mgr.checkpoints() == [] and list((tmp_path / "ck").iterdir()) == []  # the temporary folder went too


def test_files_are_dealt_to_ranks_by_size():
    from mmrlhf.trainer.checkpoint_manifest import split_by_size

    parts = split_by_size(["a", "b", "c", "d", "e"], [10, 70, 30, 40, 5], 2)
    assert parts == [["b", "a"], ["d", "c", "e"]]  # 80 and 75 bytes
    assert split_by_size(["a"], [3], 3) == [["a"], [], []]
