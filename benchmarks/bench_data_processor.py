"""Time ``MultimodalDataProcessor.process_multimodal_batch`` on growing batches and show where the time goes.

Half the prompts are text-only, half carry one image; every prompt is expanded ``n`` times. The tokenizer and the
HF processor are wrapped in timing proxies, so the table splits the wall time into the HF calls (chat template,
tokenizer, processor) and everything else (our checks, slicing, expansion): the part this package owns, which
must stay a small share and grow linearly.

    python benchmarks/bench_data_processor.py                  # 256, 1024, 4096 prompts, n = 8
    python benchmarks/bench_data_processor.py --sizes 64 256 --repeats 1
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
from PIL import Image


class _Timed:
    """Proxy that adds the time spent in selected methods of ``inner`` to ``clock[label]``."""

    def __init__(self, inner, clock, label):
        self._inner, self._clock, self._label = inner, clock, label

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._clock[self._label] += time.perf_counter() - start

    def apply_chat_template(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner.apply_chat_template(*args, **kwargs)
        finally:
            self._clock["chat template"] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _inputs(size: int, pool: list[Image.Image]):
    prompts, images = [], []
    for i in range(size):
        if i % 2:
            prompts.append(f"<image>What color is the square? Answer with one word. ({i})")
            images.append(pool[i % len(pool)])
        else:
            prompts.append(f"How many objects are in the image? Answer with a number. ({i})")
            images.append(None)
    return prompts, images


def run(sizes, n, repeats, family):
    from transformers import AutoProcessor

    from mmrlhf.config.data import DataConfig
    from mmrlhf.data import MultimodalDataProcessor
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    model_dir = tiny_model_dir(family, "tiny", seed=0)
    hf = AutoProcessor.from_pretrained(model_dir)
    adapter = get_adapter(model_dir)
    rng = np.random.default_rng(0)
    pool = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)) for _ in range(64)]

    # Warm-up (template compilation, first-call setup in the processors) is not what the table measures.
    warm_prompts, warm_images = _inputs(16, pool)
    MultimodalDataProcessor(hf, 4096, adapter).process_multimodal_batch(warm_prompts, warm_images,
                                                                        n_samples_per_prompt=n)
    rows = []
    for size in sizes:
        prompts, images = _inputs(size, pool)
        refs = [str(i) for i in range(size)]
        runs = []
        for _ in range(repeats):
            clock = defaultdict(float)
            proc = MultimodalDataProcessor(
                _Timed(hf, clock, "processor"), 4096, adapter,
                tokenizer=_Timed(hf.tokenizer, clock, "tokenizer"), data_config=DataConfig(prompt_max_len=4096))
            start = time.perf_counter()
            out = proc.process_multimodal_batch(prompts, images, refs, n_samples_per_prompt=n)
            total = time.perf_counter() - start
            assert len(out) == size * n
            parts = [clock.get(k, 0.0) for k in ("chat template", "tokenizer", "processor")]
            runs.append((total, *parts, total - sum(parts)))
        # Other processes on a shared machine only ever ADD time: each column is its fastest run.
        rows.append((size, size * n, *(min(column) for column in zip(*runs))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=7, help="runs per size; each column reports its fastest")
    parser.add_argument("--family", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl"])
    parser.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = parser.parse_args()

    rows = run(args.sizes, args.n, args.repeats, args.family)
    head = (f"{'prompts':>7} {'samples':>7} {'total s':>8} {'template s':>10} {'tokenizer s':>11} "
            f"{'processor s':>11} {'other s':>8} {'other %':>7} {'ms/prompt':>9}")
    print(f"MultimodalDataProcessor, tiny {args.family}, half text / half 1 image (56x56), n = {args.n}; "
          f"each column: fastest of {args.repeats} runs")
    print(head)
    print("-" * len(head))
    for size, samples, total, tmpl, tok, proc, other in rows:
        print(f"{size:>7} {samples:>7} {total:>8.3f} {tmpl:>10.3f} {tok:>11.3f} {proc:>11.3f} {other:>8.3f} "
              f"{100 * other / total:>6.1f}% {1000 * total / size:>9.3f}")
    by_size = {r[0]: r for r in rows}
    scaling = []
    for a, b in zip(args.sizes, args.sizes[1:]):
        ra, rb = by_size[a], by_size[b]
        linear = b / a
        scaling.append([f"{a} -> {b}", linear, rb[2] / ra[2], rb[2] / ra[2] / linear, rb[6] / ra[6] / linear])
        print(f"scaling {a} -> {b} prompts (linear = {linear:.1f}x): total {rb[2] / ra[2]:.2f}x "
              f"({rb[2] / ra[2] / linear:.2f} of linear), other {rb[6] / ra[6]:.2f}x "
              f"({rb[6] / ra[6] / linear:.2f} of linear)")
    if args.json:
        _write_json(args, rows, scaling)


def _write_json(args, rows, scaling) -> None:
    from _results import table, write_json

    big = rows[-1]
    headline = f"{100 * big[6] / big[2]:.1f}% of the time outside the HF calls at {big[0]} prompts"
    if scaling:
        headline += f"; {scaling[-1][0]} prompts: {scaling[-1][3]:.2f} of linear"
    write_json(args.json, "data_processor", headline,
               {"family": args.family, "n": args.n, "repeats": args.repeats},
               [table("Fastest of the repeats per column; 'other' is the time outside the chat template, tokenizer "
                      "and processor calls", ["prompts", "samples", "total s", "HF calls s", "other s", "other %"],
                      [[size, samples, total, tmpl + tok + proc, other, 100 * other / total]
                       for size, samples, total, tmpl, tok, proc, other in rows]),
                table("Scaling (1.00 of linear = time grows exactly with the batch)",
                      ["prompts", "linear x", "total x", "total, of linear", "other, of linear"], scaling)])


if __name__ == "__main__":
    main()
