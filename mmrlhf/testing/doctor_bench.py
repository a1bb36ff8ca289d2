"""The ``benchmarks`` rows of ``mmrlhf doctor``: the benchmark scripts with a GPU side, run as subprocesses, their
headline and tables as the row (``benchmarks/bench_seeding.py``, ``benchmarks/bench_trainer.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from mmrlhf.testing.doctor_types import CheckResult, DoctorOptions, cuda_device, vllm_missing


def check_benchmarks(opts: DoctorOptions) -> list[CheckResult]:
    """The benchmark scripts with a GPU side: ``bench_seeding.py`` (the sampler step with and without per-request
    generators on each device; the vLLM seed modes when vLLM is present) and ``bench_trainer.py`` (the trainer's
    forward + backward at a real model shape on a GPU; its small shape on the CPU)."""
    return _bench_seeding(opts) + _bench_trainer(opts)


def trainer_bench_args(opts: DoctorOptions) -> list[str]:
    """``bench_trainer.py``'s arguments for this machine: the 7B shape where the GPU holds its float32 master
    weights and gradients (>= 100 GiB), the 3B shape on smaller GPUs, the small shape on the CPU (``--quick``), there
    in float32 unless the CPU has bf16 hardware (emulated bf16 took the small shape 78 s against 10 s in float32 on
    an AVX2-only machine, and says nothing of a GPU's bf16)."""
    import torch

    from mmrlhf.rollout.vllm_setup import cpu_has_bf16_kernels

    if not cuda_device(opts.device):
        return ["--quick", "--groups", "img448", "--device", "cpu",
                *([] if cpu_has_bf16_kernels() else ["--dtype", "float32"])]
    if opts.quick:
        return ["--quick", "--groups", "img448", "--device", opts.device]
    gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    shape = "qwen2_5_vl_7b" if gib >= 100 else "qwen2_5_vl_3b"
    return ["--shape", shape, "--groups", "img448,img896,mixed", "--splits", "count,budget", "--checkpointing",
            "off,on", "--repeats", "2", "--warmup", "1"]


def _bench_trainer(opts: DoctorOptions) -> list[CheckResult]:
    return [run_benchmark("bench/trainer", "bench_trainer.py", trainer_bench_args(opts), opts, timeout=900)]


def _bench_seeding(opts: DoctorOptions) -> list[CheckResult]:
    args = ["--rows", "64", "--vocab", "32768", "--iters", "3", "--prompts", "4", "--samples", "2",
            "--new-tokens", "8", "--repeats", "1"] if opts.quick else []
    parts = ["sampler"] if vllm_missing() else ["engine", "sampler"]
    return [run_benchmark("bench/seeding", "bench_seeding.py", ["--part", *parts, *args], opts, timeout=600)]


def run_benchmark(name: str, script_name: str, args: Sequence[str], opts: DoctorOptions, *,
                  timeout: int) -> CheckResult:
    """One benchmark script as a doctor row: run with ``args`` and ``--json``; its headline is the reason, its
    tables the details; a non-zero exit or no JSON is a ``fail`` with the last lines of its stderr."""
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    script = root / script_name
    if not script.exists():
        return CheckResult(name, "skip", reason=f"{script} not found (not a source checkout)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=opts.workdir or None) as out:
        out_json = Path(out) / "result.json"
        proc = subprocess.run([sys.executable, str(script), *args, "--json", str(out_json)],
                              capture_output=True, text=True, timeout=timeout, cwd=str(root))
        if proc.returncode != 0 or not out_json.exists():
            return CheckResult(name, "fail", reason=f"rc {proc.returncode}: "
                               + " | ".join(proc.stderr.strip().splitlines()[-3:]), seconds=time.perf_counter() - t0)
        result = json.loads(out_json.read_text())
    return CheckResult(name, "pass", reason=result["headline"], seconds=time.perf_counter() - t0,
                       details={"tables": result["tables"]})
