"""MetricsTracker: the JSONL record (flushed, resumable, truncatable), TensorBoard scalars and the W&B path."""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch

from mmrlhf.trainer.tracking import METRICS_FILE, MetricsTracker, WandbSettings


def _file_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def _tb_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_each_log_is_one_row_on_disk_before_close(tmp_path):
    t = MetricsTracker(tmp_path, tensorboard=False)
    t.log(1, {"reward/mean": 0.5, "kl/mean": 0.01})
    assert _file_rows(tmp_path) == [{"step": 1, "reward/mean": 0.5, "kl/mean": 0.01}]  # readable while open
    t.log(2, {"reward/mean": 0.75, "n": 3, "t": torch.tensor(2.5), "f32": torch.tensor([1.5])})
    assert _file_rows(tmp_path)[1] == {"step": 2, "reward/mean": 0.75, "n": 3.0, "t": 2.5, "f32": 1.5}
    assert t.history() == _file_rows(tmp_path)
    t.close()
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        t.log(3, {"x": 1.0})


def test_non_finite_values_are_null_in_jsonl_and_skipped_for_tensorboard(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.tracking"):
        with MetricsTracker(tmp_path) as t:
            t.log(0, {"a": float("nan"), "b": 1.0, "c": float("inf")})
            t.log(1, {"a": float("nan"), "b": 2.0, "c": 3.0})
    assert _file_rows(tmp_path) == [{"step": 0, "a": None, "b": 1.0, "c": None},
                                    {"step": 1, "a": None, "b": 2.0, "c": 3.0}]
    assert "NaN" not in (tmp_path / METRICS_FILE).read_text()  # strict JSON, not Python's NaN literal
    assert _tb_scalars(tmp_path) == {"b": [(0, 1.0), (1, 2.0)], "c": [(1, 3.0)]}
    warned = [r.getMessage() for r in caplog.records]
    assert sum("'a'" in m for m in warned) == 1 and sum("'c'" in m for m in warned) == 1  # once per key


@pytest.mark.parametrize("bad", ["0.5", None, [1.0], {"x": 1}, torch.ones(2), 1 + 2j])
def test_non_numeric_metric_is_an_error_naming_the_key_and_writes_nothing(tmp_path, bad):
    with MetricsTracker(tmp_path, tensorboard=False) as t:
        with pytest.raises(TypeError, match="'policy/loss'"):
            t.log(4, {"reward/mean": 1.0, "policy/loss": bad})
        assert (tmp_path / METRICS_FILE).read_text() == "" and t.history() == []


def test_step_key_and_bad_steps_are_refused(tmp_path):
    with MetricsTracker(tmp_path, tensorboard=False) as t:
        with pytest.raises(ValueError, match="reserved"):
            t.log(1, {"step": 3.0})
        for step in (-1, 1.5, "2", True):
            with pytest.raises(TypeError, match="step"):
                t.log(step, {"x": 1.0})


def _run(out: Path, steps, **kw) -> None:
    with MetricsTracker(out, **kw) as t:
        for s in steps:
            t.log(s, {"reward/mean": float(s), "kl/mean": s / 10})


def test_resume_reads_back_and_truncate_after_drops_replayed_steps(tmp_path):
    _run(tmp_path, range(1, 6))  # crashed after step 5; the last checkpoint is step 3
    t = MetricsTracker(tmp_path, resume=True)
    assert [r["step"] for r in t.history()] == [1, 2, 3, 4, 5]
    assert t.truncate_after(3) == 2
    assert [r["step"] for r in _file_rows(tmp_path)] == [1, 2, 3]
    t.log(4, {"reward/mean": 40.0, "kl/mean": 0.4})
    t.close()
    rows = _file_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["reward/mean"] == 40.0
    assert t.history() == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE, "tensorboard"]  # no temp files left
    # TensorBoard hides the first run's points after the resumed step: step 4 appears once, with the new value.
    assert _tb_scalars(tmp_path)["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_truncate_after_is_atomic(tmp_path, monkeypatch):
    _run(tmp_path, range(1, 4), tensorboard=False)
    before = (tmp_path / METRICS_FILE).read_text()
    t = MetricsTracker(tmp_path, resume=True, tensorboard=False)

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        t.truncate_after(1)
    assert (tmp_path / METRICS_FILE).read_text() == before  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_FILE]  # the temp file is gone


def test_existing_metrics_are_never_replaced_silently(tmp_path):
    _run(tmp_path, [1, 2], tensorboard=False)
    with pytest.raises(FileExistsError, match="resume=True"):
        MetricsTracker(tmp_path, tensorboard=False)
    assert len(_file_rows(tmp_path)) == 2
    _run(tmp_path, [7], tensorboard=False, overwrite=True)
    assert [r["step"] for r in _file_rows(tmp_path)] == [7]


def test_resume_drops_an_incomplete_last_line_and_rejects_a_corrupt_one(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')  # crash mid-write
    with MetricsTracker(tmp_path, resume=True, tensorboard=False) as t:
        assert [r["step"] for r in t.history()] == [1, 2]
        t.log(3, {"x": 3.0})
    assert [r["step"] for r in _file_rows(tmp_path)] == [1, 2, 3]
    path.write_text('{"step": 1, "x": 1.0}\nnot json\n{"step": 3, "x": 3.0}\n')
    with pytest.raises(ValueError, match="line 2"):
        MetricsTracker(tmp_path, resume=True, tensorboard=False)


def test_run_config_goes_to_tensorboard_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsTracker(tmp_path, run_config={"trainer": {"lr": 1e-6}}) as t:
        t.log(0, {"x": 1.0})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert any("run_config" in tag for tag in acc.Tags()["tensors"])


# ---- Weights & Biases ------------------------------------------------------------------------------------------


class _FakeRun:
    def __init__(self, calls: list, run_id: str) -> None:
        self.calls, self.id = calls, run_id

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self, exit_code=None):
        self.calls.append(("finish", exit_code))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: list = []
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _FakeRun(calls, kwargs.get("id") or "run-abc")

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_wandb_gets_init_log_finish(tmp_path, fake_wandb):
    settings = WandbSettings(project="mmrlhf-test", entity="team", run_name="r1", mode="offline")
    with MetricsTracker(tmp_path, tensorboard=False, wandb=settings, run_config={"lr": 1e-6}) as t:
        t.log(1, {"reward/mean": 0.5, "kl/mean": float("nan")})
    (kind, init), log, finish = fake_wandb
    assert kind == "init"
    assert {k: init[k] for k in ("project", "entity", "name", "mode", "config")} == {
        "project": "mmrlhf-test", "entity": "team", "name": "r1", "mode": "offline", "config": {"lr": 1e-6}}
    assert init["id"] is None
    assert log == ("log", {"reward/mean": 0.5}, 1)  # the NaN stays out of W&B
    assert finish == ("finish", 0)


def test_wandb_resume_continues_the_same_run_and_a_failure_is_reported(tmp_path, fake_wandb):
    settings = WandbSettings(project="p")
    with MetricsTracker(tmp_path, tensorboard=False, wandb=settings) as t:
        t.log(1, {"x": 1.0})
    fake_wandb.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with MetricsTracker(tmp_path, tensorboard=False, wandb=settings, resume=True) as t:
            raise RuntimeError("boom")
    init = fake_wandb[0][1]
    assert init["id"] == "run-abc" and init["resume"] == "allow"
    assert fake_wandb[-1] == ("finish", 1)


def test_missing_wandb_names_pip_install_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsTracker(tmp_path / "run", wandb=WandbSettings(project="p"))
    assert not (tmp_path / "run" / METRICS_FILE).exists()


def test_wandb_settings_are_validated_and_frozen():
    with pytest.raises(ValueError, match="mode"):
        WandbSettings(project="p", mode="sometimes")
    with pytest.raises(ValueError, match="project"):
        WandbSettings(project="")
    s = WandbSettings(project="p", mode="disabled")
    with pytest.raises(FrozenInstanceError):
        s.project = "q"  # type: ignore[misc]
