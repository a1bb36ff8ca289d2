"""The trainer's forward + backward at a real model shape, per layout and attention kernel (prints Markdown tables).

Builds the named model's dimensions with random weights directly on the device (nothing downloaded), float32
master weights with ``--dtype`` (bf16) autocast through ``ActorVL``, vision tower frozen (the trainer's default),
and times what the policy update does per GRPO group: forward, a PPO-style loss over the response tokens, backward,
in the padded and packed per-sample layouts (micro-batches of ``--micro`` samples, gradients accumulated) and the
grouped (shared-prompt) layout, each with both settings of ``model.masked_attention`` (like for like: ``dense``: the
masks as dense tensors and the vision tower's per-segment SDPA loop; ``flex``: FlexAttention block masks for the
packed and grouped rows and the varlen vision tower, a padded batch keeping its 2-D mask).

Groups (``--groups``):
- ``img448``: one 448 px image (256 vision tokens), n = 8, answers 128-512 tokens;
- ``img896``: one 896 px image (1,024 vision tokens), n = 16, answers 32-128 tokens;
- ``agent``: a multi-turn group: one 448 px prompt image, n = 8 trajectories of ~300 tokens, each with one 224 px
  tool image inside its response (decides whether the shared-prompt layout should be on for agents);
- ``mixed``: four prompts whose images grow from 224 to 896 px, n = 4 each, answers 32-512 tokens (the token
  budget's case).

``--copy off,on``: ``trainer.compute_copy`` (bf16 copies of the Linear weights cast once per optimiser step,
:mod:`mmrlhf.models.compute_copy`) against autocast's casts in every forward; each timed group is one optimiser
step, so ``on`` casts the trained weights once per group, inside the timing.

``--splits count,budget``: micro-batches of ``--micro`` samples, and the trainer's token-budget split at ``auto``
(``trainer.max_tokens_per_micro_batch``: the count split's costliest micro-batch as the budget, never more
forwards). ``--checkpointing off,on``: ``trainer.gradient_checkpointing``; compare the peak memory and the time.

Per row: seconds (median of ``--repeats`` after warm-up: compile time is never in it), decoder tokens, tokens/s,
achieved TFLOP/s and its share of a bf16 matrix product timed in the same process, peak memory. FLOPs counted:
6 x decoder-layer parameters x decoder tokens (mixture-of-experts: the routed experts' share a token uses), 6 x
lm_head x scored tokens, attention 12 x heads x head_dim x the (query, key) pairs the mask allows per full-attention
layer (forward 4, backward 8; a hybrid's Gated DeltaNet layers count their projections only), the frozen vision
tower's forward (2 x its parameters x patches) and the merger's forward and backward.

Shapes (``--shape``, :mod:`mmrlhf.models.shapes`) include the hybrid ``qwen3_5_9b`` and ``qwen3_5_35b_a3b`` (Gated
DeltaNet layers; grouped rows run each prompt once and continue every response from its state, the packed and
padded ones run every sample from its first token). ``--quick`` keeps a hybrid's 3:1 layer pattern and a
mixture-of-experts shape's routing at small widths. ``--profile DIR`` writes torch.profiler tables of one
micro-batch per layout and kernel.

Run:  python benchmarks/bench_trainer.py --shape qwen2_5_vl_7b        (a GPU; ~100-110 GiB for the 7B in float32)
      python benchmarks/bench_trainer.py --shape qwen2_5_vl_7b --groups mixed --splits count,budget \
          --checkpointing off,on
      python benchmarks/bench_trainer.py --quick                      (CPU smoke run at a small shape)
      python benchmarks/bench_trainer.py --quick --shape qwen3_5_9b --groups img448 --dtype float32
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


# ---- the model -------------------------------------------------------------------------------------------------


# --quick: the shape's family and vision layout at small widths and depths (a CPU smoke run of the same code).
SMALL = {"text": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 8192, "head_dim": 64,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}},
         "vision": {"depth": 2, "hidden_size": 128, "embed_dim": 128, "intermediate_size": 256, "num_heads": 2,
                    "out_hidden_size": 256, "fullatt_block_indexes": [1]}}
SMALL_IDS = {"image_token_id": 8100, "video_token_id": 8101, "vision_start_token_id": 8102,
             "vision_end_token_id": 8103}


def small(shape: str) -> dict:
    """--quick's overrides for ``shape``: :data:`SMALL`, and for a hybrid (Gated DeltaNet) shape its 3:1 pattern in
    4 layers with partial rotary positions, for a mixture-of-experts shape 8 routed experts (2 per token)."""
    from mmrlhf.models.shapes import shape_dict

    text = shape_dict(shape)["text_config"]
    out = {"text": dict(SMALL["text"]), "vision": dict(SMALL["vision"])}
    if "layer_types" in text:
        out["text"].update(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                           linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                           linear_num_value_heads=4,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                            "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    if "num_experts" in text:
        out["text"].update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
        if "shared_expert_intermediate_size" in text:
            out["text"]["shared_expert_intermediate_size"] = 128
    return out


def build_model(shape: str, device: torch.device, quick: bool):
    from transformers import AutoModelForImageTextToText

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.shapes import shape_config

    cfg = shape_config(shape, **(small(shape) if quick else {}))
    if quick:  # a small vocabulary: the special tokens move inside it
        for name, value in SMALL_IDS.items():
            setattr(cfg, name, value)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model, get_adapter(model.config)


def param_counts(model, adapter) -> dict[str, float]:
    from mmrlhf.trainer.optim import freeze_vision

    freeze_vision(model, adapter, tower=True, merger=False)
    tower, mergers = adapter.vision_parts(model)
    merger = sum(p.numel() for m in mergers for p in m.parameters())
    vision = sum(p.numel() for p in tower.parameters()) - merger
    head = model.get_output_embeddings().weight.numel()
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    decoder = total - vision - merger - embed - (0 if tied else head)
    text = model.config.get_text_config()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)  # routed experts
    active = decoder - experts * (1 - getattr(text, "num_experts_per_tok", 0) / getattr(text, "num_experts", 1))
    return {"decoder": decoder, "active": active, "head": head, "vision": vision, "merger": merger, "total": total}


# ---- the groups ------------------------------------------------------------------------------------------------


@dataclass
class Group:
    name: str
    prompts: list[list[int]]
    responses: list[list[int]]
    vision: list[dict[str, torch.Tensor]]
    masks: list[list[int]] | None = None  # multi-turn: 1 policy, 0 observation token
    notes: dict = field(default_factory=dict)


def _image(adapter, px: int, gen: torch.Generator, patch_dim: int) -> dict[str, torch.Tensor]:
    side = px // adapter.patch_size  # patches per side (a multiple of the merge size)
    grid = torch.tensor([[1, side, side]])
    return {"pixel_values": torch.randn(side * side, patch_dim, generator=gen), "image_grid_thw": grid}


def _text(n: int, vocab: int, banned: set[int], gen: torch.Generator) -> list[int]:
    toks = [t for t in torch.randint(0, vocab, (2 * n + 16,), generator=gen).tolist() if t not in banned]
    return toks[:n]


def make_group(name: str, adapter, vocab: int, patch_dim: int, quick: bool, seed: int = 0) -> Group:
    gen = torch.Generator().manual_seed(seed)
    banned = set(adapter.vision_special_token_ids())
    scale = 4 if quick else 1  # the quick run shrinks images and answers

    def vision_span(img):
        pads = int(adapter.tokens_per_grid(img["image_grid_thw"]).sum())
        return [adapter.vision_start_token_id] + [adapter.image_token_id] * pads + [adapter.vision_end_token_id]

    if name == "mixed":
        return _mixed_group(adapter, vocab, patch_dim, quick, gen, banned, vision_span)
    spec = {"img448": (448, 8, 128, 512), "img896": (896, 16, 32, 128), "agent": (448, 8, 100, 160)}[name]
    px, n, lo, hi = spec
    px = max(px // scale // (adapter.patch_size * adapter.spatial_merge_size), 1) * adapter.patch_size \
        * adapter.spatial_merge_size
    lo, hi = max(lo // scale, 2), max(hi // scale, 4)
    img = _image(adapter, px, gen, patch_dim)
    prompt = _text(20, vocab, banned, gen) + vision_span(img) + _text(12, vocab, banned, gen)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    if name != "agent":
        return Group(name, [prompt] * n, [_text(k, vocab, banned, gen) for k in lengths], [img] * n,
                     notes={"image_px": px, "n": n, "answers": f"{lo}-{hi}"})
    obs_px = max(px // 2 // (adapter.patch_size * adapter.spatial_merge_size), 1) * adapter.patch_size \
        * adapter.spatial_merge_size
    responses, masks, vision = [], [], []
    for k in lengths:  # policy turn, tool observation with an image, policy turn
        obs = _image(adapter, obs_px, gen, patch_dim)
        first, second = _text(k, vocab, banned, gen), _text(k, vocab, banned, gen)
        span = _text(6, vocab, banned, gen) + vision_span(obs) + _text(4, vocab, banned, gen)
        responses.append(first + span + second)
        masks.append([1] * len(first) + [0] * len(span) + [1] * len(second))
        vision.append({"pixel_values": torch.cat([img["pixel_values"], obs["pixel_values"]]),
                       "image_grid_thw": torch.cat([img["image_grid_thw"], obs["image_grid_thw"]])})
    return Group(name, [prompt] * n, responses, vision, masks,
                 notes={"image_px": px, "n": n, "answers": f"2 x {lo}-{hi} + a {obs_px} px tool image"})


def _mixed_group(adapter, vocab, patch_dim, quick, gen, banned, vision_span) -> Group:
    """Four prompts whose images grow 4x in side (224 to 896 px: 64 to 1,024 vision tokens), n = 4 each, answers
    32-512 tokens: a step whose samples differ 16x in vision work, where a sample count bounds neither memory nor
    time (the token-budget split's case)."""
    scale = 4 if quick else 1
    unit = adapter.patch_size * adapter.spatial_merge_size
    prompts, responses, vision = [], [], []
    for px in (224, 448, 672, 896):
        side = max(px // scale // unit, 1) * unit
        img = _image(adapter, side, gen, patch_dim)
        prompt = _text(20, vocab, banned, gen) + vision_span(img) + _text(12, vocab, banned, gen)
        for k in torch.randint(max(32 // scale, 2), 512 // scale + 1, (4,), generator=gen).tolist():
            prompts.append(prompt)
            responses.append(_text(k, vocab, banned, gen))
            vision.append(img)
    return Group("mixed", prompts, responses, vision, notes={"image_px": "224-896", "n": 4, "answers": "32-512"})


def split_indices(group: Group, layout: str, adapter, micro: int, split: str) -> list[list[int]]:
    """The micro-batches (sample indices) of the group: ``count`` = consecutive ``micro`` samples (the grouped
    layout: the whole group in one row), ``budget`` = the trainer's token-budget split at ``auto`` (the count
    split's costliest micro-batch as the budget; :mod:`mmrlhf.parallel.micro_batches`)."""
    n = len(group.prompts)
    if split == "count":
        return [list(range(n))] if layout == "grouped" else [list(range(i, min(i + micro, n)))
                                                              for i in range(0, n, micro)]
    from mmrlhf.experience.costs import forward_layout, sample_costs
    from mmrlhf.parallel.micro_batches import plan_micro_batches

    costs = sample_costs(group.prompts, group.responses, group.vision, adapter=adapter, grouped=layout == "grouped",
                         multi_turn=group.masks is not None)
    kind = forward_layout(packing=layout == "packed", shared_prompt=layout == "grouped", max_row_tokens=None)
    plan = plan_micro_batches(costs, [list(range(n))], kind, samples=micro, tokens="auto")
    return [m for m in plan.micro_batches[0] if m]


def build_layout(group: Group, layout: str, adapter, micro: int, split: str = "count"):
    """The micro-batches of ``layout`` (BuiltSamples each), split as :func:`split_indices` says."""
    from mmrlhf.experience.grouped import build_grouped_samples
    from mmrlhf.experience.samples import build_packed_samples, build_padded_samples

    kw = dict(pad_id=0, eos_id=(), adapter=adapter)
    build = {"grouped": build_grouped_samples, "padded": build_padded_samples, "packed": build_packed_samples}[layout]

    def pick(values, idx):
        return None if values is None else [values[i] for i in idx]

    return [build(pick(group.prompts, idx), pick(group.responses, idx), vision=pick(group.vision, idx),
                  response_masks=pick(group.masks, idx), **kw)
            for idx in split_indices(group, layout, adapter, micro, split)]


# ---- work counted -----------------------------------------------------------------------------------------------


def decoder_tokens(built) -> int:
    s = built.samples
    if hasattr(s, "segment_ids"):
        return int((s.segment_ids != -1).sum())
    return int(s.sequences.numel())


def attention_pairs(group: Group, layout: str) -> int:
    """(query, key) pairs the mask allows, summed over the layout's rows (causal, diagonal included)."""
    p = len(group.prompts[0])
    rs = [len(r) for r in group.responses]
    if layout == "grouped":
        return p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in rs)
    return sum((p + r) * (p + r + 1) // 2 for r in rs)


def flops(group: Group, layout: str, micros, counts: dict[str, float], cfg) -> float:
    text = cfg.get_text_config()
    heads_dim = text.num_attention_heads * (getattr(text, "head_dim", None)
                                            or text.hidden_size // text.num_attention_heads)
    tokens = sum(decoder_tokens(b) for b in micros)
    scored = sum(int(b.samples.response_length.sum()) for b in micros)
    patches = sum(int(b.samples.image_grid_thws.prod(-1).sum()) for b in micros
                  if b.samples.image_grid_thws is not None)
    merge = 4
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    attention_layers = sum(1 for kind in types if kind == "full_attention")
    return (6 * counts["active"] * tokens + 6 * counts["head"] * scored
            + 12 * heads_dim * attention_pairs(group, layout) * attention_layers
            + 2 * counts["vision"] * patches + 6 * counts["merger"] * patches / merge)


# ---- timing ------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(actor, micros, copies=None) -> None:
    """Forward, PPO-style surrogate over the policy tokens, backward, per micro-batch (gradients accumulate).
    ``copies`` (a ComputeCopy): the group is one optimiser step: its trained copies are cast again first."""
    total = sum(int(b.samples.response_length.sum()) for b in micros)
    if copies is not None:
        copies.stale()  # what an optimiser step does to the trained masters
    with copies.active() if copies is not None else contextlib.nullcontext():
        for built in micros:
            out = actor(built.samples, vision_extra=built.vision_extra)
            mask = out.action_mask.float()
            adv = torch.linspace(-1, 1, out.log_probs.shape[0], device=out.log_probs.device)[:, None]
            ratio = (out.log_probs - out.log_probs.detach()).exp()
            (-(ratio * adv * mask).sum() / total).backward()


def time_layout(actor, micros, device, repeats: int, warmup: int, copies=None) -> tuple[float, float, float]:
    """(median seconds of one group's forward + backward, peak memory GiB, seconds of the first call: kernel
    compilation and allocator warm-up)."""
    first = 0.0
    for i in range(warmup):
        _sync(device)
        t0 = time.perf_counter()
        step(actor, micros, copies)
        _sync(device)
        first = first or time.perf_counter() - t0
    actor.model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step(actor, micros, copies)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    actor.model.zero_grad(set_to_none=True)
    return statistics.median(times), peak, first


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - t0) / 1e12


def profile(actor, micros, device, path: Path, copies=None, rows: int = 30) -> str:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    step(actor, micros, copies)  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step(actor, micros[:1], copies)
        _sync(device)
    actor.model.zero_grad(set_to_none=True)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=rows)
    path.write_text(text)
    return text


# ---- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.precision import DTYPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2_5_vl_7b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--groups", default="img448,img896,agent")
    ap.add_argument("--layouts", default="padded,packed,grouped")
    ap.add_argument("--kernels", default="dense,flex")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--splits", default="count", help="count (micro-batches of --micro samples) and / or budget "
                                                        "(trainer.max_tokens_per_micro_batch: auto)")
    ap.add_argument("--checkpointing", default="off", help="off and / or on (trainer.gradient_checkpointing)")
    ap.add_argument("--copy", default="off", help="off and / or on (trainer.compute_copy; needs --dtype bfloat16)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on the default target modules (0: full training)")
    ap.add_argument("--lora-base", default="float32", help="float32 and / or bfloat16 (model.lora.base_dtype), in "
                                                          "that order: the base is rounded once, in place")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--matmul-size", type=int, default=8192)
    ap.add_argument("--profile", help="write torch.profiler tables of one micro-batch per layout and kernel of the "
                                      "first group here")
    ap.add_argument("--quick", action="store_true", help="a small shape on the CPU, 1 repeat (a smoke run)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.quick:
        args.repeats, args.warmup, args.matmul_size = 1, 1, 1024
        if device.type == "cpu":
            args.kernels = "dense"  # FlexAttention has no CPU backward
    compute = DTYPES[args.dtype]
    torch.manual_seed(0)
    model, adapter = build_model(args.shape, device, args.quick)
    counts = param_counts(model, adapter)
    cfg = model.config
    patch_dim = 3 * adapter.temporal_patch_size * adapter.patch_size ** 2
    vocab = cfg.get_text_config().vocab_size
    matmul = matmul_tflops(device, compute, args.matmul_size)
    autocast = compute if compute != torch.float32 else None
    kernels = [k for k in args.kernels.split(",") if k]
    rows = []
    bases = args.lora_base.split(",") if args.lora else ["-"]
    if args.lora:
        from mmrlhf.config.model import LoraConfig
        from mmrlhf.models.lora import apply_lora

        apply_lora(ActorVL(model, adapter), LoraConfig(rank=args.lora, alpha=2.0 * args.lora))
    for base in bases:
        if base == "bfloat16":
            from mmrlhf.models.precision import store_frozen_linears

            store_frozen_linears(model, torch.bfloat16)
        _rows(args, base, model, adapter, autocast, kernels, counts, cfg, matmul, device, vocab, patch_dim, rows)
    _print(args, device, counts, matmul, rows)
    _print_copy(rows)
    _print_lora(rows)
    if args.json:
        _write_json(args, counts, matmul, rows)


def _rows(args, base, model, adapter, autocast, kernels, counts, cfg, matmul, device, vocab, patch_dim, rows) -> None:
    """Every row of one model state (``base``: the LoRA base's dtype, "-" without LoRA)."""
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.gradient_checkpointing import checkpoint_blocks

    lora = f"r{args.lora} {base}" if args.lora else "-"
    for ckpt in args.checkpointing.split(","):
        blocks = checkpoint_blocks(ActorVL(model, adapter)) if ckpt == "on" else []
        for gname in args.groups.split(","):
            group = make_group(gname, adapter, vocab, patch_dim, args.quick)
            for layout in args.layouts.split(","):
                for split in args.splits.split(","):
                    if split == "budget" and layout == "grouped" and len(args.splits.split(",")) > 1:
                        continue  # one group is one row either way
                    micros = build_layout(group, layout, adapter, args.micro, split)
                    for kernel in kernels:
                        for copy in args.copy.split(","):
                            if copy == "on" and autocast is None:
                                continue  # float32 compute: nothing to copy
                            row = {"group": gname, "layout": layout, "kernel": kernel, "split": split,
                                   "checkpointing": ckpt, "copy": copy, "lora": lora}
                            rows.append(_run_row(row, model, adapter, autocast, micros, group, counts, cfg,
                                                 matmul, device, args))
                    del micros
        for block in blocks:  # back to the blocks' own forward
            del block.__dict__["forward"]


def _run_row(row, model, adapter, autocast, micros, group, counts, cfg, matmul, device, args) -> dict:
    from mmrlhf.models import attention
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.compute_copy import ComputeCopy

    kernel = row["kernel"]
    if kernel == "dense":  # decoder masks dense, vision tower on its per-segment loop
        attention.uninstall(model)
    actor = ActorVL(model, adapter, compute_dtype=autocast, masked_attention=kernel)
    copies = ComputeCopy(actor, autocast) if row["copy"] == "on" else None
    try:
        seconds, peak, first = time_layout(actor, micros, device, args.repeats, args.warmup, copies)
    except Exception as exc:  # a kernel that cannot run this row: reported in the table, the others still run
        traceback.print_exc()
        print(f"[bench_trainer] {row}: {type(exc).__name__}: {exc}", file=sys.stderr)
        model.zero_grad(set_to_none=True)
        return {**row, "error": type(exc).__name__}
    finally:
        if copies is not None:
            copies.release()
    work = flops(group, row["layout"], micros, counts, cfg)
    tokens = sum(decoder_tokens(b) for b in micros)
    if args.profile and row["group"] == args.groups.split(",")[0]:
        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        profile(actor, micros, device, out / f"{row['group']}_{row['layout']}_{kernel}_{row['split']}"
                f"_copy-{row['copy']}.txt", copies)
    return {**row, "forwards": len(micros), "tokens": tokens, "s": seconds, "tok_s": tokens / seconds,
            "tflops": work / seconds / 1e12, "share": work / seconds / 1e12 / matmul, "peak_gib": peak,
            "first_s": first}


def _print(args, device, counts, matmul, rows) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    def b(n: float) -> str:
        return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"

    print(f"\nTrainer forward + backward, {args.shape}{' (small)' if args.quick else ''} on {name}, torch "
          f"{torch.__version__}: decoder {b(counts['decoder'])} + lm_head {b(counts['head'])} "
          f"parameters, vision {b(counts['vision'])} (frozen) + merger {b(counts['merger'])}; "
          f"float32 master, {args.dtype} compute; per-sample layouts in micro-batches of {args.micro}; median of "
          f"{args.repeats} after {args.warmup} warm-up(s). Same-process {args.dtype} matmul "
          f"({args.matmul_size}^3): {matmul:.0f} TFLOP/s\n")
    print("| group | layout | kernel | split | checkpointing | copy | LoRA | forwards | decoder tokens | s | tokens/s "
          "| TFLOP/s | of matmul | peak GiB | first call s |")
    print("|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        head = (f"| {r['group']} | {r['layout']} | {r['kernel']} | {r['split']} | {r['checkpointing']} | "
                f"{r['copy']} | {r['lora']} |")
        if "error" in r:
            print(f"{head} failed: {r['error']} | | | | | | | |")
            continue
        print(f"{head} {r['forwards']} | {r['tokens']:,} | {r['s']:.3f} | {r['tok_s']:,.0f} | {r['tflops']:.1f} | "
              f"{r['share']:.0%} | {r['peak_gib']:.1f} | {r['first_s']:.1f} |")
    print()
    for g in sorted({r["group"] for r in rows}):
        for kernel in sorted({r["kernel"] for r in rows}):
            ok = {r["layout"]: r for r in rows if r["group"] == g and r["kernel"] == kernel and "error" not in r
                  and r["split"] == "count" and r["checkpointing"] == "off" and r["copy"] == rows[0]["copy"]
                  and r["lora"] == rows[0]["lora"]}
            pad, packed, grouped = ok.get("padded"), ok.get("packed"), ok.get("grouped")
            if pad and packed:
                print(f"{g}, {kernel}: packed vs padded {pad['s'] / packed['s']:.2f}x faster with "
                      f"{pad['tokens'] / packed['tokens']:.2f}x fewer tokens")
            if grouped and (pad or packed):
                best = min([r for r in (pad, packed) if r], key=lambda r: r["s"])
                print(f"{g}, {kernel}: grouped vs best per-sample ({best['layout']}) {best['s'] / grouped['s']:.2f}x")


def _print_copy(rows) -> None:
    """The compute copy against autocast, row by row (same group, layout, kernel, split, checkpointing)."""
    key = ("group", "layout", "kernel", "split", "checkpointing", "lora")
    off = {tuple(r[k] for k in key): r for r in rows if r["copy"] == "off" and "error" not in r}
    for r in rows:
        base = off.get(tuple(r[k] for k in key))
        if r["copy"] == "on" and "error" not in r and base:
            print(f"{', '.join(str(r[k]) for k in key)}: compute copy {base['s'] / r['s']:.2f}x autocast "
                  f"({r['s']:.3f} s vs {base['s']:.3f} s; {r['share']:.0%} vs {base['share']:.0%} of matmul; peak "
                  f"{r['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB)")


def _print_lora(rows) -> None:
    """A bf16 LoRA base against the float32 one, row by row."""
    key = ("group", "layout", "kernel", "split", "checkpointing", "copy")
    fp32 = {tuple(r[k] for k in key): r for r in rows if r["lora"].endswith("float32") and "error" not in r}
    for r in rows:
        base = fp32.get(tuple(r[k] for k in key))
        if r["lora"].endswith("bfloat16") and "error" not in r and base:
            print(f"{', '.join(str(r[k]) for k in key)}: LoRA base bf16 {base['s'] / r['s']:.2f}x the float32 base "
                  f"({r['s']:.3f} s vs {base['s']:.3f} s; peak {r['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB)")


def _write_json(args, counts, matmul, rows) -> None:
    from _results import table, write_json

    columns = ["group", "layout", "kernel", "split", "checkpointing", "copy", "LoRA", "forwards", "decoder tokens",
               "s", "tokens/s", "TFLOP/s", "of matmul", "peak GiB"]
    cells = [[r["group"], r["layout"], r["kernel"], r["split"], r["checkpointing"], r["copy"], r["lora"],
              r.get("forwards"),
              r.get("tokens"),
              r.get("s"), r.get("tok_s"), r.get("tflops"), r.get("share"), r.get("peak_gib")] for r in rows]
    best = max((r for r in rows if "share" in r), key=lambda r: r["share"], default=None)
    headline = (f"best {best['group']} {best['layout']} {best['kernel']}: {best['share']:.0%} of a {matmul:.0f} "
                f"TFLOP/s matmul" if best else "no row ran")
    write_json(args.json, "trainer", headline, {k: v for k, v in vars(args).items() if k != "json"},
               [table(f"Forward + backward per group ({args.shape})", columns, cells)])


if __name__ == "__main__":
    main()
