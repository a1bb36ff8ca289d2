"""A bad record met during training is named by its number in its file (not its position in the shuffled batch)
and its id, with the resolved path of a missing image."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from mmrlhf.data.errors import DataError
from mmrlhf.data.stream import PromptStream
from mmrlhf.trainer.builder import build_prompt_source, build_trainer
from trainer_helpers import toy_config


def test_a_missing_image_names_the_record_in_its_file_and_the_path_looked_for(tmp_path):
    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "red.png")
    rows = [{"prompt": "<image>What color is the square? Answer with one word.", "images": ["red.png"],
             "reference": "red", "id": f"q{i}"} for i in range(4)]
    rows[2]["images"] = ["gone.png"]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = toy_config(tmp_path / "run", data={"prompt_data": [str(data)], "generator": None, "eval_size": 1},
                     trainer={"max_steps": 1, "eval_steps": 0})
    order = [r.record_id for r in PromptStream(build_prompt_source(cfg), seed=cfg.trainer.seed).next_batch(4)]
    assert order.index("q2") != 2  # the batch position differs from the file number: the message must say 2
    trainer = build_trainer(cfg)
    with pytest.raises(DataError) as err, trainer.p.tracker:
        trainer.fit()
    text = str(err.value)
    assert "record 2 (id='q2'), field 'images'" in text
    assert f"looked for {tmp_path / 'gone.png'}" in text


def _cli(*args, cwd):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH", "")])}  # keep the caller's
    return subprocess.run([sys.executable, "-m", "mmrlhf.cli", "train", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_user_errors_end_with_an_error_line_and_an_exit_code(tmp_path):
    """A bad record met mid-run, and an output folder that cannot be created: one ``error:`` line each, no
    traceback; the second before any model loads."""
    from mmrlhf.config import dump_config

    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "red.png")
    rows = [{"prompt": "<image>What color?", "images": ["gone.png" if i == 2 else "red.png"], "reference": "red",
             "id": f"q{i}"} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = toy_config(tmp_path / "run", data={"prompt_data": [str(tmp_path / "train.jsonl")], "generator": None},
                     trainer={"max_steps": 1, "eval_steps": 0})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dump_config(cfg))
    bad = _cli(str(recipe), cwd=tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "error: record 2 (id='q2'), field 'images'" in bad.stderr and "image file not found" in bad.stderr

    (tmp_path / "a_file").write_text("")
    blocked = _cli(str(recipe), f"trainer.output_dir={tmp_path / 'a_file' / 'run'}", cwd=tmp_path)
    assert blocked.returncode == 2 and "Traceback" not in blocked.stderr, blocked.stderr[-2000:]
    assert blocked.stderr.startswith("error:") and "a_file" in blocked.stderr
