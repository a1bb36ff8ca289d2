"""The memory plan's activation formula (``mmrlhf.models.memory.activations``) against what autograd really saves.

Measured with ``torch.autograd.graph.saved_tensors_hooks`` during an ActorVL forward (each storage once, the
parameters themselves excluded, autocast's weight copies included), in the three ways the trainer stores a model:

* ``float32``: parameters and compute in float32;
* ``autocast``: float32 parameters, bf16 compute under torch.autocast (one process, a Ray trainer actor);
* ``bf16``: parameters in bf16 (what FSDP2's mixed precision gathers for the forward under torchrun).

The formula must be within 15% of the measurement (it is within 1% for the decoder); the controls show the test
can fail: the formula without its MLP term, or with the wrong precision rule, is off by more.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.models.memory import activations as act
from mmrlhf.models.memory.activations import MicroBatch, activation_plan, numerics
from mmrlhf.models.memory.counts import model_facts
from mmrlhf.testing.memory_check import image_batch, packed_batch, saved_bytes, text_batch
from mmrlhf.testing.tiny_models import tiny_model_dir

TOLERANCE = 0.15
MODES = ("float32", "autocast", "bf16")
VOCAB = 1024


def _random_qwen2_vl(layers: int = 3) -> Qwen2VLForConditionalGeneration:
    """hidden 256, 4 query heads over 2 KV heads (GQA), SwiGLU of 688: token counts differ from every dimension."""
    text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, embed_dim=64, hidden_size=256, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
                        vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).eval()


def _random_qwen3_vl_moe(layers: int = 2) -> torch.nn.Module:
    """Qwen3-VL-MoE with experts that outweigh the rest: 8 experts of 512 per layer, 2 routed per token."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, moe_intermediate_size=512, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12],
                                 "mrope_interleaved": True}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[])
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 1,
                           video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4)
    torch.manual_seed(0)
    return Qwen3VLMoeForConditionalGeneration(cfg).eval()


def _actor(model, mode: str, adapter=None) -> ActorVL:
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    return ActorVL(model, adapter, compute_dtype=torch.bfloat16 if mode == "autocast" else None)


def _numerics(mode: str) -> act.Numerics:
    return numerics(4 if mode == "float32" else 2, 4, sharded=mode == "bf16")


def _layouts():
    # (name, batch, the plan's view of it): padded without padding (no mask: SDPA's causal path, GQA kept),
    # padded with padding (mask: k / v repeated to every head, a mask copy per layer), packed (block mask)
    return [
        ("padded", text_batch(VOCAB, 2, 300, 150), MicroBatch(2, 300, 300, 0, mask=False)),
        ("padded_masked", text_batch(VOCAB, 2, 300, 150, pad=20), MicroBatch(2, 300, 300, 0, mask=True)),
        ("packed", packed_batch(VOCAB, [300, 300], [150, 150]), MicroBatch(1, 600, 300, 0, mask=True)),
    ]


def _measure_and_plan(mode: str, layout: int):
    model = _random_qwen2_vl()
    model.model.visual.requires_grad_(False)
    facts = model_facts(model.config, freeze_vision_tower=True, freeze_merger=True)
    actor = _actor(model, mode)
    name, batch, mb = _layouts()[layout]
    measured = saved_bytes(actor.model, lambda: actor(batch))
    return facts, mb, measured


@pytest.mark.parametrize("layout", [0, 1, 2], ids=["padded", "padded_masked", "packed"])
@pytest.mark.parametrize("mode", MODES)
def test_decoder_saved_bytes_match_the_formula(mode, layout):
    facts, mb, measured = _measure_and_plan(mode, layout)
    plan = activation_plan(facts, _numerics(mode), mb, checkpointing=False, chunk=1024)
    assert plan.saved == pytest.approx(measured, rel=TOLERANCE)


def test_controls_a_formula_missing_a_term_or_the_precision_rule_is_off():
    facts, mb, measured = _measure_and_plan("autocast", 1)
    n = _numerics("autocast")
    full = activation_plan(facts, n, mb, checkpointing=False, chunk=1024).saved
    assert full == pytest.approx(measured, rel=TOLERANCE)
    # without the MLP's four [T, I] tensors
    mlp = act.decoder_layer_bytes(facts, n, mb)["mlp"] * facts.decoder.layers
    assert abs(full - mlp - measured) > TOLERANCE * measured
    # autocast's per-consumer casts and weight copies ignored (the bf16-parameter rule applied to autocast)
    wrong = activation_plan(facts, _numerics("bf16"), mb, checkpointing=False, chunk=1024).saved
    assert abs(wrong - measured) > TOLERANCE * measured


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tower_trains", [False, True], ids=["tower_frozen", "tower_trains"])
def test_with_an_image_per_sample_the_vision_side_is_counted(family, mode, tower_trains):
    path = tiny_model_dir(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    adapter = get_adapter(path)
    from mmrlhf.trainer.optim import freeze_vision

    freeze_vision(model, adapter, tower=not tower_trains, merger=False)
    facts = model_facts(model.config, freeze_vision_tower=not tower_trains, freeze_merger=False)
    batch, patches = image_batch(adapter, model.config.get_text_config().vocab_size, 2, 200, 100, (1, 8, 8))
    actor = _actor(model, mode, adapter)
    measured = saved_bytes(actor.model, lambda: actor(batch))
    mb = MicroBatch(2, 200, 200, patches, mask=False)
    plan = activation_plan(facts, _numerics(mode), mb, checkpointing=False, chunk=1024)
    assert plan.saved == pytest.approx(measured, rel=TOLERANCE)
    assert plan.vision > 0  # the merger trains: its inputs are saved
    no_vision = dataclasses.replace(mb, vision_patches=0)
    assert activation_plan(facts, _numerics(mode), no_vision, checkpointing=False, chunk=1024).vision == 0


def test_checkpointing_keeps_layer_inputs_and_recomputes_one_layer():
    model = _random_qwen2_vl()
    facts = model_facts(model.config, freeze_vision_tower=True, freeze_merger=True)
    mb = MicroBatch(2, 300, 300, 0, mask=True)
    n = _numerics("autocast")
    full = activation_plan(facts, n, mb, checkpointing=False, chunk=1024)
    ckpt = activation_plan(facts, n, mb, checkpointing=True, chunk=1024)
    d = facts.decoder
    assert ckpt.layers == d.layers * mb.tokens * n.residual * d.hidden
    assert ckpt.recompute >= full.layers // d.layers  # one layer's saved set (and its weight copies) at a time
    assert ckpt.weight_copies < full.weight_copies  # only the lm_head's copy stays for the whole backward
    assert ckpt.total < full.total


@pytest.mark.parametrize("mode", MODES)
def test_routed_experts_save_per_chosen_expert_and_autocast_copies_every_expert(mode):
    """A MoE decoder: the experts' saved tensors per token and chosen expert, and under autocast the cast copies of
    every expert's weights (within 3% here; 0.1% in float32 and bf16). Control: the dense MLP's formula in their
    place is off by more than the suite's tolerance."""
    model = _random_qwen3_vl_moe()
    model.model.visual.requires_grad_(False)
    facts = model_facts(model.config, freeze_vision_tower=True, freeze_merger=True)
    d, c = facts.decoder, facts.counts
    assert (d.moe_layers, d.experts, d.top_k, d.moe_intermediate) == (2, 8, 2, 512)
    assert c.expert_weights == 2 * 8 * 3 * 512 * 256  # gate_up [E, 2I, h] and down [E, h, I] per layer
    actor = _actor(model, mode)
    batch, mb = text_batch(VOCAB, 2, 300, 150), MicroBatch(2, 300, 300, 0, mask=False)
    measured = saved_bytes(actor.model, lambda: actor(batch))
    plan = activation_plan(facts, _numerics(mode), mb, checkpointing=False, chunk=1024)
    assert plan.saved == pytest.approx(measured, rel=0.03)
    dense = dataclasses.replace(facts, decoder=dataclasses.replace(d, moe_layers=0),
                                counts=dataclasses.replace(c, expert_weights=0))
    wrong = activation_plan(dense, _numerics(mode), mb, checkpointing=False, chunk=1024).saved
    assert abs(wrong - measured) > TOLERANCE * measured
