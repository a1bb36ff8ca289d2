"""Parameter counts of the memory plan (``mmrlhf.models.memory.counts``) and the named shapes
(``mmrlhf.models.shapes``).

The counts come from a meta-device model; here they must equal a real instantiated model's under the trainer's own
freeze and LoRA code, and the 7B shape must have the released model's 8.29 B parameters.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from mmrlhf.config.model import LoraConfig
from mmrlhf.models.adapters import get_adapter
from mmrlhf.models.memory.counts import model_facts
from mmrlhf.models.shapes import SHAPES, shape_config, shape_dict, shape_names
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.trainer.optim import freeze_vision

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _real(family: str, *, tied: bool = False):
    path = tiny_model_dir(family, tied=tied)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return model, get_adapter(path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tower,merger", [(True, False), (True, True), (False, False)])
def test_counts_equal_a_real_model_frozen_by_the_trainer(family, tower, merger):
    model, adapter = _real(family)
    real = freeze_vision(model, adapter, tower=tower, merger=merger)  # the trainer's rule
    facts = model_facts(model.config, freeze_vision_tower=tower, freeze_merger=merger)
    c = facts.counts
    assert (c.trainable, c.frozen) == (real["trainable"], real["frozen"])
    assert c.total == sum(p.numel() for p in model.parameters())
    tower_module, mergers = adapter.vision_parts(model)
    assert c.vision_tower + c.merger == sum(p.numel() for p in tower_module.parameters())
    assert c.merger == sum(p.numel() for m in mergers for p in m.parameters())
    assert c.language == c.total - c.vision_tower - c.merger


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_tied_embeddings_are_counted_once(family):
    tied, _ = _real(family, tied=True)
    untied, _ = _real(family)
    ft = model_facts(tied.config, freeze_vision_tower=True, freeze_merger=False)
    fu = model_facts(untied.config, freeze_vision_tower=True, freeze_merger=False)
    head = untied.get_output_embeddings().weight.numel()
    assert ft.tied and not fu.tied
    assert ft.counts.lm_head == 0 and fu.counts.lm_head == head
    assert fu.counts.total - ft.counts.total == head  # control: counting the tie twice would make them equal
    assert ft.counts.total == sum(p.numel() for p in tied.parameters())


@pytest.mark.parametrize("vision", ["none", "tower", "both"])
def test_lora_counts_equal_peft_on_the_actor(vision):
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.lora import apply_lora

    model, adapter = _real("qwen2_5_vl")
    actor = ActorVL(model, adapter)
    cfg = LoraConfig(rank=4, vision=vision)
    facts = model_facts(model.config, freeze_vision_tower=True, freeze_merger=False, lora=cfg)
    base = sum(p.numel() for p in model.parameters())
    apply_lora(actor, cfg)
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    assert facts.counts.lora == trainable == facts.counts.trainable
    assert facts.counts.total == base and facts.counts.frozen == base  # every base weight frozen
    assert facts.counts.tower_on_grad_path == (vision != "none")


def test_the_7b_shape_has_the_released_model_s_parameters():
    facts = model_facts(shape_config("qwen2_5_vl_7b"), freeze_vision_tower=True, freeze_merger=False)
    c = facts.counts
    assert c.total == pytest.approx(8.29e9, rel=0.005)  # the model card's 8.29 B
    assert c.language == pytest.approx(7.6e9, rel=0.005)
    assert c.vision_tower + c.merger == pytest.approx(0.68e9, rel=0.01)
    assert c.trainable == c.language + c.merger and c.frozen == c.vision_tower
    d = facts.decoder
    assert (d.hidden, d.intermediate, d.layers, d.heads, d.kv_heads, d.head_dim, d.vocab) == (
        3584, 18944, 28, 28, 4, 128, 152064)


# Totals of the released checkpoints (their model cards / safetensors headers), in billions.
# Qwen3.5-9B: its checkpoint's tensors without the multi-token-prediction layer (9,409,813,744; 9.65 B with it).
CARD_TOTALS = {"qwen2_vl_2b": 2.21, "qwen2_vl_7b": 8.29, "qwen2_5_vl_3b": 3.75, "qwen2_5_vl_7b": 8.29,
               "qwen3_vl_8b": 8.77, "qwen3_5_9b": 9.41}


@pytest.mark.parametrize("name", shape_names())
def test_every_shape_builds_and_matches_its_model_card(name):
    cfg = shape_config(name)
    facts = model_facts(cfg, freeze_vision_tower=True, freeze_merger=False)
    assert facts.tied == SHAPES[name]["tie_word_embeddings"]
    assert facts.decoder.vocab == SHAPES[name]["text_config"]["vocab_size"]
    if name in CARD_TOTALS:
        assert facts.counts.total / 1e9 == pytest.approx(CARD_TOTALS[name], abs=0.006)


def test_shape_overrides_and_unknown_names():
    cfg = shape_config("qwen2_5_vl_7b", text={"num_hidden_layers": 2}, vision={"depth": 1})
    facts = model_facts(cfg, freeze_vision_tower=True, freeze_merger=False)
    assert facts.decoder.layers == 2 and facts.vision.depth == 1 and facts.decoder.hidden == 3584
    assert shape_dict("qwen3_vl_2b")["text_config"]["num_hidden_layers"] == 28  # a copy: the table is untouched
    shape_dict("qwen3_vl_2b")["text_config"]["num_hidden_layers"] = 1
    assert SHAPES["qwen3_vl_2b"]["text_config"]["num_hidden_layers"] == 28
    with pytest.raises(ValueError, match="unknown model shape 'qwen9'.*qwen2_5_vl_7b"):
        shape_config("qwen9")


def test_moe_and_hybrid_shapes_read_their_experts_and_linear_attention_layers():
    moe = model_facts(shape_config("qwen3_vl_30b_a3b"), freeze_vision_tower=True, freeze_merger=False)
    d = moe.decoder
    assert (d.moe_layers, d.experts, d.top_k, d.moe_intermediate, d.linear_layers) == (48, 128, 8, 768, 0)
    assert moe.counts.expert_weights == 48 * 128 * 3 * 768 * 2048  # gate_up [E, 2I, h] + down [E, h, I]
    assert moe.counts.total / 1e9 == pytest.approx(31.07, abs=0.01)  # "30B-A3B": 31.07 B counted
    hybrid_moe = model_facts(shape_config("qwen3_5_35b_a3b"), freeze_vision_tower=True, freeze_merger=False)
    d = hybrid_moe.decoder
    assert (d.moe_layers, d.experts, d.top_k, d.shared_intermediate, d.linear_layers) == (40, 256, 8, 512, 30)
    assert hybrid_moe.counts.total / 1e9 == pytest.approx(35.11, abs=0.01)  # "35B-A3B": 35.11 B counted
    hybrid = model_facts(shape_config("qwen3_5_9b"), freeze_vision_tower=True, freeze_merger=False)
    d = hybrid.decoder
    assert (d.linear_layers, d.attention_layers, d.linear_k_heads, d.linear_v_heads, d.conv_kernel) == (24, 8, 16, 32, 4)
    assert d.attn_output_gate and not d.moe_layers and hybrid.counts.expert_weights == 0
    # control: a dense Qwen3-VL has neither (its conv-free layers hold no 3-D expert tensors)
    dense = model_facts(shape_config("qwen3_vl_8b"), freeze_vision_tower=True, freeze_merger=False).decoder
    assert (dense.moe_layers, dense.linear_layers, dense.attn_output_gate) == (0, 0, False)


# The public config.json values of the four shapes past 10B (text_config / vision_config fields), as the sources
# named in mmrlhf/models/shapes.py give them: Qwen/Qwen2.5-VL-32B-Instruct (its hub file's text fields and vision
# hidden / out / intermediate sizes), Qwen/Qwen2.5-VL-72B-Instruct (the hub's AWQ copy's vision side and
# _name_or_path; Qwen2.5-72B's decoder), Qwen/Qwen3-VL-32B-Instruct (two public copies of its config.json) and
# Qwen/Qwen3.5-27B (a public full Qwen3_5Config of it, slime's model arguments).
PUBLIC_CONFIGS = {
    "qwen2_5_vl_32b": (
        dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
        dict(depth=32, hidden_size=1280, intermediate_size=3456, num_heads=16, out_hidden_size=5120, patch_size=14,
             spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])),
    "qwen2_5_vl_72b": (
        dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
        dict(depth=32, hidden_size=1280, intermediate_size=3456, num_heads=16, out_hidden_size=8192, patch_size=14,
             spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])),
    "qwen3_vl_32b": (
        dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120, patch_size=16,
             spatial_merge_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])),
    "qwen3_5_27b": (
        dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
             num_key_value_heads=4, head_dim=256, vocab_size=248320, tie_word_embeddings=False,
             linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120, patch_size=16,
             spatial_merge_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[])),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_the_large_shapes_hold_their_public_config_values(name):
    text, vision = PUBLIC_CONFIGS[name]
    cfg = shape_config(name)  # the transformers config built from the shape: what the plan counts
    t, v = cfg.get_text_config(), cfg.vision_config
    assert {k: getattr(t, k) for k in text} == text
    assert {k: getattr(v, k) for k in vision} == vision


def test_the_large_shapes_have_the_published_sizes():
    """Counted from the meta model: Qwen2.5-VL-32B exactly as a public count of a fine-tune of it (the same tensors:
    33,452,718,336; the hub lists 33.5 B), Qwen2.5-VL-72B at the hub's 73.4 B with the Qwen2.5-72B card's 72.7 B of
    language model, Qwen3-VL-32B with the Qwen3-32B card's 32.8 B of language model and the 8B's tower, Qwen3.5-27B
    at its card's 27 B (a 54 GB bf16 checkpoint; its multi-token-prediction layer is not in the transformers
    model)."""
    def counts(name):
        return model_facts(shape_config(name), freeze_vision_tower=True, freeze_merger=False).counts

    c32 = counts("qwen2_5_vl_32b")
    assert c32.total == 33_452_718_336
    c72 = counts("qwen2_5_vl_72b")
    assert c72.total / 1e9 == pytest.approx(73.4, rel=0.002) and c72.language / 1e9 == pytest.approx(72.7, abs=0.05)
    assert c72.vision_tower == c32.vision_tower  # one tower, merged into 8,192 instead of 5,120
    q3 = counts("qwen3_vl_32b")
    assert q3.language / 1e9 == pytest.approx(32.8, rel=0.005)
    assert q3.vision_tower == counts("qwen3_vl_8b").vision_tower  # the 8B's 27 blocks of 1,152
    assert q3.total / 1e9 == pytest.approx(33.4, rel=0.005)
    q35 = counts("qwen3_5_27b")
    assert q35.total / 1e9 == pytest.approx(27.0, rel=0.03)
    assert q35.vision_tower == counts("qwen3_5_9b").vision_tower
