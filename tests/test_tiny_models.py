"""Tiny Qwen-VL factory: offline, deterministic, loads and generates in transformers with images and video."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.models.adapters import get_adapter
from mmrlhf.testing.engine_check import default_cases, processor_inputs
from mmrlhf.testing.tiny_models import (
    COLOURS,
    FAMILIES,
    RELEASED_GENERATION_DEFAULTS,
    SPECIAL_TOKENS,
    build_tiny_model,
    tiny_model_dir,
)

# Every family's tiny model builds, loads and generates; the current generation's structure is checked below.
assert set(FAMILIES) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"}


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_deterministic(tmp_path, family):
    a = _digests(build_tiny_model(tmp_path / "a", family, "tiny", seed=3))
    b = _digests(build_tiny_model(tmp_path / "b", family, "tiny", seed=3))
    assert {"model.safetensors", "tokenizer.json", "config.json", "processor_config.json"} <= a.keys()
    assert a == b
    c = _digests(build_tiny_model(tmp_path / "c", family, "tiny", seed=4))
    assert c["model.safetensors"] != a["model.safetensors"]
    assert c["tokenizer.json"] == a["tokenizer.json"]


def test_cache_reuses_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MMRLHF_CACHE_DIR", str(tmp_path))
    first = tiny_model_dir("qwen2_vl", "tiny", seed=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("qwen2_vl", "tiny", seed=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "tiny-models"


def test_unknown_family_or_size_is_rejected():
    with pytest.raises(ValueError, match="qwen2_vl"):
        tiny_model_dir("llava", "tiny")
    with pytest.raises(ValueError, match="tiny, small"):
        tiny_model_dir("qwen2_vl", "huge")


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_config_ids(family):
    path = tiny_model_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    for token in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(token) != tok.unk_token_id
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1
    for colour in COLOURS:  # toy-task answers are single tokens
        assert len(tok(" " + colour, add_special_tokens=False)["input_ids"]) == 1
    adapter = get_adapter(path)
    assert adapter.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert adapter.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    model = AutoModelForImageTextToText.from_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.text_config.eos_token_id == eos
    assert model.generation_config.eos_token_id == eos
    text = model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert head_dim >= 32  # vLLM CPU attention rejects small head sizes
    rotary = head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0)  # Qwen3.5 rotates a quarter
    assert sum(text.rope_parameters["mrope_section"]) == rotary // 2


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_generates_with_images_and_video(family):
    path = tiny_model_dir(family)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    adapter = get_adapter(path)
    bad = [[t] for t in adapter.vision_special_token_ids()]
    for case in default_cases(processor):
        inputs = processor_inputs(processor, adapter, case)
        ids = inputs["input_ids"][0]
        n_img = int((ids == adapter.image_token_id).sum())
        n_vid = int((ids == adapter.video_token_id).sum())
        if case.images:
            assert n_img == int(adapter.tokens_per_grid(inputs["image_grid_thw"]).sum()) > 0
            assert inputs["image_grid_thw"].shape[0] == len(case.images)
        if case.videos:
            assert n_vid == int(adapter.tokens_per_grid(inputs["video_grid_thw"]).sum()) > 0
        if not case.images and not case.videos:
            assert n_img == n_vid == 0
        out = model.generate(**inputs, max_new_tokens=6, do_sample=True, bad_words_ids=bad,
                             generator=None, pad_token_id=processor.tokenizer.pad_token_id)
        new = out[0, inputs["input_ids"].shape[1]:]
        assert 1 <= new.numel() <= 6, case.name
        assert not np.isin(new.numpy(), adapter.vision_special_token_ids()).any(), case.name


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_variant_shares_the_embedding(family):
    """As Qwen2-VL-2B / Qwen2.5-VL-3B: the head is the input embedding, so the checkpoint stores no lm_head and
    named_parameters() does not list it (what weight updates must cope with)."""
    from safetensors import safe_open

    path = tiny_model_dir(family, tied=True)
    assert path != tiny_model_dir(family) and path.name.startswith(f"{family}-tiny-seed0-tied-")
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert "lm_head.weight" not in dict(model.named_parameters()) and "lm_head.weight" in model.state_dict()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lm_head" in k]
    untied = AutoModelForImageTextToText.from_pretrained(tiny_model_dir(family))
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight


def test_released_generation_config_variant():
    path = tiny_model_dir("qwen2_vl", released_generation_config=True)
    gen = AutoModelForImageTextToText.from_pretrained(path).generation_config
    for key, value in RELEASED_GENERATION_DEFAULTS.items():
        assert getattr(gen, key) == value, key
    assert AutoModelForImageTextToText.from_pretrained(tiny_model_dir("qwen2_vl")).generation_config.top_k in (None, 50)


def test_small_size_has_tens_of_millions_of_parameters(tmp_path):
    path = build_tiny_model(tmp_path / "small", "qwen2_vl", "small", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert 10e6 <= n <= 100e6, n


def test_tool_variant_holds_a_user_tools_call_as_one_token(capsys):
    """``tool_names`` / ``tool_calls``: the user's tool's whole call is one added token that the agent's parser reads
    as that call; the plain tool variant (the zoom toy task's) keeps its cache name and its tokens."""
    from mmrlhf.agents.calls import parse_turn
    from mmrlhf.agents.tools import build_tools
    from mmrlhf.testing.tiny_models import TOY_CALL_TOKEN, _factory_hash, main
    from mmrlhf.testing.tiny_tool_calls import call_token

    calls = [{"name": "calculator", "arguments": {"expression": "2 + 2"}}]
    path = tiny_model_dir("qwen2_vl", tools=True, tool_calls=calls, tool_names=["calculator"])
    zoom = tiny_model_dir("qwen2_vl", tools=True)
    assert zoom.name == f"qwen2_vl-tiny-seed0-tools-{_factory_hash()}"
    assert path.name.startswith("qwen2_vl-tiny-seed0-tools-calculator-") and path != zoom
    tok, zoom_tok = (AutoProcessor.from_pretrained(p).tokenizer for p in (path, zoom))
    assert {k: v for k, v in tok.get_vocab().items() if k in zoom_tok.get_vocab()} == zoom_tok.get_vocab()
    named = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'  # tool_names: a call without arguments
    for token in (call_token(calls[0]), named):
        ids = tok(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids) == token and token not in zoom_tok.get_vocab()
    parsed = parse_turn(call_token(calls[0]), build_tools(["calculator"]), remaining_calls=1)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2 + 2"})]
    assert len(tok(TOY_CALL_TOKEN, add_special_tokens=False)["input_ids"]) == 1
    assert main(["--tool-call", '{"name": "calculator", "arguments": {"expression": "2 + 2"}}',
                 "--tool", "calculator"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(path) and f"call token: {call_token(calls[0])}" in err
    with pytest.raises(ValueError, match="need tools=True"):
        tiny_model_dir("qwen2_vl", tool_names=["calculator"])
    with pytest.raises(ValueError, match="given twice"):
        tiny_model_dir("qwen2_vl", tools=True, tool_names=["calculator", "calculator"])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_families_interleave_linear_and_full_attention(family):
    """Qwen3.5's decoder: at least one Gated DeltaNet layer and one full-attention layer, more value than key heads
    in the linear layers (as released), and the small size in the released 3-linear-1-full pattern."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir(family))
    text = model.config.text_config
    assert text.layer_types == ["linear_attention", "full_attention"]
    layers = model.model.language_model.layers
    assert hasattr(layers[0], "linear_attn") and hasattr(layers[1], "self_attn")
    assert text.linear_num_value_heads > text.linear_num_key_heads
    assert get_adapter(tiny_model_dir(family)).recurrent_layers


def test_small_hybrid_repeats_three_linear_then_one_full(tmp_path):
    from mmrlhf.testing.tiny_models import _DIMS, _hybrid_text

    kinds = _hybrid_text(_DIMS["small"], 64)["layer_types"]
    assert kinds == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_vl_moe"])
def test_moe_families_route_to_several_experts(family):
    """Several experts, top-k > 1 (routing weights matter), every layer sparse; Qwen3.5-MoE has the gated shared
    expert. The router really picks k of them for a token."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir(family), dtype=torch.float32)
    text = model.config.text_config
    assert text.num_experts >= 4 and text.num_experts_per_tok == 2
    mlp = model.model.language_model.layers[0].mlp
    assert hasattr(mlp, "shared_expert") == (family == "qwen3_5_moe")
    _, scores, chosen = mlp.gate(torch.randn(5, text.hidden_size))
    assert chosen.shape == (5, 2) and torch.allclose(scores.sum(-1), torch.ones(5))
    assert get_adapter(tiny_model_dir(family)).routed_experts


def test_qwen3_vl_moe_stores_its_experts_as_released():
    """Qwen3-VL-MoE checkpoints hold the fused experts transposed ([E, hidden, 2 * inter], [E, inter, hidden]), the
    layout vLLM reads; transformers loads them back to its own layout."""
    from safetensors import safe_open

    path = tiny_model_dir("qwen3_vl_moe")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16)
    experts = model.model.language_model.layers[0].mlp.experts
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj")
        down = f.get_tensor("model.language_model.layers.0.mlp.experts.down_proj")
    text = model.config.text_config
    assert stored.shape == (text.num_experts, text.hidden_size, 2 * text.moe_intermediate_size)
    assert torch.equal(stored.transpose(1, 2), experts.gate_up_proj.data)
    assert torch.equal(down.transpose(1, 2), experts.down_proj.data)


def test_qwen3_5_template_thinks_by_default_and_answers_at_once_on_request():
    """The released template's two modes: thinking opens a block for the model to close; enable_thinking=False
    writes an empty block. Families without thinking ignore the flag."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}]
    processor = AutoProcessor.from_pretrained(tiny_model_dir("qwen3_5"))
    thinking = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    direct = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    assert direct.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = AutoProcessor.from_pretrained(tiny_model_dir("qwen3_vl"))
    assert plain.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False) \
        == plain.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
