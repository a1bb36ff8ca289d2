"""Partial rollouts on and off in the asynchronous Ray mode, long answers: where each side waits (prints a table; not
a test).

The toy colour recipe (tiny random Qwen2-VL, vLLM on the CPU) in the Ray mode with one rollout actor and one trainer
actor, ``distributed.max_staleness=1``, with long answers (``--max-new-tokens``, default 48: the random policy
rarely stops, so every answer runs to the cap), once with ``rollout.partial=false`` and once with ``true``
(``--segment`` tokens per segment). Reported per run, after ``--warmup`` steps: steps/s; the rollout actor's idle
time between batches (``async/rollout_wait_s``: the idle engine) and the trainer's wait for experiences
(``async/trainer_wait_s``) as shares of the wall time; the trainer's weight push (``sync/seconds``: without partial
rollouts it waits for the batch in progress to finish); the mean staleness of the consumed samples (oldest token)
and, with partial rollouts, of their tokens, and the share of samples whose tokens span two versions.
Ratios are measured side by side in one run; absolute times on a shared CPU are noise.

Run:  python benchmarks/bench_partial.py [--steps 10] [--warmup 2] [--max-new-tokens 48] [--segment 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import print_table  # noqa: E402
from bench_async import run_once  # noqa: E402  (sets the vLLM CPU environment first)


def summarise(history: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    counted = history[warmup:]
    wall = sum(h["time/step"] for h in counted)
    mean = lambda key: statistics.mean(h.get(key, 0.0) for h in counted)  # noqa: E731
    return {"steps_per_s": len(counted) / wall,
            "rollout_idle_share": sum(h["async/rollout_wait_s"] for h in counted) / wall,
            "trainer_wait_share": sum(h["async/trainer_wait_s"] for h in counted) / wall,
            "push_s": mean("sync/seconds"), "staleness": mean("async/staleness_mean"),
            "token_staleness": mean("partial/token_staleness_mean") if "partial/token_staleness_mean" in counted[0]
            else mean("async/staleness_mean"),
            "spanning": mean("partial/spanning_frac"), "segments": mean("partial/segments_mean")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the long-answer setting")
    parser.add_argument("--segment", type=int, default=8, help="rollout.partial_segment_tokens")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    import ray

    long = [f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.max_model_len={64 + args.max_new_tokens + 16}",
            "trainer.overwrite_output_dir=true", "trainer.progress_bar=false", "trainer.save_steps=1000"]
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for partial in (False, True):
            extra = [*long, f"rollout.partial={str(partial).lower()}", f"rollout.partial_segment_tokens={args.segment}"]
            with tempfile.TemporaryDirectory() as tmp:
                results[partial] = summarise(run_once(1, args.steps, Path(tmp), extra), args.warmup)
    finally:
        ray.shutdown()
    columns = ["rollout.partial", "steps/s", "rollout idle %", "trainer waits %", "push s", "staleness (oldest)",
               "token staleness", "spanning samples %", "segments/call"]
    rows = [[str(p).lower(), round(r["steps_per_s"], 3), round(100 * r["rollout_idle_share"], 1),
             round(100 * r["trainer_wait_share"], 1), round(r["push_s"], 3), round(r["staleness"], 2),
             round(r["token_staleness"], 3), round(100 * r["spanning"], 1), round(r["segments"], 1)]
            for p, r in results.items()]
    print(f"Ray toy run, max_staleness=1, answers up to {args.max_new_tokens} tokens, segments of {args.segment}, "
          f"{args.cpus} CPUs, {args.steps - args.warmup} counted steps (after {args.warmup} warm-up)")
    print_table(columns, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
