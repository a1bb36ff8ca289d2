"""Weight-sync benchmark: time to push the actor's weights into the rollout engine (prints a table; not a test).

For random Qwen2-VL models of growing size (``tiny`` and ``small`` from ``mmrlhf.testing.tiny_models``, and
``larger``: the small model with more decoder layers, built here into a temporary folder), one float32 actor and
one engine each; ``mmrlhf.rollout.weight_sync.sync_weights`` (what the trainer calls after every update) is timed
after one warm-up sync. Reported per model: parameters, tensors and bytes moved, seconds per sync (fastest of
``--repeats``), seconds per million parameters, and how time grows against parameters (ratios to the smallest
model, measured in this run).

Engines:
- vLLM (in-process, ``rollout.dtype=auto``: float32 on the CPU). Its sync is split into the load itself (bucketing,
  ``load_weights``), the CPU-only re-packing of the GEMM weights (``vllm_cpu_weights.repack_after_update``; GPU
  vLLM has no such step) and the cache resets that follow every update;
- transformers: the trainer's transformers engine generates with the actor's own module, so a sync copies nothing
  (it only checks names); the column shows that cost.

Sync modes (second table, vLLM only, ``--modes``), side by side on the same model and engine:
- ``full``: the whole float32 state in ONE bucket (what a sync without a bound would hold at once);
- ``bucketed``: the whole state in ``--bucket-mb`` buckets (``rollout.weight_sync_bucket_mb``);
- ``lora_merged``: LoRA (``--lora-rank``, default targets) with random B, ``model.lora.sync=merged``: W + (alpha/r) B A
  of the adapted layers only, under the base names, same bucket bound;
- ``vllm_lora``: the same adapter through vLLM's own LoRA support (``model.lora.sync=vllm_lora``): only A and B
  travel, as a peft folder (saved, then loaded by the engine); its own engine, built with LoRA on.
The last column times one generation after each sync (``--gen``): what the choice costs the rollout.
"MB held" is the largest bucket the sync streamed (the full tensors a sharded trainer must gather at once; for the
adapter: the adapter's size). After each LoRA sync the engine's log-probs of a short generation are compared with the
adapted actor's (fp32), so a row that is fast because it is wrong cannot pass unnoticed.

Run:  python benchmarks/bench_weight_sync.py [--sizes tiny small larger] [--larger-layers 32] [--repeats 3]
      [--modes full bucketed lora_merged vllm_lora] [--bucket-mb 16] [--lora-rank 16]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def larger_model_dir(out: Path, layers: int) -> Path:
    """The small tiny model (tokenizer, processor, widths) with ``layers`` decoder layers and fresh random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from mmrlhf.testing.tiny_models import tiny_model_dir

    small = tiny_model_dir("qwen2_vl", "small", 0)
    shutil.copytree(small, out, dirs_exist_ok=True)
    (out / "mmrlhf_tiny.json").unlink(missing_ok=True)  # not a factory build: no factory metadata
    config = AutoConfig.from_pretrained(out)
    text = config.text_config
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[0]] * layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


class PhaseClock:
    """Adds the time spent in the vLLM engine's re-packing and cache resets to named totals (wrapping, not editing)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"repack": 0.0, "caches": 0.0}

    def _timed(self, name: str, fn):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return wrapper

    @contextlib.contextmanager
    def installed(self, engine: Any) -> Iterator["PhaseClock"]:
        from mmrlhf.rollout import vllm_cpu_weights

        original = vllm_cpu_weights.repack_after_update
        vllm_cpu_weights.repack_after_update = self._timed("repack", original)
        engine._drop_caches = self._timed("caches", engine._drop_caches)
        try:
            yield self
        finally:
            vllm_cpu_weights.repack_after_update = original
            del engine._drop_caches


def measure(path: Path, repeats: int, engines: list[str]) -> dict[str, Any]:
    import torch

    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.weight_sync import sync_weights

    adapter = get_adapter(str(path))
    actor = ActorVL.from_pretrained(str(path), dtype=torch.float32)
    model = actor.model
    row: dict[str, Any] = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    if "vllm" in engines:
        from mmrlhf.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(str(path), adapter, max_model_len=256, dtype="auto")
        try:
            first = sync_weights(model, engine)  # warm-up (first-touch allocations)
            runs = []
            for _ in range(repeats):
                clock = PhaseClock()
                with clock.installed(engine):
                    m = sync_weights(model, engine)
                runs.append((m["sync/seconds"], clock.seconds["repack"], clock.seconds["caches"]))
            best = min(runs)
            row.update(tensors=int(first["sync/tensors"]), mb=first["sync/megabytes"], vllm_s=best[0],
                       vllm_repack_s=best[1], vllm_caches_s=best[2])
        finally:
            engine.close()
            del engine
            gc.collect()
    if "transformers" in engines:
        from mmrlhf.rollout.hf_engine import HFGenerateEngine

        tok_cfg = model.config.text_config
        hf = HFGenerateEngine(model, adapter, eos_token_id=tok_cfg.eos_token_id, pad_token_id=tok_cfg.pad_token_id)
        sync_weights(model, hf)
        row["hf_s"] = min(sync_weights(model, hf)["sync/seconds"] for _ in range(repeats))
        row.setdefault("tensors", len(list(model.parameters())))
        row.setdefault("mb", sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    return row


MODES = ["full", "bucketed", "lora_merged", "vllm_lora"]


def _held_mb(weights: list[tuple[str, Any]], bucket_bytes: int) -> float:
    """The largest bucket ``iter_buckets`` (the engines' own bucketing) makes of ``weights``, in MB."""
    from mmrlhf.rollout.base import iter_buckets

    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in iter_buckets(iter(weights), bucket_bytes)]
    return max(sizes) / 2**20


def _check_logprobs(engine: Any, actor: Any, tokenizer: Any) -> float:
    """Max |engine - actor| log-prob over a short text generation (fp32 both sides): the sync is right or not."""
    import torch

    from mmrlhf.experience.samples import build_padded_samples
    from mmrlhf.rollout.types import GenerationRequest, SamplingSettings

    prompt = tokenizer("What do you see?")["input_ids"]
    out = engine.generate([GenerationRequest(prompt="What do you see?", prompt_token_ids=prompt)],
                          SamplingSettings(n=2, max_new_tokens=8, seed=1)).outputs[0]
    built = build_padded_samples([prompt] * len(out.completions), [c.token_ids for c in out.completions],
                                 pad_id=tokenizer.pad_token_id, eos_id=[], adapter=actor.adapter,
                                 vision=[{} for _ in out.completions])
    with torch.no_grad():
        lp = actor(built.samples).log_probs  # [n, A]
    return max(float((lp[i, :len(c.logprobs)] - torch.tensor(c.logprobs)).abs().max())
               for i, c in enumerate(out.completions))


def _generate_seconds(engine: Any, tokenizer: Any, prompts: int, tokens: int, repeats: int = 2) -> float:
    """Wall time (fastest of ``repeats``) of one generation of ``prompts`` x ``tokens`` forced-length tokens: what
    the sync mode costs the rollout (a vLLM LoRA adapter adds its A/B matmuls to every forward)."""
    from mmrlhf.rollout.types import GenerationRequest, SamplingSettings

    reqs = [GenerationRequest(prompt=f"Describe picture {i}.", prompt_token_ids=tokenizer(f"Describe picture {i}.")[
        "input_ids"]) for i in range(prompts)]
    settings = SamplingSettings(n=1, max_new_tokens=tokens, min_new_tokens=tokens, seed=0, logprobs=False)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate(reqs, settings)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_modes(path: Path, repeats: int, modes: list[str], bucket_mb: int, lora_rank: int,
                  gen: tuple[int, int]) -> dict[str, Any]:
    """One row per sync mode: tensors, MB moved, MB held at once, seconds (fastest of ``repeats``), log-prob check,
    and the time of one ``gen`` = (prompts, tokens) generation after the sync."""
    import torch
    from transformers import AutoTokenizer

    from mmrlhf.config.model import LoraConfig
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.lora import adapter_weights, apply_lora, merged_weights
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.rollout.weight_sync import policy_weights, sync_weights

    actor = ActorVL.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    rows: dict[str, Any] = {}

    def timed(engine: Any) -> tuple[dict[str, float], float]:
        first = sync_weights(actor.model, engine)
        return first, min(sync_weights(actor.model, engine)["sync/seconds"] for _ in range(repeats))

    engine = VLLMEngine(str(path), actor.adapter, max_model_len=256, dtype="float32")
    try:
        full_state = list(policy_weights(actor.model, only_trainable=False))
        total = sum(t.numel() * t.element_size() for _, t in full_state)
        for mode, bucket in (("full", total + 1), ("bucketed", bucket_mb << 20)):
            if mode in modes:
                engine.bucket_bytes = bucket
                first, best = timed(engine)
                rows[mode] = dict(tensors=int(first["sync/tensors"]), mb=first["sync/megabytes"],
                                  held_mb=_held_mb(full_state, bucket), s=best, check=None,
                                  gen_s=_generate_seconds(engine, tokenizer, *gen))
        engine.bucket_bytes = bucket_mb << 20
        apply_lora(actor, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in actor.model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)  # a trained adapter is not zero
        if "lora_merged" in modes:
            first, best = timed(engine)
            rows["lora_merged"] = dict(tensors=int(first["sync/tensors"]), mb=first["sync/megabytes"],
                                       held_mb=_held_mb(list(merged_weights(actor.model)), bucket_mb << 20), s=best,
                                       check=_check_logprobs(engine, actor, tokenizer),
                                       gen_s=_generate_seconds(engine, tokenizer, *gen))
    finally:
        engine.close()
        del engine
        gc.collect()
    if "vllm_lora" in modes:
        engine = VLLMEngine(str(path), actor.adapter, max_model_len=256, dtype="float32", lora_rank=lora_rank)
        try:
            first, best = timed(engine)
            ab = adapter_weights(actor.model)
            rows["vllm_lora"] = dict(tensors=int(first["sync/tensors"]), mb=first["sync/megabytes"],
                                     held_mb=sum(t.numel() * t.element_size() for _, t in ab) / 2**20, s=best,
                                     check=_check_logprobs(engine, actor, tokenizer),
                                     gen_s=_generate_seconds(engine, tokenizer, *gen))
        finally:
            engine.close()
            del engine
            gc.collect()
    return rows


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small", "larger"], choices=["tiny", "small", "larger"])
    ap.add_argument("--larger-layers", type=int, default=32, help="decoder layers of the 'larger' model")
    ap.add_argument("--repeats", type=int, default=3, help="timed syncs per model; the fastest is reported")
    ap.add_argument("--engines", nargs="+", default=["vllm", "transformers"], choices=["vllm", "transformers"])
    ap.add_argument("--modes", nargs="*", default=MODES, choices=MODES,
                    help="sync modes compared in the second table (vLLM; none: skip it)")
    ap.add_argument("--bucket-mb", type=int, default=16, help="bucket bound of the bucketed and LoRA rows")
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the LoRA rows (alpha = 2 x rank)")
    ap.add_argument("--gen", nargs=2, type=int, default=[16, 64], metavar=("PROMPTS", "TOKENS"),
                    help="generation timed after each mode's sync (prompts x forced-length tokens)")
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = ap.parse_args()

    from mmrlhf.testing.tiny_models import tiny_model_dir

    rows, mode_rows = {}, {}
    with tempfile.TemporaryDirectory(prefix="mmrlhf-sync-bench-") as tmp:
        for size in args.sizes:
            path = (larger_model_dir(Path(tmp) / "larger", args.larger_layers) if size == "larger"
                    else tiny_model_dir("qwen2_vl", size, 0))
            rows[size] = measure(path, args.repeats, args.engines)
            print(f"{size}: {json.dumps({k: round(v, 4) for k, v in rows[size].items()})}", flush=True)
            if args.modes and "vllm" in args.engines:
                mode_rows[size] = measure_modes(path, args.repeats, args.modes, args.bucket_mb, args.lora_rank,
                                               tuple(args.gen))
                print(f"{size} modes: {json.dumps(mode_rows[size], default=float)}", flush=True)

    base = rows[args.sizes[0]]
    vllm = "vllm" in args.engines
    head = ["model", "params M", "tensors", "MB moved", "param ratio"]
    if vllm:
        head += ["vLLM s / sync", "vLLM s / M params", "vLLM MB/s", "time ratio", "load %", "repack %", "caches %"]
    if "transformers" in args.engines:
        head += ["transformers s / sync"]
    table_rows = []
    for size, r in rows.items():
        cells: list[Any] = [size, r["params_m"], r["tensors"], r["mb"], r["params_m"] / base["params_m"]]
        if vllm:
            s = r["vllm_s"]
            load = s - r["vllm_repack_s"] - r["vllm_caches_s"]
            cells += [s, s / r["params_m"], r["mb"] / s, s / base["vllm_s"], 100 * load / s,
                      100 * r["vllm_repack_s"] / s, 100 * r["vllm_caches_s"] / s]
        if "transformers" in args.engines:
            cells += [r["hf_s"]]
        table_rows.append(cells)

    print(f"\nsync_weights, float32 actor -> engine (vLLM dtype auto), qwen2_vl random models; fastest of "
          f"{args.repeats} syncs after a warm-up; torch threads {torch.get_num_threads()}")
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |")
    for cells in table_rows:
        print("| " + " | ".join(c if isinstance(c, str) else (str(c) if isinstance(c, int) else f"{c:.4g}")
                                for c in cells) + " |")
    last = rows[args.sizes[-1]]
    if vllm and len(rows) > 1:
        headline = (f"vLLM sync {last['vllm_s'] / last['params_m']:.3g} s per M params at "
                    f"{last['params_m']:.0f} M; {last['params_m'] / base['params_m']:.0f}x the parameters took "
                    f"{last['vllm_s'] / base['vllm_s']:.1f}x the time; CPU re-pack "
                    f"{100 * last['vllm_repack_s'] / last['vllm_s']:.0f}% of it")
    elif vllm:
        headline = f"vLLM sync {last['vllm_s'] / last['params_m']:.3g} s per M params at {last['params_m']:.0f} M"
    else:
        headline = f"transformers sync {last['hf_s']:.3g} s (shared module: nothing copied)"
    print(headline)
    mode_head = ["model", "mode", "tensors", "MB moved", "MB held at once", "s / sync", "MB moved vs full",
                 "time vs full", "max |engine - actor| log-prob", "generate s"]
    mode_table = []
    for size, modes in mode_rows.items():
        ref = modes.get("full") or next(iter(modes.values()))
        for mode, r in modes.items():
            mode_table.append([size, mode, r["tensors"], r["mb"], r["held_mb"], r["s"], r["mb"] / ref["mb"],
                               r["s"] / ref["s"], "-" if r["check"] is None else f"{r['check']:.1e}", r["gen_s"]])
    if mode_table:
        print(f"\nsync modes, float32 actor -> float32 vLLM engine; bucket {args.bucket_mb} MB, LoRA rank "
              f"{args.lora_rank} (alpha {2 * args.lora_rank}) on the default targets; fastest of {args.repeats}; "
              f"generate: {args.gen[0]} prompts x {args.gen[1]} tokens after the sync")
        print("| " + " | ".join(mode_head) + " |")
        print("| " + " | ".join(["---", "---"] + ["---:"] * (len(mode_head) - 2)) + " |")
        for cells in mode_table:
            print("| " + " | ".join(c if isinstance(c, str) else (str(c) if isinstance(c, int) else f"{c:.4g}")
                                    for c in cells) + " |")
        big = mode_rows[args.sizes[-1]]
        if "full" in big and "lora_merged" in big:
            headline += (f"; LoRA merged moves {100 * big['lora_merged']['mb'] / big['full']['mb']:.0f}% of the "
                         f"bytes in {big['lora_merged']['s'] / big['full']['s']:.2f}x the time of a full sync")
        print(headline)
    if args.json:
        from _results import table, write_json

        write_json(args.json, "weight_sync", headline,
                   {"sizes": " ".join(args.sizes), "larger_layers": args.larger_layers, "repeats": args.repeats,
                    "modes": " ".join(args.modes), "bucket_mb": args.bucket_mb, "lora_rank": args.lora_rank,
                    "generate": f"{args.gen[0]}x{args.gen[1]}",
                    "actor_dtype": "float32", "vllm_dtype": "auto", "torch_threads": torch.get_num_threads()},
                   [table("sync_weights per model (time columns: fastest sync; ratios against the first model)",
                          head, table_rows)]
                   + ([table("sync modes (full state one bucket, bucketed, LoRA merged, vLLM LoRA adapter)",
                             mode_head, mode_table)] if mode_table else []))


if __name__ == "__main__":
    main()
