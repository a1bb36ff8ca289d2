"""Named model shapes: the released Qwen-VL checkpoints' dimensions as Hugging Face config dicts, no download.

Why: a user plans memory for a model they do not have on disk yet (``mmrlhf config show RECIPE --plan --shape
qwen2_5_vl_7b``), and a benchmark builds a random model of a real size (``benchmarks/bench_trainer.py --shape``).
Both read this one table, so a shape is written down once. This is the only place in the package that names model
sizes; everything else reads dimensions from a config object.

Each entry holds what ``config.json`` of the released ``*-Instruct`` checkpoint says about sizes (transformers
5.x layout: ``text_config`` / ``vision_config``); keys that do not change a parameter count or a tensor size
(initialisation, dropout, generation defaults) are left to transformers' defaults. The special-token ids are the
Qwen2 tokenizer's (shared by all three families). Sources: the ``config.json`` files of Qwen/Qwen2-VL-2B-Instruct,
Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-3B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct, Qwen/Qwen3-VL-2B-Instruct and
Qwen/Qwen3-VL-8B-Instruct on the Hugging Face hub, written down from them (no machine of this project reaches the
hub); the parameter totals they give are checked against the model cards' (8.29 B for Qwen2.5-VL-7B) in
``tests/models/test_memory_counts.py``. Qwen3-VL-30B-A3B-Instruct and Qwen3.5-9B were written down from copies of
their ``config.json`` in public repositories' test fixtures and training scripts, which agree with each other
(no copy of the hub's own file was reachable); Qwen3.5-9B's total is checked against a count of its checkpoint's
tensors (9.41 B without the multi-token-prediction layer). Qwen3.5-35B-A3B was written down from a public training
script's model arguments (layers, widths, heads, experts, linear-attention sizes); its vision tower is taken to be
the 9B's, merged into its 2,048 hidden size. Sizes only: Qwen3.5's bos / eos ids in ``text_config``
stay Qwen2's, which change no tensor.

The four shapes past 10B (Qwen2.5-VL-32B / 72B, Qwen3-VL-32B, Qwen3.5-27B) were written down from public copies of
their ``config.json`` (no copy of the hub's own file was reachable; each entry below names its sources, which agree
with each other), and ``tests/models/test_memory_counts.py`` checks them: the published sizes of the model cards
(33.5 B, 73.4 B, 33.4 B, 27 B) and, for Qwen2.5-VL-32B, the exact tensor count of a fine-tune of it.
"""

from __future__ import annotations

import copy
from typing import Any

# Qwen2 tokenizer ids (identical in the three families' tokenizers).
_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
              "vision_end_token_id": 151653}
_QWEN2_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]}
_QWEN3_ROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
               "mrope_interleaved": True}
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# Qwen3.5's tokenizer (a 248k vocabulary) has its own vision token ids
_QWEN3_5_TOKEN_IDS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                      "vision_end_token_id": 248054}


def _text(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
          rope: dict[str, Any], max_positions: int, **extra: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied,
                rope_parameters=dict(rope), max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                bos_token_id=151643, eos_token_id=151645, **extra)


# Qwen2-VL vision tower: a ViT of ``depth`` blocks at ``embed_dim`` (LayerNorm, fused qkv, GELU MLP of
# ``mlp_ratio`` x embed_dim), 14-pixel patches over 2 frames, a 2x2 merger into the language model's hidden size.
def _qwen2_vl_vision(out_hidden: int) -> dict[str, Any]:
    return dict(depth=32, embed_dim=1280, hidden_size=out_hidden, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu",
                in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)


# Qwen2.5-VL vision tower: RMSNorm, SwiGLU MLP of 3,420, window attention (112 px) except the full-attention
# blocks 7, 15, 23, 31; the merger maps to ``out_hidden_size``.
def _qwen2_5_vl_vision(out_hidden: int) -> dict[str, Any]:
    return dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, hidden_act="silu", in_channels=3,
                out_hidden_size=out_hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)


# Qwen3-VL vision tower (SigLIP-2 style): LayerNorm, GELU MLP, 16-pixel patches, learned position embeddings of
# 2,304 (48 x 48), deepstack mergers feeding three of its blocks' features into the decoder.
def _qwen3_vl_vision(depth: int, hidden: int, intermediate: int, out_hidden: int,
                     deepstack: list[int]) -> dict[str, Any]:
    return dict(depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=16,
                hidden_act="gelu_pytorch_tanh", in_channels=3, out_hidden_size=out_hidden, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                deepstack_visual_indexes=deepstack)


# name -> {"model_type", "text_config", "vision_config", "tie_word_embeddings"} (+ the token ids, added below).
# Vocabularies: the 7B Qwen2 / Qwen2.5 models pad theirs to 152,064 rows, the smaller ones and every Qwen3-VL to
# 151,936 (both above the tokenizer's 151,665 tokens).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2_vl_2b": dict(
        model_type="qwen2_vl", tie_word_embeddings=True,
        text_config=_text(1536, 8960, 28, 12, 2, 151_936, True, _QWEN2_ROPE, 32_768),
        vision_config=_qwen2_vl_vision(1536)),
    "qwen2_vl_7b": dict(
        model_type="qwen2_vl", tie_word_embeddings=False,
        text_config=_text(3584, 18944, 28, 28, 4, 152_064, False, _QWEN2_ROPE, 32_768),
        vision_config=_qwen2_vl_vision(3584)),
    "qwen2_5_vl_3b": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=True,
        text_config=_text(2048, 11008, 36, 16, 2, 151_936, True, _QWEN2_ROPE, 128_000),
        vision_config=_qwen2_5_vl_vision(2048)),
    "qwen2_5_vl_7b": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=False,
        text_config=_text(3584, 18944, 28, 28, 4, 152_064, False, _QWEN2_ROPE, 128_000),
        vision_config=_qwen2_5_vl_vision(3584)),
    "qwen3_vl_2b": dict(
        model_type="qwen3_vl", tie_word_embeddings=True,
        text_config=_text(2048, 6144, 28, 16, 8, 151_936, True, _QWEN3_ROPE, 262_144, head_dim=128,
                          attention_bias=False),
        vision_config=_qwen3_vl_vision(24, 1024, 4096, 2048, [5, 11, 17])),
    "qwen3_vl_8b": dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=_text(4096, 12288, 36, 32, 8, 151_936, False, _QWEN3_ROPE, 262_144, head_dim=128,
                          attention_bias=False),
        vision_config=_qwen3_vl_vision(27, 1152, 4304, 4096, [8, 16, 24])),
    # Qwen3-VL-30B-A3B: 48 MoE decoder layers (128 experts of 768, 8 routed per token, every layer sparse), the 8B's
    # vision tower into a 2,048 hidden size
    "qwen3_vl_30b_a3b": dict(
        model_type="qwen3_vl_moe", tie_word_embeddings=False,
        text_config=_text(2048, 6144, 48, 32, 4, 151_936, False, _QWEN3_ROPE, 262_144, head_dim=128,
                          attention_bias=False, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        vision_config=_qwen3_vl_vision(27, 1152, 4304, 2048, [8, 16, 24])),
    # Qwen3.5-9B: 32 decoder layers, three Gated DeltaNet (linear attention) layers to one gated full-attention layer
    # (head_dim 256, a quarter of it rotary), the Qwen3-VL tower without deepstack; its own tokenizer's ids. The
    # checkpoint's multi-token-prediction layer is not part of the transformers model (nor of training here).
    "qwen3_5_9b": dict(
        model_type="qwen3_5", tie_word_embeddings=False, **_QWEN3_5_TOKEN_IDS,
        text_config=_text(4096, 12288, 32, 16, 4, 248_320, False, _QWEN3_5_ROPE, 262_144, head_dim=256,
                          attention_bias=False, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
                          linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_num_key_heads=16, linear_num_value_heads=32),
        vision_config=_qwen3_vl_vision(27, 1152, 4304, 4096, [])),
    # Qwen3.5-35B-A3B: 40 decoder layers in the 9B's 3:1 pattern at a 2,048 hidden size, every layer's MLP routed
    # (256 experts of 512, 8 per token, plus a gated shared expert of 512), 16 query / 2 key-value heads of 256
    "qwen3_5_35b_a3b": dict(
        model_type="qwen3_5_moe", tie_word_embeddings=False, **_QWEN3_5_TOKEN_IDS,
        text_config=_text(2048, 512, 40, 16, 2, 248_320, False, _QWEN3_5_ROPE, 262_144, head_dim=256,
                          attention_bias=False, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
                          linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
                          num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
        vision_config=_qwen3_vl_vision(27, 1152, 4304, 2048, [])),
    # Qwen2.5-VL-32B-Instruct: the Qwen2.5-32B decoder (64 layers of 5,120, 40 query / 8 key-value heads, SwiGLU of
    # 27,648, untied 152,064-row vocabulary) under the 7B's tower with a SwiGLU of 3,456 (not the 3B / 7B's 3,420),
    # merged into 5,120. Text sizes: a copy of the hub file's text fields ("fetched from huggingface.co/Qwen/
    # Qwen2.5-VL-32B-Instruct/raw/main/config.json") in a public 32B-readiness module, with vision hidden 1,280,
    # out_hidden_size 5,120 and intermediate_size 3,456 from the same fetch; the tower's 3,456 is confirmed by a
    # public count of a Qwen2.5-VL-32B fine-tune's tensors, 33,452,718,336 (checked in the test), and by the 72B's.
    "qwen2_5_vl_32b": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=False,
        text_config=_text(5120, 27648, 64, 40, 8, 152_064, False, _QWEN2_ROPE, 128_000),
        vision_config={**_qwen2_5_vl_vision(5120), "intermediate_size": 3456}),
    # Qwen2.5-VL-72B-Instruct: the Qwen2.5-72B decoder (80 layers of 8,192, 64 / 8 heads, SwiGLU of 29,568, untied
    # 152,064 rows) under the same tower (SwiGLU 3,456) merged into 8,192. Sources: the hub's Qwen/Qwen2.5-VL-72B-
    # Instruct-AWQ config.json (``_name_or_path`` Qwen/Qwen2.5-VL-72B-Instruct; its vision side is not quantised,
    # so its 1,280 / 3,456 / out 8,192 are the original's; its text intermediate 29,696 is AWQ's padding of 29,568),
    # and public model tables of Qwen2.5-VL-72B-Instruct / Qwen2.5-72B (8,192, 29,568, 80, 64 / 8, 152,064).
    "qwen2_5_vl_72b": dict(
        model_type="qwen2_5_vl", tie_word_embeddings=False,
        text_config=_text(8192, 29568, 80, 64, 8, 152_064, False, _QWEN2_ROPE, 128_000),
        vision_config={**_qwen2_5_vl_vision(8192), "intermediate_size": 3456}),
    # Qwen3-VL-32B-Instruct: the Qwen3-32B decoder (64 layers of 5,120, 64 query heads of 128 over 8 key-value heads,
    # SwiGLU of 25,600, untied 151,936 rows) under the 8B's tower (27 blocks of 1,152, deepstack at 8 / 16 / 24)
    # merged into 5,120. Sources: public copies of its config.json (a shipped-config test of a Qwen3-VL-32B text
    # encoder, and a checkpoint check of the same encoder's text_encoder/config.json), agreeing field by field.
    "qwen3_vl_32b": dict(
        model_type="qwen3_vl", tie_word_embeddings=False,
        text_config=_text(5120, 25600, 64, 64, 8, 151_936, False, _QWEN3_ROPE, 262_144, head_dim=128,
                          attention_bias=False),
        vision_config=_qwen3_vl_vision(27, 1152, 4304, 5120, [8, 16, 24])),
    # Qwen3.5-27B: 64 decoder layers in the 9B's 3:1 linear : full attention pattern at 5,120 (24 query / 4
    # key-value heads of 256 with an output gate, a quarter rotary; Gated DeltaNet with 16 key / 48 value heads of
    # 128), a dense SwiGLU of 17,408, untied 248,320 rows; the 9B's tower merged into 5,120. Sources: a public full
    # Qwen3_5Config of the 27B (text and vision), slime's scripts/models/qwen3.5-27B.sh (layers, widths, heads, FFN,
    # vocabulary, untied) and public checks of Qwen3.6 / 3.8-27B configs (the same architecture and sizes). The
    # checkpoint's multi-token-prediction layer is not part of the transformers model.
    "qwen3_5_27b": dict(
        model_type="qwen3_5", tie_word_embeddings=False, **_QWEN3_5_TOKEN_IDS,
        text_config=_text(5120, 17408, 64, 24, 4, 248_320, False, _QWEN3_5_ROPE, 262_144, head_dim=256,
                          attention_bias=False, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                          linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_num_key_heads=16, linear_num_value_heads=48),
        vision_config=_qwen3_vl_vision(27, 1152, 4304, 5120, [])),
}


def shape_names() -> list[str]:
    """The known shape names, sorted."""
    return sorted(SHAPES)


def shape_dict(name: str) -> dict[str, Any]:
    """A deep copy of shape ``name``'s config dict (token ids included); unknown names list the valid ones."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; valid: {', '.join(shape_names())}")
    return {**_TOKEN_IDS, **copy.deepcopy(SHAPES[name])}  # a shape's own token ids win


def shape_config(name: str, *, text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None) -> Any:
    """A transformers config object of shape ``name`` (``AutoConfig.for_model``; nothing is downloaded).

    ``text`` / ``vision``: keys overriding the shape's text / vision config, e.g. a benchmark's
    ``text={"num_hidden_layers": 2}`` for a real-width model of fewer layers."""
    from transformers import AutoConfig

    data = shape_dict(name)
    data["text_config"].update(text or {})
    data["vision_config"].update(vision or {})
    if "tie_word_embeddings" in (text or {}):  # the tie is read from the top config and the text config
        data["tie_word_embeddings"] = text["tie_word_embeddings"]
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)
