"""The judge client's own cost, and what its metrics read, against a judge that answers at once (prints tables;
not a test).

A :class:`~mmrlhf.testing.judge_server.FakeJudgeServer` (its own process; it answers instantly, or after
``--delay-ms``) stands in for the judge, so what is measured is the client: ``--prompts`` x ``--samples`` samples
(one ``--image-px`` image per prompt, shared by the prompt's samples as the data processor shares them; 0: text
only) scored by ``JudgeSource`` over the endpoint backend at ``--concurrency``, with distinct answers (nothing
comes from the cache).

Per client and image size: requests/s (wall), the client's CPU ms per request (the process time of the client's
process over the requests: the server's work is in another process, and on a shared machine CPU time holds where
wall time does not), the split into rendering (rubric + image encoding: the whole call less the backend's ``run``)
and HTTP (``run``), and the means of the per-sample ``latency_s`` and ``queue_s`` parts (``queue_s`` does not
exist before).

Before / after: ``--before REV`` (default 722733f, the commit before the client was reworked) extracts the
``mmrlhf`` package at REV with ``git archive`` and runs the same measurement on it; each client runs in a
subprocess of its own, the two alternating ``--repeats`` times against the same server, so both see the same
machine at the same time. ``--before ''`` measures the current tree only. ``--profile`` adds a table of where
each client's time goes (cProfile's own time per category: PNG encoding, JSON, the HTTP library, the socket, ...,
over one extra call per client process).

Run:  python benchmarks/bench_judge_client.py [--prompts 32] [--samples 8] [--image-px 0 448] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is shown in the picture?<|im_end|>\n"
          "<|im_start|>assistant\n")
DEFAULT_BEFORE = "722733f"


# ---- one client, in its own process (the package it imports is the one PYTHONPATH names) ----------------------
def _image(seed: int, px: int):
    """A photo-like picture (smooth, with texture): PNG compresses it about as much as a photograph."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = (rng.random((max(1, px // 8), max(1, px // 8), 3)) * 255).astype(np.uint8)
    return Image.fromarray(coarse).resize((px, px), Image.BILINEAR)


def measure(url: str, prompts: int, samples: int, image_px: int, concurrency: int, rounds: int,
            profile: bool) -> dict:
    """``rounds`` scoring calls of prompts x samples requests (after one warm-up call); per-round figures."""
    import asyncio

    from mmrlhf.rewards.judge.backends import EndpointJudge
    from mmrlhf.rewards.judge.rubric import DEFAULT_RUBRIC
    from mmrlhf.rewards.judge.source import JudgeSource
    from mmrlhf.rewards.types import RewardBatch

    images = [_image(g, image_px) for g in range(prompts)] if image_px else []
    n = prompts * samples
    judge = EndpointJudge(url, "fake", max_tokens=1, top_logprobs=20, max_concurrency=concurrency)
    spent = {"wall": 0.0, "cpu": 0.0}
    run = judge.run

    async def timed_run(requests):  # the HTTP part: everything in the backend
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return await run(requests)
        finally:
            spent["wall"] += time.perf_counter() - wall
            spent["cpu"] += time.process_time() - cpu

    judge.run = timed_run
    source = JudgeSource(judge, name="judge", judge_id="bench", rubric=DEFAULT_RUBRIC, cache_size=0)

    def batch(tag: str) -> RewardBatch:
        return RewardBatch(responses=[f"<think>look</think>answer {tag} {k}" for k in range(n)],
                           prompts=[PROMPT] * n, labels=["vqa"] * n, references=["a reference"] * n,
                           images=[[images[k // samples]] for k in range(n)] if images else None,
                           index=list(range(n)))

    asyncio.run(source.score(batch("warm-up")))
    out = []
    for r in range(rounds):
        data = batch(str(r))
        spent.update(wall=0.0, cpu=0.0)
        wall, cpu = time.perf_counter(), time.process_time()
        scores = asyncio.run(source.score(data))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        errors = [e for e in scores.errors if e]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed; first: {errors[0]}")
        latency = [x for x in scores.parts["latency_s"] if x is not None]
        queue = [x for x in scores.parts.get("queue_s", []) if x is not None]
        out.append({"requests": n, "wall_s": wall, "cpu_s": cpu, "http_wall_s": spent["wall"],
                    "http_cpu_s": spent["cpu"], "latency_s": statistics.mean(latency),
                    "queue_s": statistics.mean(queue) if queue else None})
    if profile:
        out[-1]["profile"] = profile_round(source, batch("profile"))
    return {"rounds": out}


CATEGORIES = (  # (name, what a profiled function's file or name contains), first match wins
    ("PNG encoding", ("/PIL/", "ImagingEncoder", "zlib")),
    ("JSON", ("/json/", "_json")),
    ("HTTP library (httpx, httpcore, h11, anyio)", ("/httpx/", "/httpcore/", "/h11/", "/anyio/", "/sniffio/", "_ssl.")),
    ("socket send / receive / poll", ("_socket.socket", "select.epoll")),
    ("asyncio, threads", ("/asyncio/", "selectors.py", "/concurrent/", "threading.py", "_thread.")),
    ("Jinja rendering", ("/jinja2/", "<template>")),
    ("hashing, base64", ("hashlib", "base64", "binascii")),
    ("mmrlhf", ("/mmrlhf/",)),
)


def profile_round(source, batch) -> dict[str, float]:
    """One scoring call under cProfile: own time per category, in ms per request. The rendering runs inline
    (``asyncio.to_thread`` patched to call at once) because cProfile sees only the thread it runs in."""
    import asyncio
    import cProfile
    import pstats

    async def inline(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    to_thread, asyncio.to_thread = asyncio.to_thread, inline
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        asyncio.run(source.score(batch))
        profiler.disable()
    finally:
        asyncio.to_thread = to_thread
    spent: dict[str, float] = {}
    for (filename, _, function), (_, _, own, _, _) in pstats.Stats(profiler).stats.items():
        where = f"{filename} {function}"
        name = next((n for n, marks in CATEGORIES if any(m in where for m in marks)), "other")
        spent[name] = spent.get(name, 0.0) + 1e3 * own / len(batch)
    return spent


# ---- the parent: server, clients, table ------------------------------------------------------------------------
def extract(rev: str, into: Path) -> Path | None:
    """The ``mmrlhf`` package at ``rev`` under ``into`` (None, with a note, where git cannot give it)."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "mmrlhf"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        print(f"no 'before' client: git archive {rev} failed ({exc}; {detail.decode(errors='replace')[:200]})")
        return None
    return into


def run_client(package_root: Path, args, url: str, image_px: int) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", url, "--prompts", str(args.prompts),
            "--samples", str(args.samples), "--image-px", str(image_px), "--concurrency", str(args.concurrency),
            "--rounds", str(args.rounds)] + (["--profile"] if args.profile else [])
    env = dict(os.environ, PYTHONPATH=str(package_root))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"client at {package_root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(rounds: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    n = rounds[0]["requests"]
    queue = [r["queue_s"] for r in rounds if r["queue_s"] is not None]
    return {"requests": n, "rps": n / med("wall_s"), "cpu_ms": 1e3 * med("cpu_s") / n,
            "render_cpu_ms": 1e3 * statistics.median(r["cpu_s"] - r["http_cpu_s"] for r in rounds) / n,
            "http_cpu_ms": 1e3 * med("http_cpu_s") / n, "latency_ms": 1e3 * med("latency_s"),
            "queue_ms": 1e3 * statistics.median(queue) if queue else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (they share its image)")
    ap.add_argument("--image-px", type=int, nargs="+", default=[0, 448], help="image side per case; 0: no image")
    ap.add_argument("--concurrency", type=int, default=8, help="the judge's max_concurrency")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="the fake judge's time per request")
    ap.add_argument("--rounds", type=int, default=3, help="measured scoring calls per client process")
    ap.add_argument("--repeats", type=int, default=2, help="client processes per client, alternating")
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="git revision of the 'before' client ('': none)")
    ap.add_argument("--profile", action="store_true", help="add where each client's time goes (cProfile, by category)")
    ap.add_argument("--quick", action="store_true", help="a small run: 8 x 4 samples, 224 px, one repeat")
    ap.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = ap.parse_args()
    if args.child:
        result = measure(args.child, args.prompts, args.samples, args.image_px[0], args.concurrency, args.rounds,
                         args.profile)
        print(json.dumps(result))
        return
    if args.quick:
        args.prompts, args.samples, args.image_px, args.rounds, args.repeats = 8, 4, [0, 224], 2, 1

    sys.path.insert(0, str(ROOT))
    from mmrlhf.testing.judge_server import FakeJudgeServer

    with tempfile.TemporaryDirectory() as tmp, FakeJudgeServer(delay_s=args.delay_ms / 1e3) as server:
        clients = [("after", ROOT)]
        old = extract(args.before, Path(tmp)) if args.before else None
        if old is not None:
            clients.insert(0, (f"before ({args.before})", old))
        rounds: dict[tuple[str, int], list[dict]] = {}
        for px in args.image_px:
            for _ in range(args.repeats):
                for label, root in clients:
                    rounds.setdefault((label, px), []).extend(run_client(root, args, server.base_url, px)["rounds"])
    rows, summary = [], {}
    for (label, px), measured in rounds.items():
        s = summary[(label, px)] = summarise(measured)
        rows.append([label, px or "none", s["requests"], round(s["rps"]), round(s["cpu_ms"], 2),
                     round(s["render_cpu_ms"], 2), round(s["http_cpu_ms"], 2), round(s["latency_ms"], 1),
                     None if s["queue_ms"] is None else round(s["queue_ms"], 1)])
    columns = ["client", "image px", "requests", "requests/s", "client CPU ms/req", "render ms/req",
               "HTTP ms/req", "latency_s mean ms", "queue_s mean ms"]
    print(f"{args.prompts} prompts x {args.samples} samples, concurrency {args.concurrency}, fake judge answering "
          f"in {args.delay_ms:g} ms; medians of {args.rounds} x {args.repeats} calls per row; "
          f"{os.cpu_count()} CPU cores shared by client and server\n")
    from _results import print_table, table, write_json

    print_table(columns, [["-" if c is None else c for c in row] for row in rows])
    ratios = []
    if old is not None:
        for px in args.image_px:
            before, after = summary[(clients[0][0], px)], summary[("after", px)]
            ratios.append(f"{before['cpu_ms'] / after['cpu_ms']:.1f}x less client CPU per request "
                          f"({before['cpu_ms']:.2f} -> {after['cpu_ms']:.2f} ms) "
                          + (f"with {px} px images" if px else "text only"))
        print("\nafter vs before: " + "; ".join(ratios))
    profiles = {key: [r["profile"] for r in measured if "profile" in r] for key, measured in rounds.items()}
    if any(profiles.values()):
        names = [n for n, _ in CATEGORIES] + ["other"]
        keys = [key for key in rounds if profiles[key]]
        cells = {key: {n: statistics.median(p.get(n, 0.0) for p in profiles[key]) for n in names} for key in keys}
        print("\nwhere the client's time goes (cProfile own time, ms per request; cProfile slows Python code, so "
              "compare within a column):\n")
        print_table(["part"] + [f"{label}, {px or 'no'} px" for label, px in keys],
                    [[n] + [round(cells[key][n], 3) for key in keys] for n in names]
                    + [["total"] + [round(sum(cells[key].values()), 3) for key in keys]])
    if args.json:
        last = summary[("after", args.image_px[-1])]
        headline = "; ".join(ratios) if ratios else (f"{last['cpu_ms']:.2f} client CPU ms per request, "
                                                     f"{last['rps']:.0f} requests/s")
        write_json(args.json, "judge_client", headline,
                   {k: getattr(args, k) for k in ("prompts", "samples", "image_px", "concurrency", "delay_ms",
                                                  "rounds", "repeats", "before")},
                   [table(f"judge client against an instant fake judge, concurrency {args.concurrency}", columns,
                          rows)])


if __name__ == "__main__":
    main()
