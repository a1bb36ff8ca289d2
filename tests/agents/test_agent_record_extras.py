"""A tool sees its record's own columns and can open the record's relative paths: the documented ``FlipCard`` tool
(docs/agents.md, "Writing a tool") runs in the real turn loop of the experience maker, over records read from a
JSONL file by the data loader, through the one function every launch mode hands records to the maker with
(:func:`~mmrlhf.data.stream.record_columns`: one process, torchrun ranks and Ray rollout actors alike)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrlhf.agents.types import ToolContext

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
GREEN = (10, 200, 30)  # the back; the front is red


def _documented_tool(folder: Path) -> Path:
    """The doc's FlipCard, plus a copy named like the call the tiny tool model writes (``image_zoom``, see
    :data:`~mmrlhf.testing.tiny_models.TOY_CALL_TOKEN`): its arguments (a box) are ignored."""
    code = next(block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
                if "class FlipCard" in block)
    path = folder / "card_tools.py"
    path.write_text(code + "\n\nclass FlipCardAsZoom(FlipCard):\n    name = \"image_zoom\"\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A maker with the tool over the tiny tool-calling Qwen2-VL (transformers engine, sampling only the call
    token: every first turn calls), and the prompt stream of a JSONL file whose back image is relative to it."""
    from mmrlhf.config import build_config
    from mmrlhf.data.stream import PromptStream
    from mmrlhf.experience.builder import build_experience_maker
    from mmrlhf.testing.tiny_models import TOY_CALL_TOKEN, tiny_model_dir
    from mmrlhf.trainer.builder import build_prompt_source

    root = tmp_path_factory.mktemp("cards")
    (root / "data" / "cards").mkdir(parents=True)
    Image.new("RGB", (84, 56), GREEN).save(root / "data" / "cards" / "7_back.png")
    Image.new("RGB", (56, 56), (200, 10, 10)).save(root / "data" / "cards" / "7.png")
    row = {"prompt": "<image>Which suit?", "images": ["cards/7.png"], "id": "card-7", "reference": "red",
           "back": "cards/7_back.png", "suit": "hearts"}
    (root / "data" / "cards.jsonl").write_text(json.dumps(row) + "\n")
    config = build_config({
        "model": {"pretrain": str(tiny_model_dir("qwen2_vl", tools=True)), "dtype": "float32"},
        "data": {"prompt_data": [str(root / "data" / "cards.jsonl")], "prompt_max_len": 64, "image_max_pixels": 3136},
        "rollout": {"engine": "transformers", "n_samples_per_prompt": 2, "max_new_tokens": 2, "max_model_len": 192,
                    "allowed_tokens": [TOY_CALL_TOKEN]},
        "agent": {"tools": [{"tool": f"{_documented_tool(root)}:FlipCardAsZoom"}], "max_turns": 2, "max_images": 3},
        "reward": {"label_map": {"card": {"type": "function", "function": "mmrlhf.tasks.shapes:first_word_reward"}},
                   "default_recipe": [["card", 1.0]]},
        "algorithm": {"advantage_estimator": "grpo"},
    })
    maker = build_experience_maker(config).maker
    return maker, PromptStream(build_prompt_source(config), seed=0, shuffle=False), root


def test_a_tool_reads_an_extra_column_and_a_relative_path(setup, monkeypatch):
    from mmrlhf.data.stream import record_columns

    maker, stream, root = setup
    monkeypatch.chdir(root)  # the back image is not under the working directory: only data_dir finds it
    rollout = maker.generate_rollout(**record_columns(stream.next_batch(1)))
    observations = [turn for traj in rollout.rows.trajectories for turn in traj.turns if turn.role == "tool"]
    assert len(observations) >= 2  # every trajectory called the tool
    for turn in observations:
        assert turn.errors == [], turn.text
        assert "The back of card card-7 (hearts)." in turn.text
        assert np.all(np.asarray(turn.images[0]) == GREEN)  # the back, as the processor resized it


def test_an_extra_column_named_like_a_standard_field_is_refused_naming_the_sample(setup):
    from mmrlhf.data.stream import record_columns

    maker, stream, _ = setup
    columns = record_columns(stream.next_batch(1))
    columns["extras"] = [{"label": "a column data.label_key does not read", "suit": "hearts"}]
    with pytest.raises(ValueError, match=r"record 0 \(id='card-7'\), sample 0: column\(s\) \['label'\] clash"):
        maker.generate_rollout(**columns)


def test_resolve_puts_relative_paths_under_the_data_dir():
    ctx = ToolContext(record={}, data_dir="/data/cards")
    assert ctx.resolve("b/7.png") == Path("/data/cards/b/7.png")
    assert ctx.resolve("/elsewhere/7.png") == Path("/elsewhere/7.png")
    assert ToolContext(record={}).resolve("b/7.png") == Path("b/7.png")  # no data folder: the working directory's
