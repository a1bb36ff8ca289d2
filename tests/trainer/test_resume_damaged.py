"""``--resume`` in one process over a real run's damaged checkpoints: one short run (transformers engine, 4 steps,
checkpoints at steps 2 and 4), restored before each test and damaged in one way. Every damage is detected by the
verification alone (no model loads); one full resume proves the fall back trains on from step 2 exactly as the
uninterrupted run did; the refusals are the CLI's one ``error:`` line with exit code 2. The torchrun and Ray modes'
own runs: tests/launch/test_torchrun.py and tests/launch/test_ray_training.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from mmrlhf.trainer.builder import build_trainer
from mmrlhf.trainer.checkpoint import CheckpointManager
from mmrlhf.trainer.checkpoint_manifest import MANIFEST, STATE_KEY, checkpoint_files, verify_checkpoint
from mmrlhf.trainer.output_lock import release_output_dir
from trainer_helpers import flip_a_byte, metrics_rows, stable, toy_config, truncate

pytestmark = pytest.mark.slow  # the module's run takes ~30 s on the 2-core machine; each test after it a few

PARITY = {"label_map": {"parity": {"type": "function", "function": "trainer_helpers:parity_reward"}},
          "default_recipe": [["parity", 1.0]]}  # varies within groups: every step updates the policy
TRAINER = {"max_steps": 4, "save_steps": 2, "keep_last": None}


def _config(out: Path, **trainer):
    return toy_config(out, reward=PARITY, trainer={**TRAINER, **trainer})


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, Path]:
    """(the run's folder, a pristine copy of it)."""
    out = tmp_path_factory.mktemp("damaged") / "run"
    trainer = build_trainer(_config(out))
    with trainer.p.tracker:
        trainer.fit()
    release_output_dir(out)
    pristine = out.with_name("pristine")
    shutil.copytree(out, pristine)
    return out, pristine


@pytest.fixture
def run(ran) -> Path:
    """The run's folder as the run left it (each test damages it its own way)."""
    out, pristine = ran
    release_output_dir(out)
    shutil.rmtree(out)
    shutil.copytree(pristine, out)
    return out


def _ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def test_a_real_checkpoint_records_every_file_it_holds(run):
    for step in (2, 4):
        folder = _ckpt(run, step)
        manifest = json.loads((folder / MANIFEST).read_text())
        assert sorted(manifest["files"]) == checkpoint_files(folder)
        assert {"model/model.safetensors", "model/config.json", "optimizer/.metadata", "optimizer/__0_0.distcp",
                "steppers.pt", "rng-rank0.pt", "rng-rank0.json", "trainer_state.json"} <= set(manifest["files"])
        assert json.loads((folder / "trainer_state.json").read_text())[STATE_KEY] == MANIFEST
        assert verify_checkpoint(folder).intact


DAMAGES = {  # what is done to the step-4 checkpoint -> the file the verification names
    "weights truncated": (lambda f: truncate(f / "model/model.safetensors", 0.3), "model/model.safetensors"),
    "optimizer shard truncated": (lambda f: truncate(f / "optimizer/__0_0.distcp"), "optimizer/__0_0.distcp"),
    "optimizer metadata flipped": (lambda f: flip_a_byte(f / "optimizer/.metadata"), "optimizer/.metadata"),
    "trainer state truncated": (lambda f: truncate(f / "trainer_state.json"), "trainer_state.json"),
    "manifest truncated": (lambda f: truncate(f / MANIFEST), MANIFEST),
    "manifest deleted": (lambda f: (f / MANIFEST).unlink(), MANIFEST),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=str)
def test_each_damage_of_the_latest_is_named_and_the_resume_takes_the_previous_checkpoint(run, damage, caplog):
    do, name = DAMAGES[damage]
    do(_ckpt(run, 4))
    assert verify_checkpoint(_ckpt(run, 4)).file == name
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.checkpoint"):
        chosen = CheckpointManager(run / "checkpoints").resume_point()
    assert chosen == _ckpt(run, 2)
    assert f"checkpoint {_ckpt(run, 4)} is damaged: {name}: " in caplog.text


def test_a_damaged_latest_checkpoint_resumes_training_from_the_previous_one(run, ran, caplog):
    """The step-4 weights cut short (what a preempted copy leaves): the resume warns with the file, continues from
    step 2, and steps 3 and 4 come out as the uninterrupted run's (transformers engine: exact resume)."""
    truncate(_ckpt(run, 4) / "model/model.safetensors", 0.3)
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.checkpoint"):
        trainer = build_trainer(_config(run), resume=True)
    assert trainer.state.step == 2  # the step counter continues from the intact checkpoint
    assert f"{_ckpt(run, 4)} is damaged: model/model.safetensors: " in caplog.text and "(truncated)" in caplog.text
    with trainer.p.tracker:
        trainer.fit()
    assert trainer.state.step == 4
    original, resumed = metrics_rows(ran[1]), metrics_rows(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(original[2:], resumed[2:]):
        sa, sb = stable(a), stable(b)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sb[k] == pytest.approx(sa[k], rel=1e-5, abs=1e-6), (a["step"], k)
    assert stable(original[2]) != stable(original[3])  # control: the steps differ, so the equality is not vacuous
    assert (run / "checkpoints" / "step-00000004.damaged" / "DAMAGED.txt").exists()
    assert [p.name for p in trainer.p.checkpoints.checkpoints()] == ["step-00000002", "step-00000004"]
    assert verify_checkpoint(_ckpt(run, 4)).intact  # saved again by the resumed run


def test_strict_or_no_intact_checkpoint_is_one_error_line_with_exit_code_2(run, capsys):
    from mmrlhf.launch.report import train_and_report

    truncate(_ckpt(run, 4) / "model/model.safetensors")
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert train_and_report(_config(run, resume_strict=True), resume=True) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --resume: the latest checkpoint {_ckpt(run, 4)} is damaged: "
                           "model/model.safetensors: ") and "trainer.resume_strict=true" in line
    truncate(_ckpt(run, 2) / "optimizer/__0_0.distcp")
    assert train_and_report(_config(run), resume=True) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --resume: no intact checkpoint under {run / 'checkpoints'}: ")
    assert "step-00000004/model/model.safetensors: " in line and "step-00000002/optimizer/__0_0.distcp: " in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing  # refusals set nothing aside


def test_a_checkpoint_written_before_manifests_resumes_with_one_warning(run, caplog):
    folder = _ckpt(run, 4)
    (folder / MANIFEST).unlink()
    state = json.loads((folder / "trainer_state.json").read_text())
    del state[STATE_KEY]  # what an older mmrlhf wrote
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.checkpoint"):
        trainer = build_trainer(_config(run, max_steps=5), resume=True)
    with trainer.p.tracker:  # built only: closed again
        assert trainer.state.step == 4
    warned = [r.getMessage() for r in caplog.records
              if r.name == "mmrlhf.trainer.checkpoint" and r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "has no manifest.json" in warned[0] and "cannot be verified" in warned[0]


def test_a_checkpoint_written_before_the_mixed_rank_seeds_resumes_keeping_seed_plus_rank(run, caplog):
    """A checkpoint records how its run's ranks derive their sampling seeds; one that records nothing (an older
    mmrlhf, ``seed + rank``) is resumed under that scheme to the run's end, so each rank's sampling goes on as it
    began: rank 0 is the same under both, rank 1 keeps seed + 1 (one warning, from rank 0), and the resumed run's
    next checkpoint records the scheme it kept. A checkpoint of the mixed seeds resumes mixed."""
    from mmrlhf.parallel.world import World
    from mmrlhf.rollout.types import rank_seed
    from mmrlhf.trainer.builder import _rank_config, resumed_rank_config
    from mmrlhf.trainer.checkpoint_manifest import write_manifest

    config = _config(run, max_steps=5)
    seed = config.rollout.seed
    ranks = [World(rank=r, world_size=2, launch="torchrun") for r in (0, 1)]
    mixed = [resumed_rank_config(config, _rank_config(config, w), w, _ckpt(run, 2)) for w in ranks]
    assert [(c.rollout.seed, s) for c, s in mixed] == [(seed, "mixed"), (rank_seed(seed, 1), "mixed")]

    folder = _ckpt(run, 4)
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state.pop("rank_seeds") == "mixed"
    (folder / "trainer_state.json").write_text(json.dumps(state))  # what an older mmrlhf wrote
    write_manifest(folder)  # sealed again: an intact checkpoint of the old format
    with caplog.at_level(logging.WARNING, logger="mmrlhf.trainer.builder"):
        old = [resumed_rank_config(config, _rank_config(config, w), w, folder) for w in ranks]
    assert [(c.rollout.seed, s) for c, s in old] == [(seed, "offset"), (seed + 1, "offset")]
    warned = [r.getMessage() for r in caplog.records if r.name == "mmrlhf.trainer.builder"]
    assert len(warned) == 1 and "keeps rollout.seed + rank" in warned[0] and str(folder) in warned[0]

    caplog.clear()
    trainer = build_trainer(config, resume=True)  # one process: rank 0, whose seed is the same under both
    assert trainer.state.step == 4 and trainer.s.rank_seeds == "offset"
    assert trainer.p.source.maker.sampling.seed == seed
    assert not [r for r in caplog.records if r.name == "mmrlhf.trainer.builder" and r.levelno >= logging.WARNING]
    with trainer.p.tracker:
        trainer.fit()
    assert json.loads((_ckpt(run, 5) / "trainer_state.json").read_text())["rank_seeds"] == "offset"
