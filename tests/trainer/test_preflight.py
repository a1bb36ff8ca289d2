"""Refusals the config and the data tell come before any model loads (``mmrlhf.trainer.preflight``): video prompts in
an agent run of a family that sends them as text only (Qwen3-VL; the family from ``model.family`` or, under
``auto``, the checkpoint's config.json), and LoRA's default targets on a model whose MLPs are routed experts.
Every model load here raises, so a refusal that came after a load (as it did) fails the test; each control goes
through the checks to the load. Tiny models, no weight read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrlhf.trainer.builder import build_trainer
from trainer_helpers import toy_config

AGENT = {"tools": ["image_zoom"], "max_turns": 2}


class ModelLoaded(AssertionError):
    """A model's weights were asked for: the refusal did not come first."""


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every transformers model load raises :class:`ModelLoaded` (the actor, reference, critic and teacher all load
    through it; the engine here is transformers, which shares the actor's module)."""
    from transformers import AutoModelForImageTextToText

    def refuse(cls, path, *args, **kwargs):
        raise ModelLoaded(f"a model was loaded from {path}")

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", classmethod(refuse))


def video_record(index: int, *, split: str) -> dict:
    """A generated record with a video (frames as nested lists of pixels: never decoded before the refusal)."""
    return {"id": f"{split}-{index}", "prompt": "<video> What moves?", "videos": [[[[[0, 0, 0]]]]], "label": "x"}


def _records(folder: Path, *, video: bool) -> Path:
    rows = [{"id": "a", "prompt": "<image> Which colour?", "images": ["a.png"], "label": "red"},
            {"id": "b", "prompt": "Count to three.", "label": "3"}]
    if video:
        rows.append({"id": "clip", "prompt": "<video> What moves?", "videos": ["clip.mp4"], "label": "x"})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _agent_config(tmp_path: Path, family: str, data: dict, model: dict | None = None):
    data = {"generator": None, "generator_options": {}, **data}
    return toy_config(tmp_path / "run", family=family, agent=AGENT, data=data,
                      model={**(model or {})}, rollout={"max_model_len": 512})


@pytest.mark.parametrize("family", ["auto", "qwen3_vl"])
def test_a_video_prompt_in_an_agent_run_of_qwen3_vl_is_refused_naming_the_record_before_any_model_loads(
        tmp_path, no_model_loads, family):
    data = _records(tmp_path, video=True)
    config = _agent_config(tmp_path, "qwen3_vl", {"prompt_data": [str(data)]}, {"family": family})
    with pytest.raises(ValueError) as err:
        build_trainer(config)
    text = str(err.value)
    assert f"record 2 (id='clip'), field 'videos', file '{data}'" in text
    assert "qwen3_vl family" in text and "only as text" in text
    assert ("model.family=auto: read from" in text) == (family == "auto")
    assert not (tmp_path / "run").exists()  # refused before the output folder was touched
    # control: the same run without the video record goes through the checks to the first model load
    clean = _records(tmp_path, video=False)
    with pytest.raises(ModelLoaded):
        build_trainer(_agent_config(tmp_path, "qwen3_vl", {"prompt_data": [str(clean)]}, {"family": family}))


def test_a_generated_video_prompt_and_an_eval_file_are_scanned_too(tmp_path, no_model_loads):
    generated = _agent_config(tmp_path, "qwen3_vl", {"generator": "test_preflight:video_record"})
    with pytest.raises(ValueError, match=r"record 0 \(id='train-0'\), field 'videos', file "
                                         r"'test_preflight:video_record\[train\]': .*only as text"):
        build_trainer(generated)
    clean, videos = _records(tmp_path, video=False), _records(tmp_path / "..", video=True)
    evaluated = _agent_config(tmp_path, "qwen3_vl", {"prompt_data": [str(clean)], "eval_data": [str(videos)]})
    with pytest.raises(ValueError, match=r"record 2 \(id='clip'\).*only as text"):
        build_trainer(evaluated.model_copy(update={"trainer": evaluated.trainer.model_copy(
            update={"eval_steps": 1})}))
    with pytest.raises(ModelLoaded):  # no evaluation: the held-out file is never read
        build_trainer(evaluated)


def test_video_prompts_pass_where_the_family_sends_them_as_ids_or_the_run_has_one_turn(tmp_path, no_model_loads):
    data = {"prompt_data": [str(_records(tmp_path, video=True))]}
    with pytest.raises(ModelLoaded):
        build_trainer(_agent_config(tmp_path, "qwen2_vl", data))  # Qwen2-VL: one pad per video, sent as ids
    single = toy_config(tmp_path / "single", family="qwen3_vl", data={"generator": None, **data})
    with pytest.raises(ModelLoaded):
        build_trainer(single)  # one turn: the prompt goes to the engine as text


def test_lora_default_targets_on_routed_experts_are_refused_before_any_model_loads(tmp_path, no_model_loads):
    lora = {"rank": 4}
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: 'gate_proj' .*routed experts.*"
                                         r"model\.lora\.rank=0"):
        build_trainer(toy_config(tmp_path / "run", family="qwen3_vl_moe", model={"lora": lora}))
    assert not (tmp_path / "run").exists()
    attention = {**lora, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # control: what it has
    with pytest.raises(ModelLoaded):
        build_trainer(toy_config(tmp_path / "run", family="qwen3_vl_moe", model={"lora": attention}))
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules: 'qkv_proj' matches no Linear layer"):
        build_trainer(toy_config(tmp_path / "run", family="qwen2_vl", model={"lora": {**lora,
                                                                                      "target_modules": ["qkv_proj"]}}))


@pytest.mark.parametrize("family, vision", [("qwen3_5_moe", "none"), ("qwen3_vl", "both")])
def test_the_targets_planned_on_the_empty_model_are_the_loaded_models(family, vision):
    """The early check resolves on a meta-device copy: the same layers as on the loaded model (Qwen3.5-MoE's shared
    expert matches the MLP names, the routed experts do not; Qwen3-VL's tower and deepstack mergers)."""
    from mmrlhf.config.model import LoraConfig
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.lora import planned_targets, resolve_target_modules
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path, cfg = tiny_model_dir(family), LoraConfig(rank=4, vision=vision)
    planned = planned_targets(path, get_adapter(path), cfg)
    loaded = ActorVL.from_pretrained(str(path))
    assert planned == resolve_target_modules(loaded.model, loaded.adapter, cfg)
    assert any(".shared_expert." in n for n in planned) == (family == "qwen3_5_moe")
    assert any(".visual." in n for n in planned) == (vision != "none")
