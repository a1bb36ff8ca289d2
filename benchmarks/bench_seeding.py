"""Sampling-seed benchmark (prints a table; not a test): what a per-request ``SamplingParams.seed`` costs.

1. ``engine`` (needs vLLM): one in-process vLLM engine, the same prompts generated with ``rollout.seed_mode``
   ``per_sample`` (every request carries a seed: vLLM's per-request generator path) and ``per_step`` (no request
   seed, the default generators seeded once per call), alternated ``--repeats`` times; tokens/s of each and the
   per_step / per_sample ratio. ``min_new_tokens = max_new_tokens``, so both produce the same number of tokens.
2. ``sampler`` (torch only, any device): the sampler step itself, as vLLM's ``random_sample`` does it
   (``vllm/v1/sample/ops/topk_topp_sampler.py``): exponential noise for a [rows, vocab] batch drawn in one call,
   against one ``exponential_(generator=...)`` per row (one kernel launch per request per decoding step on a GPU).
   This is the part that runs on a GPU machine without vLLM.

Run:  python benchmarks/bench_seeding.py [--part engine sampler] [--prompts 16] [--samples 4] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def engine_part(args) -> tuple[list[list], float]:
    """Rows [mode, tokens, seconds, tok/s] (best of the repeats) and the per_step / per_sample ratio."""
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.types import GenerationRequest, SamplingSettings
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = str(tiny_model_dir("qwen2_vl", args.size))
    engine = VLLMEngine(path, get_adapter(path), max_model_len=256, dtype=args.dtype)
    words = "red green blue yellow purple orange black white".split()
    requests = [GenerationRequest(" ".join(words[(k + j) % len(words)] for j in range(8)))
                for k in range(args.prompts)]
    settings = SamplingSettings(n=args.samples, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                seed=7)
    engine.generate(requests[:2], settings)  # warm-up
    best: dict[str, tuple[int, float]] = {}
    for _ in range(args.repeats):
        for mode in ("per_sample", "per_step"):
            engine.seed_mode = mode
            t0 = time.perf_counter()
            result = engine.generate(requests, settings)
            sec = time.perf_counter() - t0
            if mode not in best or sec < best[mode][1]:
                best[mode] = (result.num_tokens, sec)
    rows = [[mode, tok, sec, tok / sec] for mode, (tok, sec) in best.items()]
    engine.close()
    return rows, rows[1][3] / rows[0][3]


def sampler_part(args) -> tuple[list[list], dict[str, float]]:
    """Rows [device, rows, vocab, batched ms, per-row ms, ratio] per batch size; ratios by device."""
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out, ratios = [], {}
    for device in devices:
        for rows in args.rows:
            probs = torch.rand(rows, args.vocab, device=device)
            gens = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]
            q = torch.empty_like(probs)

            def batched():
                q.exponential_()

            def per_row():
                for i, g in enumerate(gens):
                    q[i].exponential_(generator=g)

            times = {}
            for name, fn in (("batched", batched), ("per_row", per_row)):
                for _ in range(3):
                    fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                times[name] = (time.perf_counter() - t0) / args.iters * 1e3
            ratio = times["per_row"] / times["batched"]
            out.append([device, rows, args.vocab, times["batched"], times["per_row"], ratio])
            ratios[f"{device}@{rows}"] = ratio
    return out, ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", default=["engine", "sampler"], choices=["engine", "sampler"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="sampler part: sequences per step")
    ap.add_argument("--vocab", type=int, default=151936, help="sampler part: vocabulary (Qwen's)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = ap.parse_args()

    tables, headline = [], []
    if "engine" in args.part:
        try:
            rows, ratio = engine_part(args)
        except ImportError as exc:  # no vLLM on this machine: the sampler part still runs
            print(f"engine part skipped: {exc}")
        else:
            print(f"\nvLLM generation, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens "
                  f"({args.size} model, {args.dtype}), best of {args.repeats}:")
            print(f"{'seed_mode':<11} {'tokens':>7} {'s':>7} {'tok/s':>8}")
            for mode, tok, sec, tps in rows:
                print(f"{mode:<11} {tok:>7} {sec:>7.2f} {tps:>8.0f}")
            print(f"per_step / per_sample tokens/s: {ratio:.2f}x")
            headline.append(f"engine per_step/per_sample {ratio:.2f}x")
            from _results import table

            tables.append(table("vLLM tokens/s by seed mode", ["seed_mode", "tokens", "seconds", "tok/s"], rows))
    if "sampler" in args.part:
        rows, ratios = sampler_part(args)
        print(f"\nsampler noise for one decoding step (vocab {args.vocab}), ms per step:")
        print(f"{'device':<6} {'rows':>5} {'batched':>9} {'per-row':>9} {'ratio':>7}")
        for device, n, _, b, p, r in rows:
            print(f"{device:<6} {n:>5} {b:>9.3f} {p:>9.3f} {r:>6.1f}x")
        headline.append("sampler per-row/batched " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
        from _results import table

        tables.append(table("sampler noise per decoding step (ms)",
                            ["device", "rows", "vocab", "batched ms", "per-row ms", "per-row / batched"], rows))
    if args.json:
        from _results import write_json

        write_json(args.json, "seeding", "; ".join(headline), vars(args), tables)


if __name__ == "__main__":
    main()
