"""``mmrlhf smoke``: build a tiny Qwen-VL offline, generate through the real vLLM engine with images and a video,
and check the engine's log-probs against a float32 transformers forward. The quick start's main job until the
trainer lands."""

from __future__ import annotations

import argparse
import sys
import time

from mmrlhf.testing.tiny_models import FAMILIES
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "smoke",
        help="CPU/GPU smoke run: tiny model -> vLLM generation with images and video -> log-prob check",
        description="Builds (or reuses from the cache) a tiny random Qwen-VL model, generates with vLLM for a "
        "text prompt, one image, two images and a video, and compares vLLM's sampled-token log-probs with a "
        "float32 transformers forward of the distribution vLLM sampled from (at the sampling temperature, vision "
        "special tokens excluded). Exits non-zero if they disagree beyond --tolerance.",
    )
    parser.add_argument("--family", default="qwen2_vl", choices=[*FAMILIES, "all"],
                        help="tiny model family (default: qwen2_vl; 'all' runs each)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"], help="tiny model size")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="response length (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="sampling and model seed")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="engine precision, as rollout.dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature; both sides score the tempered distribution (default 1.0)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"max allowed |logprob difference| (default {DEFAULT_TOLERANCE})")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from mmrlhf.testing.engine_check import run_engine_check
    from mmrlhf.testing.tiny_models import FAMILIES, tiny_model_dir

    families = list(FAMILIES) if args.family == "all" else [args.family]
    failures = []
    print(f"{'family':<12} {'case':<11} {'samples':>7} {'tokens':>6} {'max|dlp|':>9} {'mean|dlp|':>9}")
    for family in families:
        t0 = time.perf_counter()
        model_dir = tiny_model_dir(family, args.size, args.seed)
        build_s = time.perf_counter() - t0
        report = run_engine_check(str(model_dir), samples_per_prompt=args.samples,
                                  max_new_tokens=args.max_new_tokens, seed=args.seed, dtype=args.dtype,
                                  temperature=args.temperature)
        for case in report["cases"]:
            n_tok = sum(len(r) for r in case.response_ids)
            print(f"{family:<12} {case.name:<11} {len(case.response_ids):>7} {n_tok:>6} "
                  f"{case.max_abs_diff:>9.1e} {case.mean_abs_diff:>9.1e}")
            if case.max_abs_diff > args.tolerance:
                failures.append(f"{family}/{case.name}: {case.max_abs_diff:.4f} > {args.tolerance}")
        print(f"{family:<12} model {model_dir} (ready in {build_s:.1f} s), engine start "
              f"{report['engine_seconds']:.1f} s, {report['tokens']} tokens in {report['gen_seconds']:.1f} s "
              f"({report['tokens'] / max(report['gen_seconds'], 1e-9):.0f} tok/s)")
        del report
    if failures:
        print("smoke FAILED: vLLM and transformers log-probs disagree: " + "; ".join(failures))
        return 1
    print(f"smoke PASSED: every case within tolerance ({args.tolerance})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from mmrlhf.cli import main

    sys.exit(main(["smoke", *sys.argv[1:]]))
