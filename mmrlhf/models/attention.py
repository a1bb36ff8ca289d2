"""Attention for the packed and shared-prompt (grouped) rows: which kernel runs them, and the mask it reads.

Both layouts put several sequences into one row and let the mask keep them apart: a packed row is a
block-diagonal causal pattern (each sample sees itself), a grouped row is "prompt + its own response". Handed to
SDPA as a dense ``[rows, 1, L, L]`` mask, the kernel computes every query x key tile and throws most of them away,
and the fast (flash) SDPA kernels do not take an arbitrary mask at all: measured at Qwen2.5-VL-7B shape on an
H200, the packed row of a GRPO group took 2.64 ms per layer against 1.60 ms for the padded batch it replaces,
so packing saved tokens and no time.

``flex`` runs these rows through PyTorch's FlexAttention with a :class:`BlockMask`: tiles of 128 x 128 that the
mask hides entirely are skipped, tiles it shows entirely run without any mask arithmetic, and only the tiles on a
boundary evaluate the mask per element (:func:`block_mask`). ``dense`` is today's path (an additive mask for
``sdpa`` / ``eager``, transformers' own packed handling): the CPU path and the reference every test compares with.
:func:`resolve_masked_attention` is the one place that decides, from ``model.masked_attention``, the device and
torch: ``auto`` is ``flex`` on CUDA, ``dense`` elsewhere (FlexAttention's forward runs on the CPU, eagerly, but
its backward has no CPU kernel in torch 2.14, so the CPU trains on the dense path).

How the kernel reaches the model: transformers looks the attention function up by the decoder config's
``_attn_implementation`` in every layer. :func:`install` registers, once per base kernel, a function under
``block_sparse_<base>`` that runs FlexAttention when the layer receives a :class:`BlockMask` and the base kernel
(``sdpa``, ``flash_attention_2``, ...) with everything else, with the base kernel's mask builder, and points the
decoder config at it. So the padded layout and generation with a KV cache run the base kernel, and a model keeps
one attention function for its whole life: a checkpointed layer recomputed in the backward runs the same kernel
as its forward did.

The vision tower has the same problem in another form: its images, video frames and (Qwen2.5-VL) windows each
attend within themselves, and with SDPA transformers runs one call per segment, a host-bound loop of ~1,800 tiny
calls per micro-batch at 7B shape (four 448 px images). ``install`` points the vision config at a varlen function
that runs all segments in one FlexAttention call with a non-causal block mask (:data:`VISION_NAME`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

PROMPT, PADDING = 0, -1  # segment ids shared with mmrlhf.models.batch (grouped rows)
BLOCK = 128  # FlexAttention's tile (queries x keys)
SETTINGS = ("auto", "dense", "flex")
# Base kernels the block-sparse function can fall back to for other masks (eager is each model's own function,
# not in transformers' registry: it stays dense).
FLEX_BASES = ("sdpa", "flash_attention_2", "flash_attention_3")
_NAME = "block_sparse_"
COMPILED_FLEX = ("cuda",)  # device types where torch.compile builds a FlexAttention kernel (Triton)


def flex_supported() -> bool:
    """FlexAttention with ``BlockMask.from_kv_blocks`` and GQA is importable (torch >= 2.5)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def resolve_masked_attention(setting: str, device: torch.device | str, base: str) -> str:
    """``model.masked_attention`` -> ``"flex"`` or ``"dense"`` for a model on ``device`` whose decoder runs
    ``base`` (``model.attn_implementation``).

    ``auto``: ``flex`` on CUDA where torch has it and ``base`` is one the block-sparse function can fall back to,
    else ``dense``. ``flex`` on a CPU is allowed (its forward is exact, and the no-grad scoring forwards can use
    it); a backward through it raises in torch itself. Asking for ``flex`` where torch lacks it, or over ``eager``,
    is an error naming the key."""
    if setting not in SETTINGS:
        raise ValueError(f"model.masked_attention={setting!r}: choose one of {SETTINGS}")
    if setting == "dense":
        return "dense"
    usable = flex_supported() and base in FLEX_BASES
    if setting == "flex":
        if not flex_supported():
            raise ValueError(f"model.masked_attention=flex needs FlexAttention (torch >= 2.5); this torch is "
                             f"{torch.__version__}: use auto or dense")
        if base not in FLEX_BASES:
            raise ValueError(f"model.masked_attention=flex runs beside model.attn_implementation in {FLEX_BASES}, "
                             f"not {base!r}")
        return "flex"
    return "flex" if usable and torch.device(device).type in COMPILED_FLEX else "dense"


def rows_kernel(setting: str, resolved: str, layout: str, base: str) -> str:
    """The kernel of one layout's rows once the block-sparse path is ``resolved`` (``flex`` / ``dense``).

    ``auto`` keeps the grouped (shared-prompt) rows on the dense mask where the base kernel reads one (``sdpa``,
    ``eager``): measured at Qwen2.5-VL-7B shape on an H200, rows of 2,500-3,000 tokens ran 0-10% faster through
    SDPA's masked kernel than through FlexAttention (their masked tiles are few; docs/performance.md), while packed
    rows ran 0-7% faster through FlexAttention. An explicit ``flex`` runs every masked row through it."""
    if resolved != "flex" or layout not in ("packed", "grouped"):
        return "dense"
    if setting == "auto" and layout == "grouped" and base in ("sdpa", "eager"):
        return "dense"
    return "flex"


# ---- the mask -----------------------------------------------------------------------------------------------


def allowed(seg_q: torch.Tensor, seg_k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
            causal: bool = True) -> torch.Tensor:
    """May query ``q_idx`` (segment ``seg_q``) attend key ``k_idx`` (segment ``seg_k``)? Elementwise, broadcasting.

    One rule for every row. Segments: ``PROMPT`` (0) is seen by every real token of its row (the grouped layout's
    shared prompt), k >= 1 by tokens of segment k only (a packed sample, a grouped response, an image or window of
    the vision tower), ``PADDING`` (-1) by nobody. Causal for the decoder, not for the vision tower; a padding query
    sees itself only (a query that sees nothing would make NaN that poisons the backward). Equals
    :func:`mmrlhf.models.shared_prompt.allowed_pairs` on grouped rows."""
    visible = (seg_q >= 0) & ((seg_k == seg_q) | (seg_k == PROMPT))
    if causal:
        visible = visible & (q_idx >= k_idx)
    return visible | (q_idx == k_idx)


def row_segments(samples: Any) -> torch.Tensor:
    """[R, L] segment ids of the rows a batch runs as: a packed batch's one row (its 1-based sample index per
    token: ``SamplesVL.attention_mask``), or a grouped batch's rows (``GroupedSamples.segment_ids``)."""
    if hasattr(samples, "segment_ids"):
        return samples.segment_ids  # [G, L]
    if getattr(samples, "packed_seq_lens", None) is None:
        raise ValueError("block masks are for packed or grouped batches; a padded batch keeps its 2-D mask")
    return samples.attention_mask.long()  # [1, T], 1-based sample index (>= 1: never PROMPT)


def _blocks(seg: torch.Tensor, chunk_rows: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, nq, nk] any, [R, nq, nk] all): does a 128 x 128 tile show any / every (query, key) pair?

    Evaluated on the dense rule in chunks of query blocks (``chunk_rows`` x L booleans per row at a time), so the
    classification is the rule's by construction and memory stays bounded for long rows."""
    rows, length = seg.shape  # seg padded to a multiple of BLOCK with PADDING
    nb = length // BLOCK
    k_idx = torch.arange(length, device=seg.device)
    any_, all_ = [], []
    for q0 in range(0, length, chunk_rows):
        q1 = min(q0 + chunk_rows, length)
        q_idx = k_idx[q0:q1]
        ok = allowed(seg[:, q0:q1, None], seg[:, None, :], q_idx[None, :, None], k_idx[None, None, :],
                     causal)  # [R, q, L]
        ok = ok.expand(rows, q1 - q0, length).reshape(rows, (q1 - q0) // BLOCK, BLOCK, nb, BLOCK)
        any_.append(ok.any(dim=4).any(dim=2))  # [R, q/BLOCK, nb]
        all_.append(ok.all(dim=4).all(dim=2))
    return torch.cat(any_, dim=1), torch.cat(all_, dim=1)


def _kv_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, nq, nk] bool tiles -> (kv_num_blocks [R, 1, nq] int32, kv_indices [R, 1, nq, nk] int32): the listed
    tiles first, in key order, per query block (the layout ``BlockMask.from_kv_blocks`` reads)."""
    num = tiles.sum(dim=-1, dtype=torch.int32)[:, None]  # [R, 1, nq]
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, order[:, None]  # [R, 1, nq, nk]


def block_mask(segments: torch.Tensor, *, causal: bool = True, chunk_tokens: int = 1 << 26) -> Any:
    """The :class:`BlockMask` of rows with segment ids ``segments`` [R, L] (see :func:`allowed`).

    Tiles the rule hides entirely are left out (skipped by the kernel), tiles it shows entirely are listed as
    FULL (no per-element mask), and boundary tiles as partial, where the kernel evaluates :func:`allowed` on the
    segment ids. Rows are padded to a multiple of 128 with ``PADDING`` for the mask's lookups only; the kernel runs
    on L. ``chunk_tokens`` bounds the booleans evaluated at once (R x rows-per-chunk x L)."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, length = segments.shape
    padded = math.ceil(length / BLOCK) * BLOCK
    seg = torch.nn.functional.pad(segments.long(), (0, padded - length), value=PADDING)  # [R, L']
    chunk_rows = max(BLOCK, (chunk_tokens // max(rows * padded, 1)) // BLOCK * BLOCK)
    any_, all_ = _blocks(seg, chunk_rows, causal)  # [R, nq, nk] each
    partial_num, partial_idx = _kv_blocks(any_ & ~all_)
    full_num, full_idx = _kv_blocks(all_)

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ARG001 (the signature FlexAttention calls)
        return allowed(seg[b, q_idx], seg[b, kv_idx], q_idx, kv_idx, causal)

    return BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


def dense_from_block_mask(mask: Any, segments: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """[R, L, L] bool: what a kernel that honours ``mask``'s tiles computes (full tiles: every pair; partial tiles:
    the mask function; unlisted tiles: nothing). The check of :func:`block_mask`'s tile lists on a machine without
    the compiled kernel (FlexAttention's eager CPU path evaluates the mask function everywhere and would not notice
    a wrong tile list)."""
    rows, length = segments.shape
    nb = math.ceil(length / BLOCK)
    out = torch.zeros(rows, nb * BLOCK, nb * BLOCK, dtype=torch.bool, device=segments.device)
    seg = torch.nn.functional.pad(segments.long(), (0, nb * BLOCK - length), value=PADDING)
    idx = torch.arange(nb * BLOCK, device=segments.device)
    rule = allowed(seg[:, :, None], seg[:, None, :], idx[None, :, None], idx[None, None, :], causal)  # [R, L', L']
    for num, indices, full in ((mask.kv_num_blocks, mask.kv_indices, False),
                               (mask.full_kv_num_blocks, mask.full_kv_indices, True)):
        for r in range(rows):
            for qb in range(nb):
                for kb in indices[r, 0, qb, : int(num[r, 0, qb])].tolist():
                    q, k = slice(qb * BLOCK, (qb + 1) * BLOCK), slice(kb * BLOCK, (kb + 1) * BLOCK)
                    out[r, q, k] = True if full else rule[r, q, k]
    return out[:, :length, :length]


# ---- the kernel inside transformers -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _flex_kernel(device_type: str) -> Callable:
    """FlexAttention, compiled where a compiled kernel exists (CUDA: Triton), eager elsewhere (the CPU forward).

    ``torch.compile``'s automatic dynamic shapes compile one static kernel for the first row length and one
    dynamic kernel at the second, so varying packed lengths do not recompile per step."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type in COMPILED_FLEX else flex_attention


def _block_sparse_function(base: str) -> Callable:
    """The attention function registered as ``block_sparse_<base>``: FlexAttention for a :class:`BlockMask`,
    transformers' ``base`` function for every other mask (None, 2-D, 4-D tensors)."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [b, Hq, L, D], key / value [b, Hkv, L, D] -> ([b, L, Hq, D], None), as transformers' kernels return
        if not isinstance(attention_mask, BlockMask):
            return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, scaling=scaling,
                                                 dropout=dropout, **kwargs)
        if dropout:
            raise ValueError("attention dropout is not supported on the block-sparse path")
        kernel = _flex_kernel(query.device.type)
        out = kernel(query, key, value, block_mask=attention_mask, scale=scaling,
                     enable_gqa=query.shape[1] != key.shape[1])  # [b, Hq, L, D]
        return out.transpose(1, 2).contiguous(), None

    return attend


def segments_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[1, L] 1-based segment of every position of a varlen sequence (``cu_seqlens`` [n + 1] boundaries), computed
    where ``cu_seqlens`` is, without a host sync."""
    idx = torch.arange(length, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens[1:].contiguous(), idx, right=True) + 1)[None]


class _ByTensor:
    """The last few values built from a ``cu_seqlens`` tensor, by its identity. The vision tower passes the same two
    tensors (windows, whole images) to every block of one forward: each value is built once per forward, not once
    per block. Entries hold their tensor, so an identity is never reused while cached."""

    def __init__(self, build: Callable[[torch.Tensor, int], Any], size: int = 4) -> None:
        self.build, self.size, self.entries = build, size, []

    def get(self, cu_seqlens: torch.Tensor, length: int) -> Any:
        for tensor, value in self.entries:
            if tensor is cu_seqlens:
                return value
        value = self.build(cu_seqlens, length)
        self.entries = ([(cu_seqlens, value)] + self.entries)[: self.size]
        return value


def length_buckets(cu_seqlens: torch.Tensor, length: int) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
    """The segments of a varlen sequence grouped by length: per length ``n``, the positions of its ``k`` segments
    ([k * n], segment by segment), and the permutation [L] that puts the buckets' concatenation back in sequence
    order. Images of one size have one length, so a batch of them is one bucket."""
    bounds = cu_seqlens.tolist()  # [n + 1] (this path runs off CUDA: no device sync)
    if bounds[-1] != length:
        raise ValueError(f"vision segments end at {bounds[-1]}, the sequence holds {length} positions")
    starts: dict[int, list[int]] = {}
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            starts.setdefault(e - s, []).append(s)
    buckets = [(n, (torch.tensor(ss)[:, None] + torch.arange(n)[None]).reshape(-1)) for n, ss in starts.items()]
    inverse = torch.empty(length, dtype=torch.long)
    inverse[torch.cat([idx for _, idx in buckets])] = torch.arange(length)
    return buckets, inverse


def bucketed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       buckets: list[tuple[int, torch.Tensor]], inverse: torch.Tensor,
                       scaling: float | None) -> torch.Tensor:
    """Attention within each segment, one batched SDPA call per segment length: the same math as transformers'
    loop of one call per segment (each segment is one batch row here), with its backward on every device.
    query / key / value [1, H, L, D] -> [1, H, L, D]."""
    heads, dim = query.shape[1], query.shape[3]
    outs = []
    for n, idx in buckets:
        idx = idx.to(query.device)
        k = idx.numel() // n

        def rows(t: torch.Tensor) -> torch.Tensor:  # [1, H, L, D] -> [k, H, n, D]
            return t[0, :, idx].reshape(t.shape[1], k, n, dim).transpose(0, 1)

        out = torch.nn.functional.scaled_dot_product_attention(rows(query), rows(key), rows(value), scale=scaling,
                                                               enable_gqa=key.shape[1] != heads)
        outs.append(out.transpose(0, 1).reshape(heads, k * n, dim))  # [H, k n, D]
    return torch.cat(outs, dim=1)[:, inverse.to(query.device)][None]


def _varlen_vision_function() -> Callable:
    """The vision tower's attention: its images, frames and windows (``cu_seq_lens_q``) each attend within
    themselves, where transformers' SDPA path runs one call per segment (a 448 px image has 16 windows: 4 images x
    16 windows x 28 window blocks is ~1,800 host-bound calls per micro-batch, measured as most of the host time of a
    7B-shape step; on the CPU, 640 small images a step of the agent toy spent a third of its time there). On CUDA:
    ONE FlexAttention call per block over a non-causal block mask of the segments. Elsewhere (no compiled
    FlexAttention, and no backward through the eager one): one batched SDPA call per segment length."""
    masks = _ByTensor(lambda cu, length: block_mask(segments_from_cu_seqlens(cu, length), causal=False))
    bucketings = _ByTensor(lambda cu, length: length_buckets(cu, length))  # looked up when called

    def attend(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
               **kwargs):
        # query / key / value [1, H, L, D] -> ([1, L, H, D], None)
        if cu_seq_lens_q is None or attention_mask is not None or dropout:
            raise ValueError("the vision varlen path expects transformers' varlen call (cu_seq_lens_q, no mask, no "
                             "dropout); set model.masked_attention=dense for this model")
        if query.device.type in COMPILED_FLEX and flex_supported():
            mask = masks.get(cu_seq_lens_q, query.shape[2])
            out = _flex_kernel(query.device.type)(query, key, value, block_mask=mask, scale=scaling,
                                                  enable_gqa=query.shape[1] != key.shape[1])
        else:
            out = bucketed_attention(query, key, value, *bucketings.get(cu_seq_lens_q, query.shape[2]), scaling)
        return out.transpose(1, 2).contiguous(), None

    return attend


# transformers hands the vision attention function the segment boundaries (cu_seqlens) only when the name of the
# vision config's kernel contains "flash" (``is_flash_attention_requested``: its test for a variable-length
# kernel); every other kernel gets a loop of one call per segment. Hence the name.
VISION_NAME = _NAME + "flash_varlen"


def _register_vision() -> str:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if VISION_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(VISION_NAME, _varlen_vision_function())
    return VISION_NAME


def _register(base: str) -> str:
    """Register ``block_sparse_<base>`` with transformers (attention function and mask builder) once."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = _NAME + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _block_sparse_function(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def decoder_config(model: Any) -> Any:
    """The config the decoder layers read their attention kernel from (the text config, where there is one)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def base_implementation(model: Any) -> str:
    """The decoder's kernel as the user chose it (``model.attn_implementation``), block-sparse wrapper or not."""
    name = str(getattr(decoder_config(model), "_attn_implementation", None) or "eager")
    return name[len(_NAME):] if name.startswith(_NAME) else name


def vision_config(model: Any) -> Any:
    """The config the vision tower reads its kernel from (None for a model without one)."""
    return getattr(model.config, "vision_config", None)


def install(model: Any, *, vision: bool = True) -> None:
    """Point ``model``'s decoder at the block-sparse function over its current kernel and, with ``vision``, its
    vision tower (where it runs SDPA or eager, i.e. a loop over segments) at the varlen one; ``vision=False`` puts a
    varlen vision tower back on the loop (idempotent both ways). Raises for a decoder kernel it cannot fall back
    to (see :data:`FLEX_BASES`).

    The varlen path serves a training tower too: on an H200 its gradients, the loop's and the dense decoder's were
    all equally far from a float64 reference for every family (~3e-4 of the scale: cuDNN's float32 convolutions
    run in TF32), so the one gap once seen between two of them was float32 noise, not an error (docs/gpu.md)."""
    base = base_implementation(model)
    if base not in FLEX_BASES:
        raise ValueError(f"the block-sparse attention path runs beside {FLEX_BASES}, not {base!r}")
    decoder_config(model)._attn_implementation = _register(base)
    if vision:
        install_vision(model)
    elif vision_installed(model):
        vision_config(model)._attn_implementation = base if base in ("sdpa", "eager") else "sdpa"


def install_vision(model: Any) -> None:
    """Point ``model``'s vision tower, where it runs SDPA or eager (a loop over segments), at the varlen function;
    the decoder stays as it is (idempotent). ``model.masked_attention: auto`` does this on every device."""
    config = vision_config(model)
    if config is not None and getattr(config, "_attn_implementation", None) in ("sdpa", "eager"):
        config._attn_implementation = _register_vision()


def uninstall(model: Any) -> None:
    """Put ``model``'s decoder and vision tower back on their base kernels (a benchmark's dense rows)."""
    base = base_implementation(model)
    decoder_config(model)._attn_implementation = base
    if vision_installed(model):
        vision_config(model)._attn_implementation = base if base in ("sdpa", "eager") else "sdpa"


def vision_installed(model: Any) -> bool:
    """Whether ``model``'s vision tower runs the varlen function."""
    config = vision_config(model)
    return config is not None and getattr(config, "_attn_implementation", None) == VISION_NAME


def installed(model: Any) -> bool:
    """Whether ``model``'s decoder runs the block-sparse function."""
    return str(getattr(decoder_config(model), "_attn_implementation", "")).startswith(_NAME)
