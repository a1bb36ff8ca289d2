"""The memory plan as text: the model and what trains, the micro-batches, one table per GPU kind of the configured
launch mode (components x phases, GiB), every launch mode's peak, and the verdict."""

from __future__ import annotations

import textwrap

from mmrlhf.models.memory.advice import MemoryPlan
from mmrlhf.models.memory.plan import (GIB, PHASES, GpuPlan, engine_weight_bytes, kv_bytes_per_token,
                                       recurrent_state_bytes)

_DTYPE = {2: "bfloat16", 4: "float32"}


def _b(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def describe(plan: MemoryPlan) -> list[str]:
    """The lines above the tables: parameters, precision, micro-batches, engine."""
    f, p, c = plan.facts, plan.inputs, plan.facts.counts
    head = "tied to the embeddings" if f.tied else f"{_b(c.lm_head)} untied lm_head"
    lines = [f"parameters   {_b(c.total)}: language {_b(c.language)} ({f.decoder.layers} layers, {head}), "
             f"vision tower {_b(c.vision_tower)}, merger {_b(c.merger)}"]
    trains = f"{_b(c.trainable)}" + (" (LoRA adapters; every base weight frozen)" if c.lora else "")
    lines.append(f"trains       {trains}; frozen {_b(c.frozen)}")
    compute = _DTYPE.get(p.compute_bytes, str(p.compute_bytes))
    master = _DTYPE[p.master_bytes]
    frozen = (f"frozen ones included ({_DTYPE[p.lora_base_bytes]} frozen Linears under LoRA: "
              f"{_b(c.frozen_linear)})" if 0 < p.lora_base_bytes < p.master_bytes else "frozen ones included")
    lines.append(f"precision    compute {compute}; the actor (and critic) keep {master} weights, {frozen}, and "
                 f"{master} gradients + 2 AdamW moments for what trains "
                 f"({4 * p.master_bytes} B per trained parameter); reference: "
                 + (f"{compute} copy, sharded as the actor is" if p.reference else "none") + "; critic: "
                 + ("yes" if p.critic else "none"))
    for name, mb in (("update", p.train), ("scoring", p.score)):
        lines.append(f"{name + ' batch':<12} {mb.rows} row(s) x {mb.row_tokens} tokens, {mb.response_tokens} scored, "
                     f"{mb.vision_patches} vision patches" + (", attention mask" if mb.mask else "")
                     + (", checkpointed" if p.checkpointing and name == "update" else ""))
    if p.engine == "vllm":
        share = p.utilization * p.gpu_bytes
        weights = engine_weight_bytes(f, p)
        per_token = kv_bytes_per_token(f, p.engine_bytes, p.tensor_parallel)
        rest = max(share - weights, 0)
        sleep = "sleeps from generation to the sync" if p.sleep else "stays awake (rollout.enable_sleep off)"
        state = recurrent_state_bytes(f, p.engine_bytes, p.tensor_parallel)
        states = (f", plus {state / 2**20:.0f} MiB of linear-attention state per running sequence"
                  if state else "")
        tp = (f" per GPU of its {p.tensor_parallel} (tensor parallel: weights and KV cache split "
              f"{p.tensor_parallel} ways)" if p.tensor_parallel > 1 else "")
        lines.append(f"engine       vLLM, {p.utilization} x {p.gpu_bytes / GIB:.0f} GiB = {_gib(int(share))} GiB{tp} "
                     f"while awake: weights {_gib(weights)}, KV cache + activations + CUDA graphs {_gib(int(rest))} "
                     f"(at most {int(rest // per_token):,} tokens of KV at {per_token // 1024} KiB{states}); {sleep}")
    else:
        lines.append("engine       transformers generate with the actor (KV cache only while generating)")
    return lines


def table(g: GpuPlan, gpu_bytes: int) -> list[str]:
    """Components x phases in GiB, with the totals and the GPU."""
    phases = [ph for ph in PHASES if ph in g.phases]
    names: list[str] = []
    for ph in phases:
        names += [n for n in g.phases[ph] if n not in names]
    width = max(len(n) for n in names + ["total"]) + 2
    lines = [f"{'GiB':<{width}}" + "".join(f"{ph:>10}" for ph in phases)]
    for n in names:
        cells = [g.phases[ph].get(n) for ph in phases]
        lines.append(f"{n:<{width}}" + "".join(f"{_gib(v) if v else '':>10}" for v in cells))
    lines.append(f"{'total':<{width}}" + "".join(f"{_gib(g.total(ph)):>10}" for ph in phases))
    marks = ["yes" if g.total(ph) <= gpu_bytes else "NO" for ph in phases]
    lines.append(f"{'fits in ' + _gib(gpu_bytes):<{width}}" + "".join(f"{m:>10}" for m in marks))
    return lines


def render_text(plan: MemoryPlan, title: str = "") -> str:
    p = plan.inputs
    out = [f"Memory plan{': ' + title if title else ''} ({plan.facts.name}; GPUs of {_gib(p.gpu_bytes)} GiB)", ""]
    for line in describe(plan):
        out += textwrap.wrap(line, width=118, subsequent_indent=" " * 13)
    launch = plan.launch
    for g in launch.gpus:
        count = "" if g.count == 1 else f" (x{g.count})"
        out += ["", f"{launch.label}: {g.name}{count}"]
        out += table(g, p.gpu_bytes)
        if g.host:
            node = (f" ({launch.processes_per_node} per node: {_gib(launch.host_per_node)} GiB)"
                    if launch.processes_per_node > 1 else "")
            out += textwrap.wrap(f"host memory per process{node} (distributed.offload): {_gib(sum(g.host.values()))}"
                                 " GiB: " + ", ".join(f"{n} {_gib(v)}" for n, v in g.host.items()), 118,
                                 subsequent_indent="  ")
    out += ["", "per launch mode (largest per-GPU peak):"]
    width = max([58] + [len(m.label) for m in plan.modes])
    for m in plan.modes:
        g = max(m.gpus, key=lambda g: g.peak)
        state = "fits" if m.fits else "does not fit" if g.peak > p.gpu_bytes else "cannot start"
        out.append(f"  {m.label:<{width}} {_gib(g.peak):>6} GiB  {state:<13} ({g.peak_phase}, {g.name})")
    out += [""] + [w for line in plan.verdict.splitlines() for w in textwrap.wrap(line, 118, subsequent_indent="  ")]
    out += [""] + textwrap.wrap("Not counted: the CUDA context and allocator fragmentation (keep a few GiB free), "
                                "vLLM's CUDA-graph pool during sleep, host memory (but for distributed.offload's "
                                "states). Formulas: mmrlhf/models/memory/ (docs/gpu.md).", 118)
    return "\n".join(out) + "\n"
