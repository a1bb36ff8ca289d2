"""``mmrlhf train`` as users run it, in a subprocess: Ctrl-C saves and exits cleanly, and a kill in the middle of
writing a checkpoint leaves the previous one intact and loadable (resume picks it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from mmrlhf.config import dump_config
from mmrlhf.trainer.checkpoint import CheckpointManager
from trainer_helpers import metrics_rows, toy_config

pytestmark = pytest.mark.slow


def _recipe(tmp_path: Path, out: Path, **trainer) -> Path:
    cfg = toy_config(out, trainer={"max_steps": 200, **trainer})
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(dump_config(cfg))
    return path


def _env() -> dict:
    # the caller's path stays behind ours (where packages come from a PYTHONPATH, as on the GPU machine)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])}


def _wait_for(predicate, proc, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{out[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, sig):
    out = tmp_path / "run"
    recipe = _recipe(tmp_path, out)
    proc = subprocess.Popen([sys.executable, "-m", "mmrlhf.cli", "train", str(recipe)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists() and len(metrics_rows(out)) >= 2, proc, "two steps")
        proc.send_signal(sig)  # SIGTERM: how a scheduler preempts a job
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text[-3000:]
    assert "interrupted at step" in text and "--resume" in text
    latest = CheckpointManager(out / "checkpoints").latest()
    steps = [r["step"] for r in metrics_rows(out)]
    assert latest is not None and CheckpointManager.step_of(latest) == steps[-1] < 200
    if sig != signal.SIGINT:
        return  # resuming is the same after either signal
    resume = subprocess.run([sys.executable, "-m", "mmrlhf.cli", "train", str(recipe), "trainer.max_steps="
                             f"{steps[-1] + 1}", "--resume"], env=_env(), capture_output=True, text=True, timeout=600)
    assert resume.returncode == 0, resume.stdout[-2000:] + resume.stderr[-2000:]
    assert [r["step"] for r in metrics_rows(out)] == [*steps, steps[-1] + 1]


def test_kill_during_a_checkpoint_save_keeps_the_previous_one(tmp_path):
    out = tmp_path / "run"
    recipe = _recipe(tmp_path, out, save_steps=1)
    marker = tmp_path / "in_second_save"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from mmrlhf.trainer import loop
        real = loop.Trainer.write_checkpoint
        def slow_second_save(self, folder):
            real(self, folder)  # everything written, not yet published
            if self.state.step == 2:
                Path({str(marker)!r}).touch()
                time.sleep(600)
        loop.Trainer.write_checkpoint = slow_second_save
        from mmrlhf.cli import main
        sys.exit(main(["train", {str(recipe)!r}]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(marker.exists, proc, "the second checkpoint save")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    mgr = CheckpointManager(out / "checkpoints")
    assert mgr.latest().name == "step-00000001"
    assert any(p.name.startswith(".tmp-step-00000002") for p in mgr.root.iterdir())  # the killed save's leftovers
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(mgr.latest() / "model")  # the previous checkpoint loads
    resumed = subprocess.run([sys.executable, "-m", "mmrlhf.cli", "train", str(recipe), "trainer.max_steps=2",
                              "--resume"], env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert [r["step"] for r in metrics_rows(out)] == [1, 2]  # step 2 was redone, not duplicated
    assert mgr.latest().name == "step-00000002"
    assert not any(p.name.startswith(".tmp-") for p in mgr.root.iterdir())
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["max_steps"] == 2
