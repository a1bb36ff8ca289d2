"""The reference's scoring forwards at a real model shape: whole, FSDP2-sharded (the trainer's plan for the frozen
models, :func:`mmrlhf.models.sharding.shard_for_scoring`) and sharded with its weights in host memory
(``distributed.offload=params``), on one device (prints a Markdown table).

Why: since issue 54 the reference and a distillation teacher are sharded with FSDP2 beside the policy wherever the
policy is, and the Ray trainer actors score them. On one GPU a world of one rank still runs the whole FSDP2 path
(every block its own unit, gathered for its forward, freed after), so this measures what the sharding costs per
forward and what offload saves, and checks that the sharded log-probs equal the whole model's (a world of one: the
same weights and the same kernels, so the difference should be zero up to the kernels' run-to-run noise).

Builds the named shape with random weights on the device in ``--dtype`` (the reference is stored in ``model.dtype``),
scores one GRPO group of ``--group`` (bench_trainer's groups: one 448 px image, n = 8, 128-512 answer tokens) in the
packed layout, micro-batches of ``--micro``. Per row: median seconds of ``--repeats`` after ``--warmup``, peak device
memory, the weights resident on the device between forwards, max |log-prob - whole's|.

Run:  python benchmarks/bench_sharded_scoring.py --shape qwen2_5_vl_7b       (one GPU; ~40 GiB at 7B in bf16)
      python benchmarks/bench_sharded_scoring.py --quick                     (CPU smoke run at a small shape)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer import build_layout, build_model, make_group  # noqa: E402

VARIANTS = ("whole", "sharded", "sharded+offload")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _gib(device: torch.device, which: str) -> float | None:
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) if which == "peak" else torch.cuda.memory_allocated(device)) / 2**30


def score(actor, micros) -> list[torch.Tensor]:
    """The log-probs of every micro-batch (``[b, A]`` each), no gradients: what the experience maker's reference
    forward computes."""
    with torch.no_grad():
        return [actor(b.samples, vision_extra=b.vision_extra).log_probs.float().cpu() for b in micros]


def timed(actor, micros, device, repeats: int, warmup: int) -> tuple[float, list[torch.Tensor]]:
    for _ in range(warmup):
        score(actor, micros)
    times, out = [], []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = score(actor, micros)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2_5_vl_7b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--group", default="img448")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a small shape on the CPU, float32, 1 repeat (a smoke run)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.quick:
        args.dtype, args.repeats, args.warmup = "float32", 1, 0

    from mmrlhf.devices import resolve_device
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.sharding import offload_policy, shard_for_scoring
    from mmrlhf.parallel.world import join_alone, leave

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    join_alone()  # FSDP2 needs a process group: a world of this process alone
    try:
        rows = []
        reference = None
        for variant in VARIANTS:
            _peak_reset(device)
            torch.manual_seed(0)  # the same random weights for every variant
            model, adapter = build_model(args.shape, device, args.quick)
            model.to(dtype).requires_grad_(False)
            vocab = model.config.get_text_config().vocab_size
            patch_dim = model.config.vision_config.in_channels * model.config.vision_config.temporal_patch_size \
                * model.config.vision_config.patch_size ** 2
            group = make_group(args.group, adapter, vocab, patch_dim, args.quick)
            micros = build_layout(group, "packed", adapter, args.micro)
            actor = ActorVL(model, adapter)
            if variant != "whole":
                kwargs = {}
                if variant.endswith("offload"):
                    kwargs["offload_policy"] = offload_policy("params", device)
                shard_for_scoring(actor, **kwargs)
            resident = _gib(device, "now")
            _peak_reset(device)
            seconds, out = timed(actor, micros, device, args.repeats, args.warmup)
            if reference is None:
                reference = out
            rows.append({"variant": variant, "seconds": seconds, "peak_gib": _gib(device, "peak"),
                         "resident_gib": resident, "max_dlogp": max_diff(out, reference),
                         "tokens": int(sum(int(b.samples.response_length.sum()) for b in micros))})
            del actor, model, micros
        _print(args, device, rows)
        if args.json:
            _write_json(args, device, rows)
    finally:
        leave()


def _print(args, device, rows) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"Reference scoring, {args.shape}{' (quick)' if args.quick else ''}, {args.dtype}, {device}, group "
          f"{args.group}, micro-batches of {args.micro}, median of {args.repeats}\n")
    print("| variant | seconds | x whole | peak GiB | weights on the device GiB | max abs dlogp vs whole |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = rows[0]["seconds"]
    for r in rows:
        print(f"| {r['variant']} | {r['seconds']:.3f} | {r['seconds'] / base:.2f} | {fmt(r['peak_gib'], '.1f')} | "
              f"{fmt(r['resident_gib'], '.1f')} | {r['max_dlogp']:.3g} |")


def _write_json(args, device, rows) -> None:
    from _results import table, write_json

    columns = ["variant", "s", "x whole", "peak GiB", "resident GiB", "max |dlogp|", "scored tokens"]
    base = rows[0]["seconds"]
    cells = [[r["variant"], r["seconds"], r["seconds"] / base, r["peak_gib"], r["resident_gib"], r["max_dlogp"],
              r["tokens"]] for r in rows]
    worst = max(r["max_dlogp"] for r in rows)
    headline = (f"sharded {rows[1]['seconds'] / base:.2f}x whole, offload {rows[2]['seconds'] / base:.2f}x; "
                f"max |dlogp| {worst:.3g}")
    write_json(args.json, "sharded_scoring", headline,
               {**{k: v for k, v in vars(args).items() if k != "json"}, "device": str(device)},
               [table(f"Reference scoring ({args.shape}, {args.dtype})", columns, cells)])


if __name__ == "__main__":
    main()
