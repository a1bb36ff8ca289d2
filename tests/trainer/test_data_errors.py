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
