"""Atomic checkpoints: a kill in the middle of a save leaves the previous checkpoint intact and loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mmrlhf.trainer.checkpoint import CheckpointManager


def _write(text: str):
    def write(folder: Path) -> None:
        (folder / "payload.txt").write_text(text)
        (folder / "model").mkdir()
        (folder / "model" / "weights.bin").write_bytes(text.encode() * 100)
    return write


def test_save_publishes_and_points_latest(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, _write(f"s{step}"))
    names = [p.name for p in mgr.checkpoints()]
    assert names == ["step-00000002", "step-00000003"]  # keep_last pruned step 1
    assert mgr.latest().name == "step-00000003" and (tmp_path / "ck" / "latest").read_text().strip() == names[-1]
    assert (mgr.latest() / "payload.txt").read_text() == "s3"
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]
    mgr.save(3, _write("again"))  # re-saving a step replaces it atomically
    assert (mgr.latest() / "payload.txt").read_text() == "again"
    assert CheckpointManager.step_of(mgr.latest()) == 3


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(5, _write("five"))
    (tmp_path / "ck" / "latest").write_text("step-00000009\n")  # dangling
    assert mgr.latest().name == "step-00000005"
    (tmp_path / "ck" / "latest").unlink()
    assert mgr.latest().name == "step-00000005"
    assert CheckpointManager(tmp_path / "none").latest() is None
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from mmrlhf.trainer.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(root)!r})
        mgr.save(1, lambda d: (d / "payload.txt").write_text("first"))
        def slow(d):
            (d / "payload.txt").write_text("second, half written")
            Path({str(marker)!r}).touch()
            time.sleep(120)
        mgr.save(2, slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, "the saving process died before the kill"
            assert time.time() < deadline, "the save never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    mgr = CheckpointManager(root)
    assert mgr.latest().name == "step-00000001"
    assert (mgr.latest() / "payload.txt").read_text() == "first"
    assert [p.name for p in mgr.checkpoints()] == ["step-00000001"]
    orphans = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert orphans, "the killed save should have left its temporary folder (control)"
    mgr.save(2, _write("retry"))  # the next save cleans up
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert mgr.latest().name == "step-00000002"


def test_every_launch_mode_resumes_every_other_and_old_or_newer_formats_are_refused_naming_the_mode(tmp_path):
    import json

    from mmrlhf.trainer.checkpoint import check_resume_mode, checkpoint_mode

    states = {"single-v1": {"trainer": {}}, "torchrun-v1": {"trainer": {}, "world_size": 4},
              "ray-v1": {"trainer": {}, "launch": "ray"},
              "ray": {"schema": 2, "launch": "ray", "world_size": 2, "trainer": {}},
              "future": {"schema": 99, "launch": "single", "world_size": 1, "trainer": {}}}
    for name, state in states.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_mode(tmp_path / "torchrun-v1") == ("torchrun", 4, 1)
    assert checkpoint_mode(tmp_path / "ray") == ("ray", 2, 2)
    for launch, ranks in (("single", 1), ("torchrun", 2), ("ray", 3)):  # one format: DCP re-shards on load
        for name in ("single-v1", "torchrun-v1", "ray"):
            check_resume_mode(tmp_path / name, launch=launch, world_size=ranks)
    with pytest.raises(ValueError, match=r"written by the Ray mode of an older mmrlhf.*model.pretrain="):
        check_resume_mode(tmp_path / "ray-v1", launch="ray", world_size=1)
    with pytest.raises(ValueError, match=r"newer version \(trainer_state schema 99 > 2\): upgrade"):
        check_resume_mode(tmp_path / "future", launch="single", world_size=1)


def test_a_full_disk_names_the_path_and_the_size_removes_the_half_written_folder_and_resume_works(tmp_path):
    import errno

    from mmrlhf.trainer.checkpoint import CheckpointSpaceError

    mgr = CheckpointManager(tmp_path / "ckpt")
    first = mgr.save(1, lambda d: (d / "weights.bin").write_bytes(b"x" * 300_000))

    def disk_full(d):
        (d / "weights.bin").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointSpaceError) as err:
        mgr.save(2, disk_full)
    text = str(err.value)
    assert "no space left on device while saving" in text and "step-00000002" in text
    # 300,000 bytes of weights and the manifest's ~200 bytes
    assert "about 293.2 KiB (the size of step-00000001)" in text and "is free on that disk" in text
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")] == []  # removed at once
    assert mgr.latest() == first  # the previous checkpoint is what --resume finds
    # an orphan left by a kill during a save goes at start-up (remove_orphans), not only at the next save
    (tmp_path / "ckpt" / ".tmp-step-00000003-999").mkdir()
    mgr.remove_orphans()
    assert not (tmp_path / "ckpt" / ".tmp-step-00000003-999").exists()
    assert mgr.save(2, lambda d: (d / "weights.bin").write_bytes(b"y")).name == "step-00000002"  # space freed
