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


def test_a_checkpoint_of_another_launch_mode_is_refused_naming_the_mode(tmp_path):
    import json

    from mmrlhf.trainer.checkpoint import check_resume_mode, checkpoint_mode

    states = {"single": {"trainer": {}}, "torchrun": {"trainer": {}, "world_size": 4},
              "ray": {"trainer": {}, "launch": "ray"}}
    for name, state in states.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_mode(tmp_path / "torchrun") == ("torchrun", 4)
    check_resume_mode(tmp_path / "single", world_size=None)  # the same mode resumes
    check_resume_mode(tmp_path / "torchrun", world_size=2)  # DCP re-shards over another number of ranks
    with pytest.raises(ValueError, match=r"written by torchrun with 4 ranks.*--nproc-per-node 4"):
        check_resume_mode(tmp_path / "torchrun", world_size=None)
    with pytest.raises(ValueError, match=r"written by one process.*mmrlhf train CONFIG --resume"):
        check_resume_mode(tmp_path / "single", world_size=2)
    with pytest.raises(ValueError, match=r"written by the Ray mode.*model.pretrain="):
        check_resume_mode(tmp_path / "ray", world_size=None)


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
    assert "about 293.0 KiB (the size of step-00000001)" in text and "is free on that disk" in text
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")] == []  # removed at once
    assert mgr.latest() == first  # the previous checkpoint is what --resume finds
    # an orphan left by a kill during a save goes at start-up (remove_orphans), not only at the next save
    (tmp_path / "ckpt" / ".tmp-step-00000003-999").mkdir()
    mgr.remove_orphans()
    assert not (tmp_path / "ckpt" / ".tmp-step-00000003-999").exists()
    assert mgr.save(2, lambda d: (d / "weights.bin").write_bytes(b"y")).name == "step-00000002"  # space freed
