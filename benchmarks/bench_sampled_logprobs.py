"""What ``rollout.logprob_mode: sampled`` costs over ``full``: chunked log-probs + entropy of 2,048 tokens over the
real Qwen vocabulary (151,936), truncated as the engine truncates (top-k / top-p / min-p) vs untruncated, time and
peak memory, side by side in one run (prints a table; not a test).

The cost depends on the logits: top-k is one ``topk`` per row; top-p takes the 256 largest logits first and only
rows whose nucleus is larger (a flat distribution) fall back to a wider ``topk`` or a sort of the row. So two
kinds of rows are measured: ``peaked`` (hidden states near a few token rows of the head, as a trained model's are:
entropy ~1.6 nats, a top-p 0.95 nucleus of ~6 tokens at the median) and ``flat`` (random hidden states: entropy
~11.4 nats, a nucleus of ~100k tokens), the worst case. Each measurement runs in a fresh subprocess; memory is the
growth of the peak resident set over the inputs (every allocation counts), time the best of ``--repeats``. The last
column is the mean kept mass of the rows: the mean importance ratio pi / mu a ``full`` trainer sees on-policy.

Usage:  python benchmarks/bench_sampled_logprobs.py [--tokens 2048] [--hidden 1024] [--repeats 2]
            [--rows peaked flat] [--modes forward fwd+bwd] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

VOCAB = 151_936
SETTINGS = {  # name -> (top_k, top_p, min_p); None: the full distribution
    "full": None,
    "top_k 20, top_p 0.8": (20, 0.8, 0.0),  # Qwen3-VL's recommended sampling
    "top_p 0.95": (-1, 0.95, 0.0),
    "top_k 50": (50, 1.0, 0.0),
    "min_p 0.05": (-1, 1.0, 0.05),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _inputs(tokens: int, hidden: int, kind: str):
    """hidden [N, H], head [V, H], targets [N] drawn from the (untruncated) distribution's top tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, hidden, generator=g).mul_(hidden ** -0.5)  # [V, H] rows of norm ~1
    if kind == "flat":
        h = torch.randn(tokens, hidden, generator=g)  # [N, H] logits ~ N(0, 1): entropy ~ log V
    else:  # each position leans towards 32 tokens with logits ~16 - 0.4 j (a geometric head), over noise
        picks = torch.randint(0, VOCAB, (tokens, 32), generator=g)  # [N, 32]
        lean = 16.0 - 0.4 * torch.arange(32.0)  # [32]
        h = (w[picks] * lean[:, None]).sum(1) + torch.randn(tokens, hidden, generator=g) * 0.5  # [N, H]
    with torch.no_grad():
        top = (h[:256] @ w.T).topk(3, dim=-1).indices  # [256, 3]
    targets = top[torch.arange(tokens) % 256, torch.arange(tokens) % 3]  # [N] likely tokens, as samples are
    return h, w, targets


def _measure(setting: str, kind: str, tokens: int, hidden: int, backward: bool, repeats: int) -> dict:
    """Runs in a child process: best time and peak RSS growth of one setting."""
    import torch

    from mmrlhf.models.logprobs import chunked_sampled_log_probs
    from mmrlhf.models.truncation import Truncation

    h, w, t = _inputs(tokens, hidden, kind)
    h.requires_grad_(backward)
    w.requires_grad_(backward)
    spec = SETTINGS[setting]
    truncation = None if spec is None else Truncation(top_k=spec[0], top_p=spec[1], min_p=spec[2])
    base = _rss_mb()
    times = []
    for _ in range(repeats):
        h.grad = w.grad = None
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = chunked_sampled_log_probs(h, w, t, chunk_size=1024, return_entropy=True, truncation=truncation)
            if backward:
                (out.log_probs.sum() + out.entropy.sum()).backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": min(times), "peak_mb": peak - base, "entropy": float(out.entropy.mean()),
            "outside": out.outside.tolist(), "logp": out.log_probs.detach().tolist(),
            "threads": torch.get_num_threads()}


def _child(*args) -> dict:
    code = (f"import json,sys; sys.path.insert(0, {repr(sys.path[0])}); import bench_sampled_logprobs as b; "
            f"print(json.dumps(b._measure(*{args!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(tokens: int, hidden: int, repeats: int, kinds: list[str], modes: list[str]) -> list[list]:
    rows = []
    print(f"\nsampled vs full log-probs + entropy: {tokens} tokens, vocabulary {VOCAB}, hidden {hidden}, chunk 1024 "
          "(best of {repeats}; memory: peak RSS growth over the inputs)".replace("{repeats}", str(repeats)))
    print(f"{'rows':<7}{'mode':<9}{'setting':<22}{'entropy':>8}{'s':>8}{'vs full':>9}{'MB':>8}{'vs full':>9}"
          f"{'kept mass':>10}")
    for kind in kinds:
        for mode in modes:
            backward = mode == "fwd+bwd"
            full = None
            for setting in SETTINGS:
                r = _child(setting, kind, tokens, hidden, backward, repeats)
                full = full or r
                dt, dm = r["seconds"] / full["seconds"] - 1, r["peak_mb"] - full["peak_mb"]
                # exp(log p_full - log p_sampled) of a token inside its kept set is its row's kept mass: the mean
                # importance ratio pi / mu a `full` trainer sees on-policy (1 under `sampled`)
                kept = [math.exp(f - s) for f, s, out in zip(full["logp"], r["logp"], r["outside"]) if not out]
                mass = sum(kept) / len(kept) if kept else float("nan")
                rows.append([kind, mode, setting, r["entropy"], r["seconds"], 100 * dt, r["peak_mb"], dm, mass])
                print(f"{kind:<7}{mode:<9}{setting:<22}{r['entropy']:>8.2f}{r['seconds']:>8.2f}{dt:>+9.1%}"
                      f"{r['peak_mb']:>8.0f}{dm:>+8.0f}M{mass:>10.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024, help="lm_head input size (the matmul the truncation is "
                        "measured against: a larger model's makes the relative cost smaller)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", nargs="+", choices=["peaked", "flat"], default=["peaked", "flat"])
    parser.add_argument("--modes", nargs="+", choices=["forward", "fwd+bwd"], default=["forward", "fwd+bwd"])
    parser.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = parser.parse_args()
    rows = run(args.tokens, args.hidden, args.repeats, args.rows, args.modes)
    if args.json:
        from _results import table, write_json

        truncated = [r for r in rows if r[2] != "full"]
        peaked = [r for r in truncated if r[0] == "peaked"] or truncated
        worst = max(peaked, key=lambda r: r[5])
        write_json(args.json, "sampled_logprobs",
                   f"sampled log-probs cost at most {worst[5]:+.1f}% time over full on {worst[0]} rows ({worst[2]}, "
                   f"{worst[1]})", vars(args),
                   [table(f"sampled vs full log-probs, {args.tokens} tokens, vocabulary {VOCAB}, hidden {args.hidden}",
                          ["rows", "mode", "setting", "entropy", "best s", "time vs full %", "peak MB",
                           "MB vs full", "mean kept mass"], rows)])


if __name__ == "__main__":
    main()
