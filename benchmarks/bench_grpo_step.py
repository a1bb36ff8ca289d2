"""GRPO step-time breakdown (prints a Markdown table; not a test).

Runs the toy-shapes recipe (``examples/grpo_toy_shapes_cpu.yaml``: 16 prompts x 16 samples, vLLM rollouts) for a
few warm-up steps, then times ``--steps`` steps and reports each phase's share of the step:

- generate: the engine's generation (vLLM or transformers);
- forwards: the no-grad actor / reference / critic scoring forwards of the experience maker;
- update: the policy (and critic) forward + backward + optimiser steps;
- sync: pushing the updated weights into the engine;
- other: prompts, rewards, sample building, advantages, bookkeeping.

With ``--shared-prompt both`` (the default) it runs the recipe twice, ``trainer.shared_prompt`` off then on, and
prints both breakdowns side by side with the off/on ratio per phase.

Run:  python benchmarks/bench_grpo_step.py [--size tiny|small] [--steps 10] [--shared-prompt both|true|false]
      [overrides ...]
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


def timed_run(args, shared_prompt: str):
    """(config, per-phase breakdown) of one run of the recipe with ``trainer.shared_prompt=<shared_prompt>``."""
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.trainer.builder import build_trainer

    with tempfile.TemporaryDirectory() as out:
        config = load_config(args.recipe, [
            f"model.pretrain={tiny_model_dir('qwen2_vl', args.size)}", f"trainer.output_dir={out}",
            f"trainer.max_steps={args.warmup + args.steps}", "trainer.eval_steps=0", "trainer.report_steps=0",
            "trainer.save_steps=100000", "trainer.progress_bar=false", "trainer.tensorboard=false",
            f"trainer.shared_prompt={shared_prompt}", *args.overrides])
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
        trainer.p.source.maker.engine.close()
    return config, breakdown(rows)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--recipe", default="examples/grpo_toy_shapes_cpu.yaml")
    ap.add_argument("--shared-prompt", default="both", choices=["both", "true", "false"],
                    help="trainer.shared_prompt of the run; both: off then on, side by side")
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    modes = ["false", "true"] if args.shared_prompt == "both" else [args.shared_prompt]
    results = {}
    for mode in modes:
        config, results[mode] = timed_run(args, mode)
    cpu = platform.processor() or platform.machine()
    samples = config.trainer.rollout_batch_size * config.rollout.n_samples_per_prompt
    print(f"qwen2_vl {args.size}; {config.trainer.rollout_batch_size} prompts x {config.rollout.n_samples_per_prompt}"
          f" samples = {samples} per step, {config.rollout.max_new_tokens} new tokens, engine "
          f"{config.rollout.engine}; {args.steps} timed steps after {args.warmup} warm-up; torch threads "
          f"{torch.get_num_threads()}; {cpu}")
    print()
    names = {"false": "shared prompt off", "true": "shared prompt on"}
    print("| phase | " + " | ".join(f"{names[m]}: s / step | share" for m in modes)
          + (" | off / on |" if len(modes) == 2 else " |"))
    print("| --- |" + " ---: | ---: |" * len(modes) + (" ---: |" if len(modes) == 2 else ""))
    for name in ("generate", "forwards", "update", "sync", "other", "step"):
        cells = []
        for m in modes:
            b = results[m]
            cells.append(f"{b[name]:.3f} | {100 * b[name] / b['step']:.1f}%")
        ratio = ""
        if len(modes) == 2:
            ratio = f" {results['false'][name] / max(results['true'][name], 1e-9):.2f}x |"
        label = f"**{name}**" if name == "step" else name
        print(f"| {label} | " + " | ".join(cells) + " |" + ratio)
    if args.json:
        from _results import table, write_json

        phases = ("generate", "forwards", "update", "sync", "other", "step")
        columns = ["phase"] + [f"{names[m]}: {c}" for m in modes for c in ("s / step", "share %")]
        rows = [[n] + [v for m in modes for v in (results[m][n], 100 * results[m][n] / results[m]["step"])]
                for n in phases]
        if len(modes) == 2:
            columns.append("off / on")
            for row, n in zip(rows, phases):
                row.append(results["false"][n] / max(results["true"][n], 1e-9))
            headline = (f"shared prompt on: step {results['false']['step'] / results['true']['step']:.2f}x faster, "
                        f"forwards {results['false']['forwards'] / max(results['true']['forwards'], 1e-9):.2f}x, "
                        f"update {results['false']['update'] / max(results['true']['update'], 1e-9):.2f}x")
        else:
            b = results[modes[0]]
            top = max(phases[:-1], key=lambda n: b[n])
            headline = f"{top} {100 * b[top] / b['step']:.0f}% of a GRPO step"
        write_json(args.json, "grpo_step", f"{headline} (qwen2_vl {args.size}, {samples} samples)",
                   {"size": args.size, "samples": samples, "new_tokens": config.rollout.max_new_tokens,
                    "engine": config.rollout.engine, "steps": args.steps, "warmup": args.warmup,
                    "shared_prompt": args.shared_prompt, "overrides": " ".join(args.overrides)},
                   [table("Mean seconds per timed step by phase", columns, rows)])


if __name__ == "__main__":
    main()
