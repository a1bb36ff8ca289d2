"""Benchmarks of the model-side forward math (prints tables; not a test).

(i)  memory: peak extra process memory of chunked log-probs + entropy vs the naive full-logits computation with a
     151,936-token vocabulary (hidden 512). Each measurement runs in a fresh subprocess and reports the growth of
     the peak resident set (ru_maxrss) over the resident set just before the computation, so every allocation
     counts, whatever allocator made it. The naive side is measured at a moderate token count (its [N, V] float32
     tensors are several GB on a shared machine) and extrapolated linearly to ~8k tokens; the chunked side is
     measured at every size. Results of both are compared at the measured size.
(ii) throughput: ActorVL log-probs of a batch with skewed response lengths (16..512) on the "small" tiny model,
     packed layout vs padded layout (same samples; max |difference| reported).

Usage:  python benchmarks/bench_logprobs.py [--part memory|throughput|all] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

VOCAB, HIDDEN = 151_936, 512


# ---- (i) memory ---------------------------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _measure(method: str, tokens: int, chunk: int, backward: bool) -> dict:
    """Runs in a child process: peak RSS growth (MB) of one computation, plus a checksum of its results."""
    import torch

    from mmrlhf.models.logprobs import chunked_log_probs, naive_log_probs

    torch.manual_seed(0)
    h = torch.randn(tokens, HIDDEN).requires_grad_(backward)  # [N, H]
    w = torch.randn(VOCAB, HIDDEN).mul_(0.02).requires_grad_(backward)  # [V, H] (in place: no temporary peak)
    t = torch.randint(0, VOCAB, (tokens,))  # [N]
    base = _rss_mb()
    if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 > base + 16:
        raise RuntimeError("setup left a peak above the current RSS: the measurement would hide small peaks")
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if method == "naive":
            logp, ent = naive_log_probs(h, w, t)
        else:
            logp, ent = chunked_log_probs(h, w, t, chunk_size=chunk, return_entropy=True)
        if backward:
            (logp.sum() + ent.sum()).backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"peak_mb": peak - base, "seconds": seconds, "logp": logp.detach()[:2048].tolist(),
           "ent": ent.detach()[:2048].tolist()}
    if backward:
        out["grad_h"] = h.grad[:64].flatten().tolist()
    return out


def _child(method: str, tokens: int, chunk: int, backward: bool) -> dict:
    code = (f"import json,sys; sys.path.insert(0, {repr(sys.path[0])}); import bench_logprobs as b; "
            f"print(json.dumps(b._measure({method!r}, {tokens}, {chunk}, {backward})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_memory(quick: bool, modes: tuple[str, ...] = ("forward", "fwd+bwd"),
                 target_tokens: int | None = None) -> list[list]:
    """Prints the table; returns its rows (mode, tokens, naive MB, chunked MB, chunked / naive %, extrapolated)."""
    chunk = 512
    rows = []
    naive_sizes = [512, 1024] if quick else [1024, 2048]
    print(f"\n(i) log-probs + entropy memory, vocab {VOCAB}, hidden {HIDDEN}, chunk {chunk} "
          f"(peak RSS growth over the inputs, MB)")
    print(f"{'mode':<9}{'tokens':>8}{'naive MB':>11}{'chunked MB':>12}{'ratio':>8}{'naive s':>9}{'chunk s':>9}"
          f"{'max|dlogp|':>12}{'max|dH|':>10}{'max|dgrad_h|':>14}")
    for backward in (False, True):
        mode = "fwd+bwd" if backward else "forward"
        if mode not in modes:
            continue
        # fwd+bwd costs 3 lm_head matmuls per token on 2 CPU cores: a smaller extrapolation target keeps it short
        target = (4096 if quick else 8192) if not backward else (2048 if quick else 4096)
        target = target_tokens or target
        naive_peaks = []
        for n in naive_sizes:
            a, b = _child("naive", n, chunk, backward), _child("chunked", n, chunk, backward)
            naive_peaks.append(a["peak_mb"])
            rows.append([mode, n, a["peak_mb"], b["peak_mb"], 100 * b["peak_mb"] / a["peak_mb"], "measured"])
            dl = max(abs(x - y) for x, y in zip(a["logp"], b["logp"]))
            de = max(abs(x - y) for x, y in zip(a["ent"], b["ent"]))
            dg = f"{max(abs(x - y) for x, y in zip(a['grad_h'], b['grad_h'])):.2e}" if backward else "-"
            print(f"{mode:<9}{n:>8}{a['peak_mb']:>11.0f}{b['peak_mb']:>12.0f}{b['peak_mb'] / a['peak_mb']:>8.1%}"
                  f"{a['seconds']:>9.2f}{b['seconds']:>9.2f}{dl:>12.2e}{de:>10.2e}{dg:>14}")
        if target <= naive_sizes[-1]:  # nothing beyond the measured sizes to extrapolate to
            continue
        # naive memory is linear in tokens: extrapolate from the two measured sizes
        slope = (naive_peaks[1] - naive_peaks[0]) / (naive_sizes[1] - naive_sizes[0])
        naive_target = naive_peaks[1] + slope * (target - naive_sizes[1])
        c = _child("chunked", target, chunk, backward)
        rows.append([mode, target, naive_target, c["peak_mb"], 100 * c["peak_mb"] / naive_target,
                     "naive extrapolated"])
        print(f"{mode:<9}{target:>8}{naive_target:>10.0f}*{c['peak_mb']:>12.0f}{c['peak_mb'] / naive_target:>8.1%}"
              f"{'-':>9}{c['seconds']:>9.2f}")
    print("  * naive extrapolated linearly from its two measured sizes (its [N, V] float32 logits alone are "
          f"{8192 * VOCAB * 4 / 2**20:.0f} MB at 8192 tokens; measuring it would take most of this shared machine)")
    return rows


# ---- (ii) throughput ----------------------------------------------------------------------------------------
def skewed_lengths(batch: int, low: int = 16, high: int = 512, seed: int = 0) -> list[int]:
    """Log-uniform lengths squared toward the short end (most short, a few long), always spanning low..high."""
    import random

    rng = random.Random(seed)
    span = math.log(high / low)
    lengths = [int(low * math.exp(span * rng.random() ** 2)) for _ in range(batch - 2)] + [low, high]
    rng.shuffle(lengths)
    return lengths


def bench_throughput(quick: bool) -> list[list]:
    """Prints the table; returns its rows (layout, tokens in, best s, real tok/s, speed-up vs padded)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.engine_check import default_cases, processor_inputs
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir("qwen2_vl", "small", 0)
    processor = AutoProcessor.from_pretrained(path)
    adapter = get_adapter(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    actor = ActorVL(model, adapter)
    cases = [dict(processor_inputs(processor, adapter, c)) for c in default_cases(processor)]
    batch = 8 if quick else 16
    lengths = skewed_lengths(batch)
    g = torch.Generator().manual_seed(0)
    vocab, eos = model.config.text_config.vocab_size, processor.tokenizer.eos_token_id
    banned = torch.tensor(adapter.vision_special_token_ids() + [eos])
    prompts, responses, vision = [], [], []
    for i, n in enumerate(lengths):
        x = cases[i % len(cases)]
        prompts.append(x["input_ids"][0].tolist())
        vision.append({k: v for k, v in x.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")})
        toks = torch.randint(0, vocab, (n,), generator=g)
        toks[torch.isin(toks, banned)] = 7  # never a stop / vision token inside the response
        toks[-1] = eos
        responses.append(toks.tolist())
    kw = dict(pad_id=processor.tokenizer.pad_token_id, eos_id=eos, adapter=adapter, vision=vision)
    padded, packed = build_padded_samples(prompts, responses, **kw), build_packed_samples(prompts, responses, **kw)
    real = int(packed.samples.sequences.shape[1])
    results = {}
    for name, built in (("padded", padded), ("packed", packed)):
        times = []
        for _ in range(2 if quick else 3):
            t0 = time.perf_counter()
            with torch.no_grad():
                out = actor(built.samples, vision_extra=built.vision_extra)
            times.append(time.perf_counter() - t0)
        results[name] = (min(times), out.log_probs, int(built.samples.sequences.numel()))
    diff = float((results["packed"][1] - results["padded"][1]).abs().max())
    print(f"\n(ii) ActorVL log-probs, small qwen2_vl ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M "
          f"params, float32, {torch.get_num_threads()} threads), batch {batch}, response lengths "
          f"{min(lengths)}..{max(lengths)} (mean {sum(lengths) / batch:.0f})")
    print(f"{'layout':<8}{'tokens in':>10}{'best s':>9}{'real tok/s':>12}")
    for name in ("padded", "packed"):
        sec, _, tokens = results[name]
        print(f"{name:<8}{tokens:>10}{sec:>9.2f}{real / sec:>12.0f}")
    print(f"speed-up packed / padded: {results['padded'][0] / results['packed'][0]:.2f}x   "
          f"max |log-prob difference|: {diff:.2e}")
    return [[name, results[name][2], results[name][0], real / results[name][0],
             results["padded"][0] / results[name][0], diff if name == "packed" else None]
            for name in ("padded", "packed")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["memory", "throughput", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--memory-modes", nargs="+", choices=["forward", "fwd+bwd"], default=["forward", "fwd+bwd"])
    parser.add_argument("--memory-target", type=int, help="tokens of the extrapolated row (default 8192 forward, "
                        "4096 fwd+bwd; half with --quick; one at or below the measured sizes adds no row)")
    parser.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = parser.parse_args()
    memory = None
    if args.part in ("memory", "all"):
        memory = bench_memory(args.quick, tuple(args.memory_modes), args.memory_target)
    throughput = bench_throughput(args.quick) if args.part in ("throughput", "all") else None
    if args.json:
        _write_json(args, memory, throughput)


def _write_json(args, memory, throughput) -> None:
    from _results import table, write_json

    tables, headline = [], []
    if memory:
        largest = max(memory, key=lambda r: (r[0] == "forward", r[1]))
        headline.append(f"chunked log-probs peak {largest[4]:.1f}% of full logits' at {largest[1]} tokens "
                        f"({largest[0]})")
        tables.append(table(f"Peak memory growth of log-probs + entropy, vocab {VOCAB}, hidden {HIDDEN} (MB)",
                            ["mode", "tokens", "full logits MB", "chunked MB", "chunked / full %", "full side"],
                            memory))
    if throughput:
        headline.append(f"packed / padded log-prob throughput {throughput[1][4]:.2f}x")
        tables.append(table("ActorVL log-probs, small qwen2_vl, skewed response lengths (16..512)",
                            ["layout", "tokens in", "best s", "real tok/s", "speed-up vs padded",
                             "max |dlogp|"], throughput))
    write_json(args.json, "logprobs", "; ".join(headline), {"part": args.part, "quick": args.quick}, tables)


if __name__ == "__main__":
    main()
