"""Named model shapes: the dimensions of released Qwen-VL checkpoints as transformers configs, so a benchmark or a
memory plan can build or count a real-size model without downloading it (random weights, ``from_config``).

Values are the released ``config.json`` files' (text and vision dimensions, vocabulary, tied embeddings). Token ids
are the family's; nothing here is used to load weights.
"""

from __future__ import annotations

from typing import Any

# Shared by the Qwen2 / Qwen2.5 tokenizers.
_QWEN2_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                  vision_end_token_id=151653, bos_token_id=151643, eos_token_id=151645)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl_7b": dict(
        model_type="qwen2_5_vl", **_QWEN2_IDS,
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=128000, tie_word_embeddings=False,
                  rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")),
    "qwen2_5_vl_3b": dict(
        model_type="qwen2_5_vl", **_QWEN2_IDS,
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=128000, tie_word_embeddings=True,
                  rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")),
}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def shape_config(name: str, *, small: bool = False) -> Any:
    """A transformers config of shape ``name``; ``small`` keeps the family, vocabulary and vision layout but
    shrinks every width and depth (a CPU smoke run of the same code)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(shape_names())}")
    spec = dict(SHAPES[name])
    text, vision = dict(spec.pop("text")), dict(spec.pop("vision"))
    if small:
        text.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=8192, rope_scaling={"type": "mrope",
                                                                          "mrope_section": [8, 12, 12]})
        vision.update(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
                      fullatt_block_indexes=[1])
        spec.update(image_token_id=8100, video_token_id=8101, vision_start_token_id=8102, vision_end_token_id=8103,
                    bos_token_id=8104, eos_token_id=8105)
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **spec)
