"""A run's memory plan as a user reads it: the configured launch mode in detail, every launch mode's peak, a
verdict, and the keys that make a plan that does not fit fit.

A suggested fix is a config override (``key=value``) or a launch change (more GPUs); each is applied to the config
and the whole plan is computed again, so a suggestion is only made when the plan it leads to fits (and a key that
the schema lacks is never named: :func:`mmrlhf.models.memory.inputs.fix_keys`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from mmrlhf.models.memory.counts import ModelFacts
from mmrlhf.models.memory.inputs import PlanError, facts_of, plan_inputs
from mmrlhf.models.memory.plan import GIB, LaunchPlan, PlanInputs, engine_problem, plan_launch, summary_modes

LORA_RANK = 64  # the rank a LoRA fix suggests
RANK_STEPS = (2, 4, 8, 16, 32, 64)  # world sizes a "more GPUs" fix tries
TP_STEPS = (2, 4, 8, 16)  # engine tensor-parallel sizes a fix tries (up to a node's GPUs)


@dataclass
class Fix:
    """One way to make the plan fit: overrides and / or a launch, with the plan it leads to."""

    overrides: list[str]  # ``key=value`` words for the command line
    launch: str  # "" (the configured launch) or e.g. "torchrun over 4 GPUs"
    peak: int  # the fixed plan's largest per-GPU peak (bytes)

    @property
    def label(self) -> str:
        parts = list(self.overrides) + ([f"launch {self.launch}"] if self.launch else [])
        return " + ".join(parts)


@dataclass
class MemoryPlan:
    facts: ModelFacts
    inputs: PlanInputs
    launch: LaunchPlan  # the configured launch mode
    modes: list[LaunchPlan]  # every launch mode's plan (summary)
    fixes: list[Fix] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return verdict(self)


@dataclass
class _Planner:
    """Where every plan of one request is computed (the model's shape, the GPU, the ranks, the teacher's shape),
    and the model facts of each freeze / LoRA setting met so far (the fixes re-plan with changed keys)."""

    shape: str | None
    gpu_gib: float | None
    ranks: int | None
    teacher_shape: str | None
    gpus_per_node: int | None = None
    facts: dict[tuple, ModelFacts] = field(default_factory=dict)

    def inputs(self, config: Any) -> tuple[ModelFacts, PlanInputs]:
        t, lora = config.trainer, config.model.lora
        key = (t.freeze_vision_tower, t.freeze_merger, lora.rank, tuple(lora.target_modules), lora.vision)
        if key not in self.facts:
            self.facts[key] = facts_of(config, self.shape)
        return self.facts[key], plan_inputs(config, self.facts[key], gpu_gib=self.gpu_gib, ranks=self.ranks,
                                            teacher_shape=self.teacher_shape, gpus_per_node=self.gpus_per_node)


def memory_plan(config: Any, *, shape: str | None = None, gpu_gib: float | None = None, ranks: int | None = None,
                suggest: bool = True, teacher_shape: str | None = None,
                gpus_per_node: int | None = None) -> MemoryPlan:
    """The plan of ``config`` (its model from ``shape`` or ``model.pretrain``, a distillation teacher from
    ``teacher_shape`` or ``model.teacher``) on GPUs of ``gpu_gib`` GiB, a torchrun world of ``ranks`` on nodes of
    ``gpus_per_node`` GPUs; ``suggest``: search the fixes when it does not fit. Raises :class:`PlanError` naming
    the key to set."""
    planner = _Planner(shape, gpu_gib, ranks, teacher_shape, gpus_per_node)
    facts, inputs = planner.inputs(config)
    launch = plan_launch(facts, inputs)
    modes = [plan_launch(facts, inputs, mode, n) for mode, n in summary_modes(inputs)]
    plan = MemoryPlan(facts, inputs, launch, modes)
    if suggest and not launch.fits:
        plan.fixes = find_fixes(config, planner, inputs)
    return plan


def tensor_parallel_fix(facts: ModelFacts, p: PlanInputs) -> list[str] | None:
    """``rollout.tensor_parallel_size=N``: the smallest engine tensor-parallel size (within a node, dividing
    torchrun's ranks) at which an engine that cannot start in its share does; None when it starts already or no
    size does."""
    if p.engine != "vllm" or engine_problem(facts, p) is None:
        return None
    for tp in TP_STEPS:
        if tp <= p.tensor_parallel or tp > p.gpus_per_node or (p.backend == "torchrun" and p.ranks % tp):
            continue
        if engine_problem(facts, dataclasses.replace(p, tensor_parallel=tp)) is None:
            return [f"rollout.tensor_parallel_size={tp}"]
    return None


def _candidates(config: Any, p: PlanInputs, facts: ModelFacts) -> list[list[str]]:
    """Single config changes that lower the peak, as override lists (only those that change something)."""
    m, t, r = config.model, config.trainer, config.rollout
    out = [tp] if (tp := tensor_parallel_fix(facts, p)) else []
    if not m.lora.rank and t.freeze_vision_tower:
        out.append([f"model.lora.rank={LORA_RANK}"])
    if not p.checkpointing:
        out.append([f"{p.keys['checkpointing']}=true"])
    if t.micro_train_batch_size > 1:
        out.append(["trainer.micro_train_batch_size=1"])
    if "token_budget" in p.keys and p.train.tokens > p.train.row_tokens:
        out.append([f"{p.keys['token_budget']}={p.train.row_tokens}"])
    if m.attn_implementation != "flash_attention_2" and p.train.mask:
        out.append(["model.attn_implementation=flash_attention_2"])
    if p.engine == "vllm" and p.backend != "ray" and not r.enable_sleep:
        out.append(["rollout.enable_sleep=true"])
    if p.engine == "vllm" and not p.offload:
        out.append(["distributed.offload=params"])
    if p.backend == "ray" and p.rollout_models:  # the rollout actors' scoring models move onto the trainer actors
        merged = ["model.lora.sync=merged"] if m.lora.rank and m.lora.sync == "vllm_lora" else []  # (it sends them)
        out.append(["distributed.scoring=trainer", *merged])
    return out


def _lower_utilization(config: Any, planner: _Planner, base: list[str]) -> Fix | None:
    """The largest ``rollout.gpu_memory_utilization`` below the configured one (steps of 0.05) that fits."""
    from mmrlhf.config import build_config

    current = config.rollout.gpu_memory_utilization
    u = round(current - 0.05, 2)
    while u >= 0.05:
        overrides = [*base, f"rollout.gpu_memory_utilization={u}"]
        fixed = _try(config, overrides, planner, build_config)
        if fixed is not None:
            return fixed
        u = round(u - 0.05, 2)
    return None


def _try(config, overrides, planner: _Planner, build_config, mode=None, n=None) -> Fix | None:
    try:
        cfg = build_config(config.model_dump(), overrides)
        facts, p = planner.inputs(cfg)
    except (ValueError, PlanError):  # an override the schema refuses in this config: not a fix
        return None
    plan = plan_launch(facts, p, mode, n)
    if not plan.fits:
        return None
    launch = "" if mode is None else plan.label
    return Fix(overrides, launch, plan.peak)


def find_fixes(config: Any, planner: _Planner, p: PlanInputs, limit: int = 4) -> list[Fix]:
    """The smallest changes that make the configured launch fit: single changes (a key, a lower engine share, more
    GPUs) first; pairs only when no single change fits. At most ``limit``, lowest peak first."""
    from mmrlhf.config import build_config

    def attempt(overrides: list[str], mode: str | None = None, n: int | None = None) -> Fix | None:
        return _try(config, overrides, planner, build_config, mode, n)

    def more_gpus(base: list[str]) -> Fix | None:
        if p.backend == "ray":
            steps = [n for n in RANK_STEPS if n > p.trainer_actors]
            return next((f for n in steps if (f := attempt([*base, f"distributed.num_trainer_actors={n}"]))), None)
        current = p.ranks if p.backend == "torchrun" else 1
        return next((f for n in RANK_STEPS if n > current and (f := attempt(base, "torchrun", n))), None)

    singles = _candidates(config, p, planner.inputs(config)[0])
    found = [f for c in singles if (f := attempt(c))]
    if p.engine == "vllm" and p.backend != "ray":
        found += [f for f in [_lower_utilization(config, planner, [])] if f]
    found += [f for f in [more_gpus([])] if f]
    if not found:
        found = [f for a, b in itertools.combinations(singles, 2) if (f := attempt([*a, *b]))]
        found += [f for c in singles if (f := more_gpus(c))]
    found.sort(key=lambda f: f.peak)
    return found[:limit]


# ---- verdict --------------------------------------------------------------------------------------------------------

def _state_bytes(launch: LaunchPlan) -> int:
    g = max(launch.gpus, key=lambda g: g.peak)
    parts = g.phases[g.peak_phase]
    return sum(v for k, v in parts.items() if "weights" in k or "gradients" in k or "moments" in k)


def verdict(plan: MemoryPlan) -> str:
    """One paragraph: fits (the peak and its phase) or does not (where, how much, and the fixes that fit)."""
    launch, gpu = plan.launch, plan.inputs.gpu_bytes / GIB
    g = max(launch.gpus, key=lambda g: g.peak)
    if launch.fits:
        host = max(sum(g_.host.values()) for g_ in launch.gpus)
        node = (f", {launch.host_per_node / GIB:.1f} GiB per node of {launch.processes_per_node}"
                if launch.processes_per_node > 1 else "")
        return (f"fits: {g.peak / GIB:.1f} GiB at most per GPU ({g.peak_phase}, {g.name}) of {gpu:.0f} GiB, "
                f"{(plan.inputs.gpu_bytes - g.peak) / GIB:.1f} GiB left for the CUDA context and fragmentation"
                + (f"; {host / GIB:.1f} GiB of host memory per training process{node} (distributed.offload)"
                   if host else ""))
    where = "one" if g.count == 1 else "each"
    others = [p for p in launch.problems if not any(p.startswith(f"{x.name}:") for x in launch.gpus)]
    if g.peak > plan.inputs.gpu_bytes:
        lines = [f"does not fit: {g.peak / GIB:.1f} GiB in {g.peak_phase} on {where} {gpu:.0f} GiB GPU ({g.name}; "
                 f"{_state_bytes(launch) / GIB:.1f} GiB of it weights, gradients and AdamW moments)"]
    else:
        lines = [f"does not start ({g.peak / GIB:.1f} GiB at most per GPU would fit):"]
    lines += others  # the engine's and the layout's
    if plan.fixes:
        lines.append("fits with: " + "; or ".join(f"{f.label} (peak {f.peak / GIB:.1f} GiB per GPU)"
                                                  for f in plan.fixes))
    else:
        lines.append("no single or paired change of the usual keys makes it fit on this GPU: see the table")
    return "\n".join(lines)


# ---- JSON -----------------------------------------------------------------------------------------------------------

def to_json(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as plain data (bytes as integers, GiB as floats), for ``--json``."""
    def launch(lp: LaunchPlan) -> dict[str, Any]:
        return {"mode": lp.mode, "label": lp.label, "fits": lp.fits, "peak_bytes": lp.peak,
                "peak_gib": round(lp.peak / GIB, 2), "problems": list(lp.problems),
                "processes_per_node": lp.processes_per_node, "host_per_node_bytes": lp.host_per_node,
                "gpus": [{"name": g.name, "count": g.count, "peak_phase": g.peak_phase, "peak_bytes": g.peak,
                          "phases": g.phases, "host": g.host} for g in lp.gpus]}

    inputs = dataclasses.asdict(plan.inputs)
    inputs["judges"] = [list(j) for j in inputs["judges"]]  # JSON has lists, not tuples
    inputs["rollout_models"] = list(inputs["rollout_models"])
    return {"model": plan.facts.name, "gpu_bytes": plan.inputs.gpu_bytes,
            "parameters": dataclasses.asdict(plan.facts.counts), "decoder": dataclasses.asdict(plan.facts.decoder),
            "vision": dataclasses.asdict(plan.facts.vision), "inputs": inputs, "launch": launch(plan.launch),
            "modes": [launch(m) for m in plan.modes], "verdict": plan.verdict, "fits": plan.launch.fits,
            "fixes": [{"overrides": f.overrides, "launch": f.launch, "peak_bytes": f.peak} for f in plan.fixes],
            "engine_problem": engine_problem(plan.facts, plan.inputs)}
