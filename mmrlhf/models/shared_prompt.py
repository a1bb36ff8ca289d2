"""The attention mask of the grouped (shared-prompt) layout, in the form each attention kernel reads.

Mechanism, and why: a dense 4-D mask ``[G, 1, L, L]`` handed to the decoder, which transformers passes through
unchanged to every layer (a prepared 4-D mask short-cuts its own mask construction). One forward, plain autograd:
the prompt's and the vision tower's gradients are the sum over the row's responses by construction, the no-grad
scoring forwards and the training forward are the same code, and no KV-cache plumbing (whose layout differs by
family and transformers version) is involved. The alternative, running the prompt once into a KV cache and the
responses against it, saves the prompt-to-response attention FLOPs but needs a cache that carries gradients and
a second code path per family. The cost of the dense mask is quadratic in the row length; rows are bounded by
``trainer.shared_prompt_max_tokens`` (see :mod:`mmrlhf.experience.grouped`).

Kernels: ``sdpa`` and ``eager`` both get an additive mask in the compute dtype (0 where a key is visible, the
dtype's minimum elsewhere): ``eager`` adds it to the scores, and ``sdpa`` would convert a boolean mask into exactly
that in EVERY layer, so it is built once here (on GPUs PyTorch runs arbitrary masks in its memory-efficient kernel).
``flash_attention_2`` reads no arbitrary mask at all: there the grouped rows need the block-sparse path
(``model.masked_attention``, :mod:`mmrlhf.models.attention`: FlexAttention with a block mask of the same rule,
which skips the tiles the mask hides), and without it the layout is refused. On CUDA that path is the default for
every kernel; this dense mask is the CPU's and the reference the tests compare it with.

Padding queries attend to themselves only: a fully masked row would give NaN, and NaN hidden states at padding
would poison the backward even though nothing reads them.
"""

from __future__ import annotations

import torch

SUPPORTED_ATTENTION = ("sdpa", "eager")


def resolve_shared_prompt(setting: str | bool, attn_implementation: str, n_samples_per_prompt: int, *,
                          multi_turn: bool = False, masked_kernel: str = "dense") -> bool:
    """``trainer.shared_prompt`` -> on/off. ``masked_kernel``: how grouped rows attend (``model.masked_attention``
    resolved for the trainer's device, :func:`mmrlhf.models.attention.resolve_masked_attention`): ``flex`` expresses
    the group mask over any base kernel, ``dense`` needs a base kernel that reads a mask (``sdpa``, ``eager``).

    ``auto``: on where it is exact (the kernel can express the mask) and saves work (more than one sample per
    prompt). Multi-turn rollouts only where the block-sparse path runs (``flex``, CUDA): a trajectory's response
    holds its observations (images included), so responses are long next to the shared prompt; on the CPU's dense
    path a group's row cost more than encoding the prompt per sample (the zoom toy: 64 trajectories of ~100 tokens in
    one grouped row, a forward 5.4x slower than padded), while on an H200 at Qwen2.5-VL-7B shape a group of 8
    trajectories of ~300 tokens with a tool image each trained 1.5x faster grouped than padded (benchmarks/
    bench_trainer.py, ``agent``). ``True`` with a kernel that cannot run it is an error, not a silent off.

    Families with recurrent (Gated DeltaNet) layers run it too: those layers read no mask, so they run each prompt
    once and continue every response from its state (:mod:`mmrlhf.models.linear_attention`).

    Routing replay (``rollout.routing_replay=replay``) holds in grouped rows too: they carry the engine's experts per
    token (the prompt's from the row's first sample, :func:`mmrlhf.experience.grouped.build_grouped_samples`)."""
    expressible = masked_kernel == "flex" or attn_implementation in SUPPORTED_ATTENTION
    if setting == "auto":
        return n_samples_per_prompt > 1 and expressible and (not multi_turn or masked_kernel == "flex")
    if setting and not expressible:
        raise ValueError(f"trainer.shared_prompt=true needs model.attn_implementation in {SUPPORTED_ATTENTION}, "
                         f"not {attn_implementation!r}, or the block-sparse path (model.masked_attention=flex, "
                         "CUDA) (or set trainer.shared_prompt=auto / false)")
    return bool(setting)


def allowed_pairs(segment_ids: torch.Tensor) -> torch.Tensor:
    """[G, L, L] bool: may query q attend key k? ``segment_ids`` [G, L]: 0 prompt, k >= 1 response k, -1 padding.

    Causal, and a key is visible when it is a prompt token or in the query's own response; padding queries see
    themselves only, padding keys are never seen by a real token.
    """
    length = segment_ids.shape[1]
    idx = torch.arange(length, device=segment_ids.device)
    causal = idx[None, :, None] >= idx[None, None, :]  # [1, L(q), L(k)]
    seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]  # [G, L, 1], [G, 1, L]
    visible = ((seg_k == 0) & (seg_q >= 0)) | ((seg_k == seg_q) & (seg_k > 0))  # [G, L, L]
    diagonal = torch.eye(length, dtype=torch.bool, device=segment_ids.device)[None]  # [1, L, L]
    return (causal & visible) | diagonal


def grouped_attention_mask(segment_ids: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[G, 1, L, L] mask of a grouped batch for the kernel ``implementation`` (compute dtype ``dtype``)."""
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"the shared-prompt (grouped) layout needs attention that reads an arbitrary mask ({SUPPORTED_ATTENTION}); "
            f"this model runs {implementation!r}: set model.attn_implementation=sdpa or trainer.shared_prompt=false")
    allowed = allowed_pairs(segment_ids)[:, None]  # [G, 1, L, L]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
