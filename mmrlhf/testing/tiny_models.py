"""Offline, deterministic tiny Qwen-VL models for tests, demos and benchmarks.

``tiny_model_dir(family, size, seed)`` returns a saved model directory (config, safetensors weights, tokenizer,
processor with image + video support, chat template) that loads in transformers and in vLLM, built without any
network access. Directories are cached under ``$MMRLHF_CACHE_DIR/tiny-models`` (default ``~/.cache/mmrlhf``),
keyed by family, size, seed, variant and a hash of the factory's files (``tiny_*.py``), so the suite builds each model once per machine and
a change to the factory invalidates old builds.

Variants (keywords of ``tiny_model_dir`` / ``build_tiny_model``):
- ``tied=True``: the lm_head shares the input embedding (``tie_word_embeddings``), as Qwen2-VL-2B and
  Qwen2.5-VL-3B do; the checkpoint then stores no ``lm_head.weight`` and ``named_parameters()`` does not list it;
- ``released_generation_config=True``: ``generation_config.json`` carries the sampling defaults released
  Qwen2.5-VL Instruct checkpoints ship (:data:`RELEASED_GENERATION_DEFAULTS`), which a rollout engine must not
  apply (the trainer never scores them);
- ``tools=True``: a tool-calling tokenizer and template (agent tests and the zoom toy task): Qwen's hermes tags
  ``<tool_call>`` / ``</tool_call>`` / ``<tool_response>`` / ``</tool_response>`` as added (non-special) tokens, as
  in the released Qwen tokenizers, two calls' JSON (:data:`TOY_CALLS`, a call is then three tokens: tag, call,
  tag) and the zoom toy task's whole call (:data:`TOY_CALL_TOKEN`) as single added tokens (so a tiny random policy
  finds a call at all), and :data:`TOOLS_TEMPLATE`,
  which renders ``tools=`` into a short system turn and tool turns (images included) in the hermes form that
  :mod:`mmrlhf.agents.template` writes incrementally;
- ``tools=True`` with ``tool_calls=[...]`` / ``tool_names=[...]``: also the user's own tools' whole calls as single
  added tokens (:mod:`mmrlhf.testing.tiny_tool_calls`), so a toy task of one's own tool can run on a tiny model as
  the zoom task does; cached under a name that carries the tools' names and a hash of the calls, so the plain tool
  variant keeps its name (``python -m mmrlhf.testing.tiny_models --help``);
- ``linear_head_dim=64`` (hybrid families): the linear-attention layers' key and value head size (32 by default);
  vLLM's bf16 CPU kernels for those layers take 64 or more (they refuse 32: "Unexpected head dim size").

Why these settings:
- text ``head_dim`` is 64: vLLM's CPU attention rejects small head sizes (16 fails, 64 works);
- ``mrope_section`` sums to ``head_dim / 2`` (the three M-RoPE axes share the rotary half-dimension);
- the tokenizer is a byte-level BPE trained on a small built-in corpus, so every string encodes, common words
  (colours, digits, answer/think tags) are single tokens, and the Qwen special tokens are present;
- token ids (eos / pad / bos, image / video / vision-start) are set in BOTH the top config and ``text_config``,
  because transformers and vLLM read them from different places;
- the image processor's pixel bounds keep images small (a 56x56 image is 4 merged tokens) so tests stay fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from mmrlhf.testing.tiny_templates import CHAT_TEMPLATE, TOOLS_TEMPLATE, chat_template
from mmrlhf.testing.tiny_tool_calls import user_call_tokens, variant_suffix
from mmrlhf.trainer.progress import no_library_bars

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
SIZES = ("tiny", "small")
Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"]
# Families of the Qwen3 vision tower (16-pixel patches, learned position embeddings, mean = std = 0.5 inputs) and
# of the Qwen3.5 hybrid decoder (Gated DeltaNet linear attention interleaved with gated full attention).
QWEN3_VISION = ("qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
HYBRID = ("qwen3_5", "qwen3_5_moe")
MOE = ("qwen3_5_moe", "qwen3_vl_moe")
Size = Literal["tiny", "small"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The tool variant (``tools=True``): Qwen's tool-call tags and the zoom toy task's calls, each one added token.
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOY_CALLS = [
    '{"name": "image_zoom", "arguments": {"bbox_2d": [0, 0, 500, 500]}}',
    '{"name": "image_zoom", "arguments": {"bbox_2d": [500, 500, 1000, 1000]}}',
]
# The zoom toy task's whole call, tags included, as ONE added token: a random policy over the task's few tokens
# then finds the tool in one sample of six at first. Its text is an ordinary hermes call (the parser reads it as
# any other); the engine stops after it through the ``</tool_call>`` stop string. Its box differs from
# TOY_CALLS', so a template render of those calls never merges into this token.
TOY_CALL_TOKEN = '<tool_call>{"name": "image_zoom", "arguments": {"bbox_2d": [250, 250, 750, 750]}}</tool_call>'

# Words that should be single tokens (toy tasks answer with them).
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "cyan", "pink", "brown", "gray"]
_WORDS = (
    COLOURS
    + "zero one two three four five six seven eight nine ten yes no true false left right up down".split()
    + "what which how many is are the a an of in on to and or color colour square circle shape image video".split()
    + "picture frame answer think question describe count number object objects there this that with".split()
    + "user assistant system you please word one-word answer: first second third box boxed final".split()
)
_SENTENCES = [
    "What color is the square? Answer with one word.",
    "How many objects are in the image? Answer with a number.",
    "Describe the picture in one sentence.",
    "What happens in the video? Answer briefly.",
    "<think>I look at the image first.</think><answer>red</answer>",
    "The final answer is \\boxed{42}.",
    "Question: which shape is on the left? Options: A. circle B. square C. triangle D. star",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ( ) [ ] { } . , : ; ! ? ' \"",
]

@dataclass(frozen=True)
class _Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vision_dim: int
    vision_depth: int
    vision_heads: int
    vocab: int


# head_dim = hidden / heads = 64 in both sizes (vLLM CPU attention); vision head_dim = 32.
_DIMS = {
    "tiny": _Dims(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256,
                  vision_dim=64, vision_depth=2, vision_heads=2, vocab=640),
    "small": _Dims(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536,
                   vision_dim=256, vision_depth=4, vision_heads=8, vocab=4096),
}



# Sampling defaults of the kind released Qwen2-VL / Qwen2.5-VL Instruct checkpoints put in generation_config.json
# (repetition penalty 1.05; top_k 1 makes plain ``model.generate(do_sample=True)`` greedy).
RELEASED_GENERATION_DEFAULTS = {"repetition_penalty": 1.05, "temperature": 0.1, "top_k": 1, "top_p": 0.001}


def _factory_hash() -> str:
    """The bytes of this file and of the factory's other modules (``tiny_*.py`` here: templates, call tokens): a
    change to any of them builds anew."""
    here = Path(__file__)
    parts = sorted(here.parent.glob("tiny_*.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()[:12]


def cache_root() -> Path:
    base = os.environ.get("MMRLHF_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mmrlhf")
    return Path(base) / "tiny-models"


def tiny_model_dir(family: Family = "qwen2_vl", size: Size = "tiny", seed: int = 0, *, tied: bool = False,
                   released_generation_config: bool = False, tools: bool = False,
                   tool_calls: Sequence[str | Mapping[str, Any]] = (), tool_names: Sequence[str] = (),
                   linear_head_dim: int | None = None) -> Path:
    """Path of a built tiny model (built on first use, then reused from the cache); variants: module docstring.
    ``tool_calls`` (``{"name": ..., "arguments": {...}}``, or its JSON text) and ``tool_names`` (one call without
    arguments each) need ``tools=True``; :func:`~mmrlhf.testing.tiny_tool_calls.call_token` gives a call's token.

    Safe under concurrent callers: each builds in a private temporary folder and renames it into place; the loser
    of a race discards its copy.
    """
    _check(family, size)
    extra = _extra_calls(tools, tool_calls, tool_names)
    variant = ("-tied" if tied else "") + ("-relgen" if released_generation_config else "") + ("-tools" if tools else "")
    variant += variant_suffix(extra) + (f"-lhd{linear_head_dim}" if linear_head_dim is not None else "")
    target = cache_root() / f"{family}-{size}-seed{seed}{variant}-{_factory_hash()}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_tiny_model(tmp, family=family, size=size, seed=seed, tied=tied,
                         released_generation_config=released_generation_config, tools=tools,
                         tool_calls=tool_calls, tool_names=tool_names, linear_head_dim=linear_head_dim)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check(family: str, size: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny-model family {family!r}; valid: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown tiny-model size {size!r}; valid: {', '.join(SIZES)}")


def _extra_calls(tools: bool, tool_calls: Sequence[str | Mapping[str, Any]], tool_names: Sequence[str]) -> list[str]:
    """The user's call tokens; refused without ``tools=True`` (the plain template has no tool turns)."""
    extra = user_call_tokens(tool_calls, tool_names)
    if extra and not tools:
        raise ValueError("tool_calls / tool_names need tools=True (the tool-calling tokenizer and template)")
    return extra


def build_tiny_model(out_dir: str | Path, family: Family = "qwen2_vl", size: Size = "tiny", seed: int = 0, *,
                     tied: bool = False, released_generation_config: bool = False, tools: bool = False,
                     tool_calls: Sequence[str | Mapping[str, Any]] = (), tool_names: Sequence[str] = (),
                     linear_head_dim: int | None = None) -> Path:
    """Build a model directory at ``out_dir`` (created if needed). Same arguments -> identical files."""
    import torch

    _check(family, size)
    extra = _extra_calls(tools, tool_calls, tool_names)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dims = _DIMS[size]
    tokenizer = _build_tokenizer(dims.vocab, tools=tools, extra_calls=extra, template=chat_template(tools=tools, thinking=family in HYBRID))
    processor = _build_processor(family, tokenizer, chat_template(tools=tools, thinking=family in HYBRID))
    if linear_head_dim is not None and family not in HYBRID:
        raise ValueError(f"linear_head_dim is for families with linear-attention layers ({', '.join(HYBRID)}), "
                         f"not {family!r}")
    config = _build_config(family, dims, tokenizer, tied=tied, linear_head_dim=linear_head_dim)

    model_cls = _model_class(family)
    # Deterministic init: seed the global generator only for the duration of the build.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(torch.bfloat16).eval()
    with no_library_bars():  # the quick start's first command builds one: its bar is noise there
        model.save_pretrained(out, safe_serialization=True)
    if family == "qwen3_vl_moe":
        _store_experts_transposed(out)
    processor.save_pretrained(out)
    _write_generation_config(out, tokenizer, RELEASED_GENERATION_DEFAULTS if released_generation_config else {})
    meta = {"family": family, "size": size, "seed": seed, "tied": tied,
            "released_generation_config": released_generation_config, "tools": tools, "tool_calls": extra,
            "factory": _factory_hash()}
    (out / "mmrlhf_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _model_class(family: str):
    import transformers

    return {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
    }[family]


def _store_experts_transposed(out: Path) -> None:
    """Qwen3-VL-MoE checkpoints store the fused expert weights as ``gate_up_proj`` [E, hidden, 2 * inter] and
    ``down_proj`` [E, inter, hidden] (transformers transposes them on load; vLLM reads them so); transformers'
    ``save_pretrained`` writes its own in-memory layout back, which vLLM would misread."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})


def _build_tokenizer(vocab_size: int, *, tools: bool = False, extra_calls: Sequence[str] = (), template: str = ""):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Each word repeated (with and without a leading space) so BPE merges it into one token.
    corpus = []
    for word in _WORDS:
        corpus.extend([word, " " + word] * 8)
    corpus.extend(_SENTENCES * 4)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=32768,
        chat_template=template or (TOOLS_TEMPLATE if tools else CHAT_TEMPLATE),
        padding_side="left",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    )
    if tools:
        # Non-special, as in the released Qwen tokenizers: decoding with skip_special_tokens keeps them, so a turn's
        # text still shows its calls. Added after training, so the BPE merges (and every other token) are the plain
        # variant's.
        # The user's calls come last, so every id of the plain tool variant stays what it was (one that is already
        # there, the zoom call, is not added twice).
        known = set(TOOL_TAGS + TOY_CALLS + [TOY_CALL_TOKEN])
        fast.add_tokens(TOOL_TAGS + TOY_CALLS + [TOY_CALL_TOKEN] + [c for c in extra_calls if c not in known],
                        special_tokens=False)
    return fast


def _patch_size(family: str) -> int:
    return 16 if family in QWEN3_VISION else 14


def _build_processor(family: str, tokenizer, chat_template: str = CHAT_TEMPLATE):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # Pixel bounds scale with the patch: (patch * merge)^2 pixels make one LLM token.
    unit = (_patch_size(family) * 2) ** 2
    lo, hi, video_hi = 4 * unit, 64 * unit, 16 * unit
    patch = dict(patch_size=_patch_size(family), temporal_patch_size=2, merge_size=2)
    # Qwen3-VL normalises images and videos alike (mean = std = 0.5), as its released checkpoints do.
    norm = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]) if family in QWEN3_VISION else {}
    image_processor = Qwen2VLImageProcessor(
        min_pixels=lo, max_pixels=hi, size={"shortest_edge": lo, "longest_edge": hi}, **patch, **norm
    )
    if family in QWEN3_VISION:
        # The per-frame pixel cap chosen explicitly (today's default behaviour, off): a checkpoint that leaves it
        # unset makes transformers warn at the first video, which vLLM's start-up profiling always processes.
        video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": lo, "longest_edge": video_hi},
                                                do_sample_frames=False, cap_pixels_per_frame=False, **patch)
    else:
        video_processor = Qwen2VLVideoProcessor(
            min_pixels=lo, max_pixels=video_hi, size={"shortest_edge": lo, "longest_edge": video_hi},
            do_sample_frames=False, cap_pixels_per_frame=True, **patch,
        )
    # The Qwen3.5 and MoE checkpoints ship Qwen3-VL's processor class.
    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}.get(family, Qwen3VLProcessor)
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
               chat_template=chat_template)


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _build_config(family: str, dims: _Dims, tokenizer, *, tied: bool = False, linear_head_dim: int | None = None):
    import transformers

    ids = _token_ids(tokenizer)
    head_dim = dims.hidden // dims.heads
    half = head_dim // 2
    mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]  # (t, h, w) axes; sums to head_dim / 2
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        tie_word_embeddings=tied,
    )
    if family == "qwen2_vl":
        vision = dict(depth=dims.vision_depth, embed_dim=dims.vision_dim, hidden_size=dims.hidden,
                      num_heads=dims.vision_heads, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
        cfg_cls = transformers.Qwen2VLConfig
    elif family == "qwen2_5_vl":
        vision = dict(depth=dims.vision_depth, hidden_size=dims.vision_dim, out_hidden_size=dims.hidden,
                      intermediate_size=dims.vision_dim * 2, num_heads=dims.vision_heads, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[dims.vision_depth - 1], tokens_per_second=2)
        cfg_cls = transformers.Qwen2_5_VLConfig
    else:  # the Qwen3 vision tower: explicit head_dim, interleaved M-RoPE, learned position embeddings
        text["head_dim"] = head_dim
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = dict(depth=dims.vision_depth, hidden_size=dims.vision_dim, out_hidden_size=dims.hidden,
                      intermediate_size=dims.vision_dim * 2, num_heads=dims.vision_heads, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256)
        if family in ("qwen3_vl", "qwen3_vl_moe"):
            vision["deepstack_visual_indexes"] = [0]  # deepstack features from the first vision block
        if family in HYBRID:
            text.update(_hybrid_text(dims, head_dim, linear_head_dim or 32))
        if family in MOE:
            text.update(_moe_text(family, dims))
        cfg_cls = {"qwen3_vl": transformers.Qwen3VLConfig, "qwen3_5": transformers.Qwen3_5Config,
                   "qwen3_5_moe": transformers.Qwen3_5MoeConfig,
                   "qwen3_vl_moe": transformers.Qwen3VLMoeConfig}[family]
    top_ids = {k: v for k, v in ids.items()}
    # Set in both places: transformers and vLLM read the tie from different configs.
    config = cfg_cls(text_config=text, vision_config=vision, tie_word_embeddings=tied, **top_ids)
    return config


def _hybrid_text(dims: _Dims, head_dim: int, linear_head_dim: int = 32) -> dict[str, Any]:
    """Qwen3.5's decoder: Gated DeltaNet layers with every ``full_attention_interval``-th layer full attention
    (tiny: [linear, full]; small: three linear then one full, as released), a quarter of each head rotated
    (``partial_rotary_factor``, so the M-RoPE sections sum to ``head_dim / 8``), and more value than key heads in
    the linear layers (the released ratio is 2)."""
    rotary_half = head_dim // 8
    section = [rotary_half - 2 * (3 * rotary_half // 8), 3 * rotary_half // 8, 3 * rotary_half // 8]
    interval = 2 if dims.layers < 4 else 4
    return dict(
        layer_types=["linear_attention" if (i + 1) % interval else "full_attention" for i in range(dims.layers)],
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section,
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=dims.heads, linear_num_value_heads=2 * dims.heads,
    )


def _moe_text(family: str, dims: _Dims) -> dict[str, Any]:
    """A sparse MLP in every layer: several experts, top-k > 1 (so routing weights matter), and Qwen3.5-MoE's
    gated shared expert."""
    moe = dict(num_experts=4 if dims.layers < 4 else 8, num_experts_per_tok=2, moe_intermediate_size=dims.hidden // 4,
               router_aux_loss_coef=0.001)
    if family == "qwen3_5_moe":
        moe["shared_expert_intermediate_size"] = dims.hidden // 2
    else:  # the router renormalises its top-k weights (transformers always does; vLLM reads the flag)
        moe.update(decoder_sparse_step=1, norm_topk_prob=True)
    return moe


def _write_generation_config(out: Path, tokenizer, sampling_defaults: dict) -> None:
    ids = _token_ids(tokenizer)
    gen = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
           "pad_token_id": ids["pad_token_id"], "do_sample": True, **sampling_defaults}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmrlhf.testing.tiny_models [family] [size] [seed] [--tools] [--tool NAME] [--tool-call JSON]``:
    print a model dir (stdout, for ``$(...)``); with tools, each added call token on stderr, ready for
    ``rollout.allowed_tokens``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m mmrlhf.testing.tiny_models", description=main.__doc__)
    parser.add_argument("family", nargs="?", default="qwen2_vl", choices=FAMILIES)
    parser.add_argument("size", nargs="?", default="tiny", choices=SIZES)
    parser.add_argument("seed", nargs="?", default=0, type=int)
    parser.add_argument("--tools", action="store_true", help="the tool-calling tokenizer and template (zoom call)")
    parser.add_argument("--tool", action="append", default=[], metavar="NAME",
                        help="also NAME's call without arguments as one token (repeatable; implies --tools)")
    parser.add_argument("--tool-call", action="append", default=[], metavar="JSON",
                        help='also this call, {"name": ..., "arguments": {...}}, as one token (repeatable; implies '
                             "--tools)")
    args = parser.parse_args(argv)
    tools = args.tools or bool(args.tool or args.tool_call)
    try:
        path = tiny_model_dir(args.family, args.size, args.seed, tools=tools, tool_calls=args.tool_call,
                              tool_names=args.tool)
    except ValueError as exc:
        parser.error(str(exc))
    if tools:
        for token in [TOY_CALL_TOKEN, *user_call_tokens(args.tool_call, args.tool)]:
            print(f"call token: {token}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
