"""Asynchronous vs synchronous Ray training: where each side waits (prints a table; not a test).

The toy colour recipe (``examples/grpo_toy_shapes_cpu.yaml``, tiny random Qwen2-VL, vLLM on the CPU) runs in the Ray
mode on a local Ray instance with one rollout actor and one trainer actor, once per ``--staleness`` value
(``distributed.max_staleness``; 0 is synchronous). Reported per run, after ``--warmup`` steps that are not counted:
steps/s, the share of wall time the trainer waited for experiences (``async/trainer_wait_s``) and the share the
rollout actor sat idle between batches (``async/rollout_wait_s``), the mean staleness of the consumed samples and
the last steps' reward. Ratios against the synchronous run are measured in this run; absolute times on a shared
CPU are noise.

With two CPUs, rollout and training compete for the same cores: overlap helps only as far as one side's idle time
covers the other's work (on separate GPUs it is the whole point).

Run:  python benchmarks/bench_async.py [--steps 12] [--warmup 2] [--staleness 0 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parent.parent


def run_once(k: int, steps: int, out: Path, extra: list[str]) -> list[dict[str, float]]:
    """One Ray run with ``max_staleness=k``; the metrics of every step."""
    from mmrlhf.config import load_config
    from mmrlhf.launch.ray.driver import RayRun
    from mmrlhf.testing.tiny_models import tiny_model_dir

    config = load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl', 'tiny', 0)}", f"trainer.output_dir={out}", "trainer.eval_steps=0",
        f"trainer.max_steps={steps}", "distributed.backend=ray", f"distributed.max_staleness={k}", *extra])
    run = RayRun(config)
    try:
        errors = run.setup(resume=False)
        if errors:
            raise RuntimeError("; ".join(errors))
        run.fit()
    finally:
        run.shutdown()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(history: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Counted steps only: their wall time, each side's waits as shares of it, staleness and reward."""
    counted = history[warmup:]
    wall = sum(h["time/step"] for h in counted)
    return {"steps": len(counted), "wall_s": wall, "steps_per_s": len(counted) / wall,
            "trainer_wait_share": sum(h["async/trainer_wait_s"] for h in counted) / wall,
            "rollout_wait_share": sum(h["async/rollout_wait_s"] for h in counted) / wall,
            "staleness_mean": statistics.mean(h["async/staleness_mean"] for h in counted),
            "reward_last": statistics.mean(h["reward/mean"] for h in counted[-5:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="max_staleness values to run")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    parser.add_argument("--json", help="also write the results to this file (benchmarks/_results.py schema)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    import ray

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import print_table, table, write_json

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for k in args.staleness:
            with tempfile.TemporaryDirectory() as tmp:
                results[k] = summarise(run_once(k, args.steps, Path(tmp), ["trainer.overwrite_output_dir=true"]),
                                       args.warmup)
    finally:
        ray.shutdown()
    base = results.get(0)
    columns = ["max_staleness", "steps/s", "speed-up vs k=0", "trainer waits %", "rollout waits %",
               "staleness mean", "reward (last 5)"]
    rows = [[k, round(r["steps_per_s"], 3), round(r["steps_per_s"] / base["steps_per_s"], 2) if base else None,
             round(100 * r["trainer_wait_share"], 1), round(100 * r["rollout_wait_share"], 1),
             round(r["staleness_mean"], 2), round(r["reward_last"], 3)] for k, r in results.items()]
    print(f"Ray toy run, 1 rollout actor + 1 trainer actor, {args.cpus} CPUs, {args.steps - args.warmup} counted "
          f"steps (after {args.warmup} warm-up)")
    print_table(columns, rows)
    if args.json:
        fast = max(results, key=lambda k: results[k]["steps_per_s"])
        headline = (f"k={fast}: {results[fast]['steps_per_s']:.2f} steps/s" +
                    (f" ({results[fast]['steps_per_s'] / base['steps_per_s']:.2f}x sync)" if base else ""))
        write_json(args.json, "async", headline, vars(args), [table("async vs sync", columns, rows)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
