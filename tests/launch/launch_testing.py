"""Helpers shared by the launch tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def stopped_at(run: Path, out: Path, step: int) -> Path:
    """``out`` as the finished run ``run`` would have left it had it stopped after ``step``: its checkpoint of that
    step (the run's output folder rewritten to ``out`` and the manifest sealed again) and its first ``step`` metrics
    rows. A resume of ``out`` then trains the steps after ``step`` as ``run`` did, without a run of its own to stop
    (a launch costs several times a toy step)."""
    from mmrlhf.trainer.checkpoint_manifest import write_manifest

    name = f"step-{step:08d}"
    folder = out / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / name, folder / name)
    (folder / "latest").write_text(name + "\n")
    state_file = folder / name / "trainer_state.json"  # as if the run had been in this folder
    state = json.loads(state_file.read_text())
    state["config"]["trainer"]["output_dir"] = str(out)
    state_file.write_text(json.dumps(state))
    write_manifest(folder / name)  # re-sealed after the edit, or the resume would find it damaged
    rows = (run / "metrics.jsonl").read_text().splitlines()[:step]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))
    return out
