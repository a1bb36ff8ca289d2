"""One writer per output_dir: a second live process is refused with the folder and the holder named; the lock dies
with its process (no stale lock file blocks the next run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmrlhf.trainer.builder import _prepare_output
from mmrlhf.trainer.checkpoint import CheckpointManager
from mmrlhf.trainer.output_lock import OutputDirInUseError, lock_output_dir, release_output_dir

HOLDER = textwrap.dedent("""
    import sys, time
    from mmrlhf.trainer.output_lock import lock_output_dir
    lock_output_dir(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
""")


def _holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_process_is_refused_until_the_first_dies(tmp_path):
    out = tmp_path / "run"
    proc = _holder(out)
    try:
        with pytest.raises(OutputDirInUseError, match=rf"{out}.*in use by another run \(pid {proc.pid} on"):
            lock_output_dir(out)
        # the trainer's entry point takes the lock before it reads or cleans anything
        (out / "checkpoints").mkdir()
        with pytest.raises(OutputDirInUseError):
            _prepare_output(out, CheckpointManager(out / "checkpoints", 2), resume=False, overwrite=True)
        assert (out / "checkpoints").exists()  # overwrite did not clean under the live run
    finally:
        proc.kill()
        proc.wait()
    # SIGKILL released it: the lock file is still there, and does not block
    assert (out / ".mmrlhf.lock").exists()
    try:
        assert _prepare_output(out, CheckpointManager(out / "checkpoints", 2), resume=False, overwrite=True) is None
        lock_output_dir(out)  # idempotent within the holding process
    finally:
        release_output_dir(out)


def test_overwrite_starts_clean_and_resume_keeps_everything(tmp_path):
    out = tmp_path / "run"
    old = ["metrics.jsonl", "config.yaml", "curves.png", "report.html", "reports/step-00000010.html",
           "tensorboard/events.out.tfevents.1", "wandb_run_id.txt", "checkpoints/global_step_10/trainer_state.json"]
    for name in old:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old")
    (out / "notes.txt").write_text("mine")
    try:
        with pytest.raises(FileExistsError, match="already holds a run"):
            _prepare_output(out, CheckpointManager(out / "checkpoints", 2), resume=False, overwrite=False)
        assert all((out / name).exists() for name in old)
        assert _prepare_output(out, CheckpointManager(out / "checkpoints", 2), resume=False, overwrite=True) is None
        left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        assert left == [".mmrlhf.lock", "notes.txt"], left
    finally:
        release_output_dir(out)
