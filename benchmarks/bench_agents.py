"""Multi-turn rollouts, lockstep vs asynchronous (``agent.loop``): rollout seconds per step, the engine's busy share,
the long tail of trajectory times, and whether both loops sampled the same trajectories (prints a table; not a test).

Two cases, each over the tiny tool-calling Qwen2-VL with vLLM on the CPU (float32), the same step run by both loops
side by side (``--repeats`` times each, alternating):

- ``long-tailed``: an environment whose every step takes a log-normal time (median ``--median-ms``, sigma
  ``--sigma``: at 1.4 the p95 is 10x the median), episodes of 1 to 4 steps, turns of varying length (a restricted
  vocabulary with the end of turn in it, capped at ``--turn-tokens``). A step's latency and an episode's length are
  drawn from the trajectory's own content, so both loops meet the same latencies;
- ``agent-toy``: the agent toy's zoom tool (fast, in-process) on the toy task's vocabulary: where tools are quick,
  what the asynchronous loop costs or saves.

The asynchronous loop runs once per gathering window (``--windows``, ``agent.gather_window_s``: by default none and
the config's default), so the window's effect shows beside lockstep in the same run. Each row's seconds are the
median over its steps (the machine is shared: a mean would carry every other job's spikes); the speed-up is the
median of the step-by-step ratios to the lockstep step run beside it.

Targets: >= 1.5x faster rollouts on the long-tailed case (issue 42); never slower than lockstep beyond noise on the
agent toy (issue 53); the same trajectories.

Run:  python benchmarks/bench_agents.py [--prompts 8] [--n 4] [--repeats 2] [--median-ms 50] [--sigma 1.4]
      [--windows 0,0.005]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import print_table, table, write_json  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as the tests run it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class LongTailed:
    """An environment whose steps take a log-normal time and whose episodes last 1 to 4 steps, both drawn from the
    trajectory's content (the same in either loop)."""

    median_s = 0.05
    sigma = 1.4

    def reset(self, record: dict[str, Any]) -> None:
        self.record, self.taken, self.length = str(record.get("id")), 0, None
        return None

    def step(self, action_text: str) -> Any:
        from mmrlhf.agents.types import StepResult, ToolResult

        self.taken += 1
        key = f"{self.record}|{self.taken}|{action_text}"
        if self.length is None:
            self.length = 1 + zlib.crc32(key.encode()) % 4
        time.sleep(random.Random(key).lognormvariate(math.log(self.median_s), self.sigma))
        return StepResult(ToolResult(text=f"observation {self.taken}"), done=self.taken >= self.length)


def default_window() -> float:
    """``agent.gather_window_s``'s default."""
    from mmrlhf.config.agent import AgentConfig

    return AgentConfig.model_fields["gather_window_s"].default


def build(args: argparse.Namespace) -> dict[str, Any]:
    from PIL import Image

    from mmrlhf.agents.builtin_tools import ImageZoom
    from mmrlhf.agents.loop_types import AgentLimits
    from mmrlhf.agents.runner import ToolRunner
    from mmrlhf.agents.types import ToolContext
    from mmrlhf.data.processor import MultimodalDataProcessor
    from mmrlhf.experience.agent_rows import encoder_of
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.testing.tiny_models import TOY_CALL_TOKEN, tiny_model_dir
    from transformers import AutoProcessor

    path = tiny_model_dir("qwen2_vl", tools=True)
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    adapter = get_adapter(path)
    data = MultimodalDataProcessor(processor, 256, adapter)
    engine = VLLMEngine(str(path), adapter, max_model_len=2048, dtype="float32", limit_mm_per_prompt={"image": 8})
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    images = [Image.new("RGB", (112, 112), colours[i % 4]) for i in range(args.prompts)]
    ids = [f"p{i}" for i in range(args.prompts)]
    contexts = []
    data.set_tools(None)
    plain = data.process_multimodal_batch(["<image>What color?"] * args.prompts, [[im] for im in images],
                                          [None] * args.prompts, n_samples_per_prompt=args.n, record_ids=ids)
    zoom_schema = [{"type": "function", "function": {"name": "image_zoom", "description": "zoom",
                                                     "parameters": {"type": "object", "properties": {}}}}]
    data.set_tools(zoom_schema)
    with_tools = data.process_multimodal_batch(["<image>What color?"] * args.prompts, [[im] for im in images],
                                               [None] * args.prompts, n_samples_per_prompt=args.n, record_ids=ids)
    for i, image in enumerate(images):
        grid = with_tools.all_vision_inputs[i * args.n]["image_grid_thw"][0]
        contexts.append(ToolContext(record={"id": ids[i]}, images=[image],
                                    model_image_sizes=[(int(grid[2]) * adapter.patch_size,
                                                        int(grid[1]) * adapter.patch_size)]))
    vocab = len(tok)

    def only(*tokens: str) -> tuple[int, ...]:
        keep = {tok.convert_tokens_to_ids(t) for t in tokens}
        return tuple(i for i in range(vocab) if i not in keep)

    LongTailed.median_s, LongTailed.sigma = args.median_ms / 1000.0, args.sigma
    words = ("red", "green", "blue", "yellow", "the", "square", "is", "a", "<|im_end|>")
    runner = ToolRunner({"image_zoom": ImageZoom()}, workers=args.prompts * args.n, timeout_s=30,
                        max_image_pixels=10**7)
    from mmrlhf.rollout.types import SamplingSettings

    cases = {
        "long-tailed": dict(batch=plain, environment=LongTailed, tools=None,
                            limits=AgentLimits(max_turns=5, max_context_tokens=2048,
                                               max_new_tokens_per_turn=args.turn_tokens),
                            sampling=SamplingSettings(n=args.n, max_new_tokens=args.turn_tokens, seed=1,
                                                      forbidden_token_ids=only(*words))),
        "agent-toy": dict(batch=with_tools, environment=None, tools={"image_zoom": runner.tools["image_zoom"]},
                          limits=AgentLimits(max_turns=3, max_context_tokens=2048, max_new_tokens_per_turn=8),
                          sampling=SamplingSettings(n=args.n, max_new_tokens=8, seed=1,
                                                    forbidden_token_ids=only("red", "green", "blue", "yellow",
                                                                             TOY_CALL_TOKEN, "<|im_end|>"))),
    }
    return {"engine": engine, "tok": tok, "adapter": adapter, "encode": encoder_of(data), "runner": runner,
            "contexts": contexts, "cases": cases}


def run_case(setup: dict[str, Any], case: dict[str, Any], loop_kind: str, seed: int,
             window_s: float = 0.0) -> dict[str, Any]:
    from mmrlhf.agents.rollout import AgentLoop

    tok = setup["tok"]
    # Every run starts cold, as a training step's rollout does after the weight sync (which drops the prefix and
    # multimodal caches): else the second loop of a pair would find the first one's prompts cached (the same seeds
    # sample the same trajectories) and look faster for it.
    setup["engine"]._drop_caches()
    limits = dataclasses.replace(case["limits"], loop=loop_kind, gather_window_s=window_s)
    loop = AgentLoop(setup["engine"], tok, setup["adapter"], setup["encode"], limits, [tok.eos_token_id],
                     setup["runner"], tools=case["tools"], environment=case["environment"])
    t0 = time.perf_counter()
    result = loop.run(case["batch"], case["sampling"].n, dataclasses.replace(case["sampling"], seed=seed),
                      setup["contexts"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "busy": result.metrics["agent/engine_busy_frac"],
            "p95": result.metrics["agent/trajectory_s/p95"], "turns": result.metrics["agent/turns/mean"],
            "ids": [(s.sample_index, s.response_ids) for s in result.samples]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=2, help="steps per loop and case (alternating)")
    parser.add_argument("--median-ms", type=float, default=50.0, help="median environment step latency")
    parser.add_argument("--sigma", type=float, default=1.4, help="log-normal sigma of the latency (1.4: p95 10x)")
    parser.add_argument("--turn-tokens", type=int, default=24, help="cap on one turn's tokens (long-tailed case)")
    parser.add_argument("--windows", default=f"0,{default_window()}",
                        help="gathering windows (seconds, comma-separated) to run the asynchronous loop with")
    parser.add_argument("--json", default=None, help="also write the results here (benchmarks/_results.py)")
    args = parser.parse_args(argv)
    windows = [float(w) for w in args.windows.split(",")]
    # (label, loop, window): lockstep twice, the second the noise floor (two runs of one loop side by side)
    loops = [("lockstep", "lockstep", 0.0), ("lockstep again (noise)", "lockstep", 0.0)]
    loops += [(f"async, window {w * 1000:g} ms", "async", w) for w in windows]
    setup = build(args)
    rows, ratios = [], {}
    try:
        for name, case in setup["cases"].items():
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in loops}
            run_case(setup, case, "async", seed=0)  # warm-up (compilation, caches)
            for r in range(args.repeats):
                for label, kind, window in loops if r % 2 == 0 else loops[::-1]:  # side by side, alternating
                    runs[label].append(run_case(setup, case, kind, seed=1 + r, window_s=window))
            base = runs[loops[0][0]]
            for label, _, _ in loops:
                m = {k: statistics.median(x[k] for x in runs[label]) for k in ("seconds", "busy", "p95", "turns")}
                speedup = statistics.median(b["seconds"] / x["seconds"] for b, x in zip(base, runs[label]))
                same = all(a["ids"] == b["ids"] for a, b in zip(base, runs[label]))
                ratios[(name, label)] = speedup
                rows.append([name, label, round(m["seconds"], 3), round(m["busy"] * 100, 1), round(m["p95"], 3),
                             round(m["turns"], 2), round(speedup, 2), "yes" if same else "NO"])
    finally:
        setup["engine"].close()
        setup["runner"].close()
    columns = ["case", "loop", "rollout s / step", "engine busy %", "p95 trajectory s", "turns / traj",
               "speed-up vs lockstep", "same trajectories"]
    print(f"{args.prompts} prompts x {args.n} samples, {args.repeats} steps per loop (medians); long-tailed latency: "
          f"median {args.median_ms:g} ms, sigma {args.sigma:g}")
    print_table(columns, rows)
    noise = "lockstep again (noise)"
    headline = "; ".join(
        f"async (window {w * 1000:g} ms) {ratios[('long-tailed', f'async, window {w * 1000:g} ms')]:.2f}x lockstep "
        f"on long-tailed tools, {ratios[('agent-toy', f'async, window {w * 1000:g} ms')]:.2f}x on the agent toy"
        for w in windows)
    headline += (f" (lockstep against itself: {ratios[('long-tailed', noise)]:.2f}x and "
                 f"{ratios[('agent-toy', noise)]:.2f}x)")
    print(headline)
    if args.json:
        write_json(args.json, "agents", headline, vars(args), [table("lockstep vs asynchronous", columns, rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
