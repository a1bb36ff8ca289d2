"""GRPO step-time breakdown (prints a Markdown table; not a test).

Runs the toy-shapes recipe (``examples/grpo_toy_shapes_cpu.yaml``: 16 prompts x 16 samples, vLLM rollouts) for a
few warm-up steps, then times ``--steps`` steps and reports each phase's share of the step:

- generate: the engine's generation (vLLM or transformers);
- forwards: the no-grad actor / reference / critic scoring forwards of the experience maker;
- update: the policy (and critic) forward + backward + optimiser steps;
- sync: pushing the updated weights into the engine;
- other: prompts, rewards, sample building, advantages, bookkeeping.

Run:  python benchmarks/bench_grpo_step.py [--size tiny|small] [--steps 10] [overrides ...]
e.g.  python benchmarks/bench_grpo_step.py --size small rollout.max_new_tokens=16
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PHASES = {
    "generate": ("time/generate",),
    "forwards": ("time/actor", "time/reference", "time/critic"),
    "update": ("time/policy_update", "time/critic_update"),
    "sync": ("time/sync",),
}


def breakdown(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per phase over ``rows`` (metrics of timed steps); ``other`` is the rest of ``time/step``."""
    out = {name: sum(sum(r.get(k, 0.0) or 0.0 for k in keys) for r in rows) / len(rows)
           for name, keys in PHASES.items()}
    step = sum(r["time/step"] for r in rows) / len(rows)
    out["other"] = max(step - sum(out.values()), 0.0)
    out["step"] = step
    return out


def main() -> None:
    import torch

    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.trainer.builder import build_trainer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--recipe", default="examples/grpo_toy_shapes_cpu.yaml")
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as out:
        config = load_config(args.recipe, [
            f"model.pretrain={tiny_model_dir('qwen2_vl', args.size)}", f"trainer.output_dir={out}",
            f"trainer.max_steps={args.warmup + args.steps}", "trainer.eval_steps=0", "trainer.report_steps=0",
            "trainer.save_steps=100000", "trainer.progress_bar=false", "trainer.tensorboard=false",
            *args.overrides])
        trainer = build_trainer(config)
        rows = []
        with trainer.p.tracker:
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                metrics = trainer.train_step()
                trainer.state.step += 1
                metrics["time/step"] = time.perf_counter() - t0
                if i >= args.warmup:
                    rows.append(metrics)
        trainer.p.maker.engine.close()
    b = breakdown(rows)
    cpu = platform.processor() or platform.machine()
    samples = config.trainer.rollout_batch_size * config.rollout.n_samples_per_prompt
    print(f"qwen2_vl {args.size}; {config.trainer.rollout_batch_size} prompts x {config.rollout.n_samples_per_prompt}"
          f" samples = {samples} per step, {config.rollout.max_new_tokens} new tokens, engine "
          f"{config.rollout.engine}; {args.steps} timed steps after {args.warmup} warm-up; torch threads "
          f"{torch.get_num_threads()}; {cpu}")
    print()
    print("| phase | seconds / step | share |")
    print("| --- | ---: | ---: |")
    for name in ("generate", "forwards", "update", "sync", "other"):
        print(f"| {name} | {b[name]:.3f} | {100 * b[name] / b['step']:.1f}% |")
    print(f"| **step** | **{b['step']:.3f}** | 100% |")
    if args.json:
        from _results import table, write_json

        names = ("generate", "forwards", "update", "sync", "other")
        top = max(names, key=lambda n: b[n])
        write_json(args.json, "grpo_step", f"{top} {100 * b[top] / b['step']:.0f}% of a GRPO step (qwen2_vl "
                   f"{args.size}, {samples} samples)",
                   {"size": args.size, "samples": samples, "new_tokens": config.rollout.max_new_tokens,
                    "engine": config.rollout.engine, "steps": args.steps, "warmup": args.warmup,
                    "overrides": " ".join(args.overrides)},
                   [table("Mean seconds per timed step by phase", ["phase", "s / step", "share %"],
                          [[n, b[n], 100 * b[n] / b["step"]] for n in names] + [["step", b["step"], 100.0]])])


if __name__ == "__main__":
    main()
