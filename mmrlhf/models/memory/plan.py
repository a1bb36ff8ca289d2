"""The memory plan: GiB per GPU, per phase of a training step, per launch mode, from plain inputs.

What sits on a GPU, by launch mode (``distributed.backend``):

* one process (one GPU): the vLLM engine (``rollout.gpu_memory_utilization`` of the GPU while awake), the actor
  (float32 master weights; gradients and two AdamW moments in float32 for what trains, :mod:`mmrlhf.models.
  precision`; its frozen vision tower float32 too), the reference (``model.dtype``, only with a KL term, and none
  with LoRA, whose reference is the actor with its adapters off), the critic (``gae``: float32, its own AdamW) and
  one micro-batch's activations (:mod:`mmrlhf.models.memory.activations`);
* torchrun over N GPUs (``--ranks N``, on nodes of ``--gpus-per-node`` GPUs): the same on every rank, with the
  actor's and critic's weights, gradients and moments sharded N ways by FSDP2 (frozen weights too), and the
  reference (and a distillation teacher) sharded N ways as well, in ``model.dtype``. The ranks form groups of
  ``rollout.tensor_parallel_size`` that share one tensor-parallel vLLM engine: each GPU of a group holds its
  ``rollout.gpu_memory_utilization`` share, its 1 / tensor_parallel_size of the engine's weights and of the KV
  cache within it (a group sits on one node). FSDP2 gathers a unit's parameters in
  ``model.dtype`` for its forward and backward: the root unit (embeddings, lm_head, final norm and the whole vision
  side, :func:`mmrlhf.models.sharding.language_block_classes`) for the whole forward and backward, plus a decoder
  layer and the next one it prefetches; after a unit's backward its full gradients are copied
  into a float32 reduce-scatter buffer (c + 4 bytes per trainable parameter of the largest unit, and the shard);
* ``distributed.offload: params`` (any mode): FSDP2 keeps the trained models' float32 weights, gradients and AdamW
  moments, and the reference's and teacher's shards, in host memory and steps there; the GPU holds what FSDP2
  gathers (as sharded above, one process being a world of one rank), the reduction buffers and the activations.
  The host side is :attr:`GpuPlan.host`, per process (and :attr:`LaunchPlan.host_per_node`);
* a distillation teacher (``model.teacher``) is stored as the reference is, in ``model.dtype``, sharded over the
  ranks that score (the policy's gathered units stand for its own); an in-process vLLM judge (a ``backend: vllm``
  reward source) takes its
  ``engine.gpu_memory_utilization`` share while it judges, right after generation (always, unless it sleeps);
  routing replay adds the engine's expert indices of a training micro-batch;
* Ray: a rollout actor holds only its engine (``rollout.tensor_parallel_size`` GPUs, each with its share; the
  transformers engine: a float32 copy of the policy it generates with, and its KV cache); the trainer actors,
  FSDP2-sharded over their number, hold the training states, the reference and teacher shards, and compute the
  old-policy, reference and critic scores as well as the updates.

Phases (``generate`` -> ``score`` -> ``update`` -> ``step`` -> ``critic`` -> ``sync``): the engine is awake while
it generates. With ``rollout.enable_sleep`` it frees its KV cache and weights from the end of generation (the
experience forwards, the updates) and wakes its weights only for the sync, its KV cache after it (docs/gpu.md,
"vLLM memory and sleep mode"); without, it keeps its whole share throughout. Gradients exist from the first
backward of a mini-batch to its optimiser step (``zero_grad(set_to_none=True)``); torch's AdamW (``foreach`` on
GPUs) then holds one more float32 tensor of the trained parameters' size for the step. A sync holds one bucket of
gathered tensors (``rollout.weight_sync_bucket_mb``, at least the largest tensor) when the weights are sharded or
LoRA is merged; in one process the engine loads the actor's own tensors.

Not modelled: the CUDA context and allocator fragmentation (keep a few GiB free), vLLM's CUDA-graph pool (kept by
sleep mode), the transformers engine's generation beyond its KV cache, and the Python-side host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmrlhf.models.memory.activations import (F32, MicroBatch, activation_plan, numerics, scoring_bytes)
from mmrlhf.models.memory.counts import ModelFacts

GIB = 2**30
PHASES = ("generate", "score", "update", "step", "critic", "sync")
SLEEP = "engine asleep"  # the engine's part while it sleeps


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan reads from the run's config, as plain values (``inputs.plan_inputs`` builds it)."""

    gpu_bytes: int  # memory of one GPU
    compute_bytes: int  # ``model.dtype``
    master_bytes: int  # trained models' weights, gradients, moments (float32 below float32 compute)
    reference: bool  # a separate reference model (KL on, no LoRA adapter-off reference)
    critic: bool  # ``algorithm.advantage_estimator: gae``
    train: MicroBatch  # the largest training micro-batch
    score: MicroBatch  # the largest experience (no-grad) micro-batch
    checkpointing: bool
    chunk: int  # rows per chunk of the log-prob head
    engine: str  # vllm | transformers
    engine_bytes: int  # the engine's weight dtype on a GPU (``rollout.dtype``)
    utilization: float  # ``rollout.gpu_memory_utilization``
    sleep: bool  # ``rollout.enable_sleep`` (vLLM on CUDA)
    tensor_parallel: int
    max_model_len: int
    generate_rows: int  # sequences the transformers engine decodes at once
    bucket_bytes: int  # ``rollout.weight_sync_bucket_mb``
    lora_merged: bool  # LoRA synced as merged weights
    backend: str  # single | torchrun | ray (``auto`` resolved)
    ranks: int  # torchrun world size
    rollout_actors: int
    rollout_gpus: int  # GPUs of one rollout actor
    trainer_actors: int
    gpus_per_node: int = 8  # GPUs of one node: an engine's tensor-parallel group sits on one node
    keys: dict[str, str] = field(default_factory=dict)  # role -> the config key a fix sets (see inputs.py)
    compute_copy: bool = False  # ``trainer.compute_copy`` resolved (it applies where a model autocasts)
    lora_base_bytes: int = 0  # ``model.lora.base_dtype`` on a GPU: bytes per frozen Linear element (0: no LoRA)
    offload: bool = False  # ``distributed.offload: params``: the trained models' states in host memory (FSDP2)
    teacher_bytes: int = 0  # ``model.teacher``: its weights in ``model.dtype`` (0: no distillation)
    # in-process vLLM judges (``backend: vllm`` reward sources): (gpu_memory_utilization, sleeps between calls)
    judges: tuple[tuple[float, bool], ...] = ()
    routing_bytes: int = 0  # ``rollout.routing_replay: replay``: the engine's experts of one training micro-batch
    # Ray: what each rollout actor scores with (mmrlhf.models.ray_placement.rollout_actor_models); the trainer
    # actors hold the rest (none where the trainers make the experiences: ray_placement.experiences_on_trainers)
    rollout_models: tuple[str, ...] = ()


@dataclass
class GpuPlan:
    """One kind of GPU of a launch: bytes per component in every phase."""

    name: str
    count: int  # how many GPUs of this kind
    phases: dict[str, dict[str, int]]  # phase -> component -> bytes
    host: dict[str, int] = field(default_factory=dict)  # what the process of one such GPU keeps in host memory

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase) if self.phases else 0


@dataclass
class LaunchPlan:
    mode: str  # single | torchrun | ray
    label: str  # "one process, 1 GPU", "torchrun over 4 GPUs", ...
    gpus: list[GpuPlan]
    gpu_bytes: int
    problems: list[str] = field(default_factory=list)  # what does not fit or cannot start
    processes_per_node: int = 1  # training processes on one node (what host_per_node sums)

    @property
    def host_per_node(self) -> int:
        """Host memory the training processes of one node keep (``distributed.offload``), bytes."""
        return max((sum(g.host.values()) for g in self.gpus), default=0) * self.processes_per_node

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> int:
        return max(g.peak for g in self.gpus)


# ---- the pieces ------------------------------------------------------------------------------------------------

def engine_weight_bytes(facts: ModelFacts, p: PlanInputs) -> int:
    """The engine's copy of the policy on one of its GPUs."""
    return facts.counts.total * p.engine_bytes // p.tensor_parallel


def kv_bytes_per_token(facts: ModelFacts, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """K and V of every attention layer for one token (what a KV cache holds per token; a linear-attention layer
    keeps a fixed state per sequence instead, :func:`recurrent_state_bytes`)."""
    d = facts.decoder
    return 2 * d.attention_layers * d.kv_dim * dtype_bytes // tensor_parallel


def recurrent_state_bytes(facts: ModelFacts, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """What the engine holds per running sequence for the linear-attention layers, whatever its length: each
    layer's recurrent state (value heads x key size x value size) and the convolution's last kernel - 1 inputs."""
    d = facts.decoder
    if not d.linear_layers:
        return 0
    k, v = d.linear_k_heads * d.linear_k_dim, d.linear_v_heads * d.linear_v_dim
    state = d.linear_v_heads * d.linear_k_dim * d.linear_v_dim + (2 * k + v) * (d.conv_kernel - 1)
    return d.linear_layers * state * dtype_bytes // tensor_parallel


def _states(facts: ModelFacts, p: PlanInputs, shards: int, prefix: str = "actor") -> dict[str, int]:
    """Resident training states of one trained model, per GPU (weights; AdamW moments)."""
    c = facts.counts
    trained = c.trainable if prefix == "actor" else _critic_trainable(facts)
    weights = (c.total + (c.lora if prefix == "actor" else facts.decoder.hidden + 1)) * p.master_bytes
    label = f"{prefix} weights (float32)"
    if prefix == "actor" and _low_base(p):  # the frozen Linears stored below float32 (model.lora.base_dtype)
        weights -= c.frozen_linear * (p.master_bytes - p.lora_base_bytes)
        label = f"{prefix} weights (float32, frozen Linears bf16)"
    return {label: weights // shards,
            f"{prefix} AdamW moments (float32)": 2 * trained * p.master_bytes // shards}


def _low_base(p: PlanInputs) -> bool:
    """A LoRA actor whose frozen Linear weights are stored below the master dtype."""
    return 0 < p.lora_base_bytes < p.master_bytes


def _critic_trainable(facts: ModelFacts) -> int:
    """The critic trains what the actor would without LoRA, less an untied lm_head (it never gets a gradient, so
    AdamW keeps no state for it), plus its value head."""
    c = facts.counts
    return c.trainable_without_lora - c.lm_head + facts.decoder.hidden + 1


def _gathered(facts: ModelFacts, p: PlanInputs) -> int:
    c = facts.counts
    return (c.root + 2 * c.decoder_layer) * p.compute_bytes


def _reduction(facts: ModelFacts, p: PlanInputs, shards: int) -> int:
    """FSDP2's ``foreach_reduce`` after a unit's backward: its full gradients in c, copied (cast) into a float32
    reduce-scatter input of the same size, and the float32 output shard; the largest unit counts."""
    c = facts.counts
    unit = max(c.root_trainable, c.decoder_layer_trainable)
    return (p.compute_bytes + F32) * unit + F32 * unit // shards


def _activations(facts: ModelFacts, p: PlanInputs, sharded: bool, *, critic: bool = False) -> dict[str, int]:
    n = numerics(p.compute_bytes, p.master_bytes, sharded=sharded)
    a = activation_plan(facts, n, p.train, checkpointing=p.checkpointing, chunk=p.chunk,
                        compute_copy=p.compute_copy)
    copies = "compute copy (bf16 Linears)" if p.compute_copy and n.autocast else "autocast weight copies"
    parts = {"activations (saved)": a.layers + a.per_forward + a.vision,
             copies: a.weight_copies, "recomputed layer": a.recompute,
             "log-prob head": 0 if critic else a.head, "backward working set": a.backward}
    if critic and n.autocast:  # the critic's head is a [h, 1] value head: no lm_head copy
        parts[copies] -= n.compute * facts.decoder.vocab * facts.decoder.hidden
    elif n.autocast and _low_base(p) and p.lora_base_bytes == p.compute_bytes:
        parts[copies] = n.compute * facts.counts.lora  # the base is in the compute dtype: only the adapters cast
    return {k: v for k, v in parts.items() if v}


def _sync_bucket(facts: ModelFacts, p: PlanInputs, sharded: bool) -> int:
    if not (sharded or p.lora_merged or p.offload):
        return 0
    return max(p.bucket_bytes, facts.counts.largest_trainable_tensor * p.master_bytes)


def scoring_models(facts: ModelFacts, p: PlanInputs, shards: int, *, reference: bool,
                   scores: bool) -> dict[str, int]:
    """The frozen models that score, per process: the reference and a distillation teacher, each an FSDP2 shard
    in ``model.dtype`` over the ``shards`` ranks that score (whole in one process)."""
    out = {}
    if reference:
        out["reference (model.dtype)"] = facts.counts.total * p.compute_bytes // shards
    if scores and p.teacher_bytes:
        out["teacher (model.dtype)"] = p.teacher_bytes // shards
    return out


def host_states(facts: ModelFacts, p: PlanInputs, shards: int, *, reference: bool | None = None,
                scores: bool = True) -> dict[str, int]:
    """``distributed.offload: params``: what leaves the GPU for host memory, per process (its shards): the trained
    models' weights, AdamW moments and gradients (FSDP2 copies each unit's gradients there after the
    reduce-scatter), the optimiser step's temporaries (AdamW steps on the CPU), and the shards of the reference and
    teacher (``reference``: default ``p.reference``)."""
    c = facts.counts
    host = _states(facts, p, shards)
    host["actor gradients (float32)"] = c.trainable * p.master_bytes // shards
    if p.critic:
        host.update(_states(facts, p, shards, "critic"))
        host["critic gradients (float32)"] = _critic_trainable(facts) * p.master_bytes // shards
    host["AdamW step temporaries"] = c.trainable * p.master_bytes // shards
    host.update(scoring_models(facts, p, shards, reference=p.reference if reference is None else reference,
                               scores=scores))
    return host


def trainer_phases(facts: ModelFacts, p: PlanInputs, *, shards: int, engine: dict[str, dict[str, int]],
                   reference: bool, scores: bool = True) -> dict[str, dict[str, int]]:
    """Phases of a GPU that trains (one process, a torchrun rank, a Ray trainer actor). ``engine``: the engine's
    part in each phase (empty for a Ray trainer); ``reference``: the reference model is sharded over these ranks;
    ``scores``: the experience forwards run here (the teacher's with them). With ``offload`` the trained states and
    the scoring models' shards are in host memory (:func:`host_states`) and FSDP2 runs even on one rank: the GPU
    holds the gathered units, the reduction buffers and the activations."""
    c, sharded = facts.counts, shards > 1 or p.offload
    resident = {} if p.offload else _states(facts, p, shards)
    if not p.offload:
        resident.update(scoring_models(facts, p, shards, reference=reference, scores=scores))
    if p.critic and not p.offload:
        resident.update(_states(facts, p, shards, "critic"))
    gathered = {"FSDP gathered parameters": _gathered(facts, p)} if sharded else {}
    reduce = {"FSDP gradient reduction": _reduction(facts, p, shards)} if sharded else {}
    grads = {} if p.offload else {"actor gradients (float32)": c.trainable * p.master_bytes // shards}
    temporaries = {} if p.offload else {"AdamW step temporaries": c.trainable * p.master_bytes // shards}
    n = numerics(p.compute_bytes, p.master_bytes, sharded=sharded)
    scoring = scoring_bytes(facts, n, p.score.tokens, p.score.response_tokens, p.chunk)
    phases = {
        "generate": {**resident},
        "score": {**resident, **gathered, "scoring forward": scoring},
        "update": {**resident, **grads, **gathered, **reduce, **_activations(facts, p, sharded),
                   "routing replay (engine's experts)": p.routing_bytes},
        "step": {**resident, **grads, **temporaries},
        "sync": {**resident},
    }
    if p.critic:
        critic_grads = {} if p.offload else {
            "critic gradients (float32)": _critic_trainable(facts) * p.master_bytes // shards}
        phases["critic"] = {**resident, **critic_grads, **gathered, **reduce,
                            **_activations(facts, p, sharded, critic=True)}
    bucket = _sync_bucket(facts, p, sharded)
    if bucket:
        phases["sync"]["weight-sync bucket"] = bucket
    for phase, parts in engine.items():
        if phase in phases:
            phases[phase] = {**parts, **phases[phase]}
    return {k: {n_: b for n_, b in phases[k].items() if b} for k in PHASES if k in phases}


def judge_engines(p: PlanInputs) -> dict[str, dict[str, int]]:
    """In-process vLLM judges' shares, per phase: a judge judges right after generation (the rewards), so one that
    sleeps between calls holds its share in ``generate`` only (sleep level 1: its weights wait in host memory)."""
    out: dict[str, dict[str, int]] = {}
    for i, (utilization, sleeps) in enumerate(p.judges):
        name = "judge engine (vLLM)" + (f" {i + 1}" if len(p.judges) > 1 else "")
        for phase in (("generate",) if sleeps else PHASES):
            out.setdefault(phase, {})[name] = int(utilization * p.gpu_bytes)
    return out


def colocated_engine(facts: ModelFacts, p: PlanInputs) -> dict[str, dict[str, int]]:
    """The engine's part of a GPU it shares with training, per phase (the in-process judges' too)."""
    judges = judge_engines(p)
    if p.engine != "vllm":
        kv = p.generate_rows * p.max_model_len * kv_bytes_per_token(facts, p.compute_bytes)
        parts = {"generate": {"generation KV cache (transformers engine)": kv}}
    elif not p.sleep:
        parts = {phase: {"engine (vLLM, awake)": int(p.utilization * p.gpu_bytes)} for phase in PHASES}
    else:
        parts = {"generate": {"engine (vLLM, awake)": int(p.utilization * p.gpu_bytes)},
                 "sync": {"engine weights (woken for the sync)": engine_weight_bytes(facts, p)}}
    for phase, share in judges.items():
        parts.setdefault(phase, {}).update(share)
    return parts


def engine_problem(facts: ModelFacts, p: PlanInputs) -> str | None:
    """Why the vLLM engine could not start in its share (None: its weights and one ``max_model_len`` sequence of
    KV cache fit; vLLM also needs room for its activations and CUDA graphs, not modelled)."""
    if p.engine != "vllm":
        return None
    share = p.utilization * p.gpu_bytes
    weights = engine_weight_bytes(facts, p)
    one = (p.max_model_len * kv_bytes_per_token(facts, p.engine_bytes, p.tensor_parallel)
           + recurrent_state_bytes(facts, p.engine_bytes, p.tensor_parallel))
    if share >= weights + one:
        return None
    return (f"vLLM cannot start: rollout.gpu_memory_utilization={p.utilization} gives it {share / GIB:.1f} GiB, "
            f"less than its weights ({weights / GIB:.1f} GiB) plus the KV cache of one {p.max_model_len}-token "
            f"sequence ({one / GIB:.2f} GiB); raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size, "
            "or shorten rollout.max_model_len")


# ---- launch modes ------------------------------------------------------------------------------------------------

def plan_launch(facts: ModelFacts, p: PlanInputs, mode: str | None = None, ranks: int | None = None) -> LaunchPlan:
    """The plan of one launch mode (default: the configured one)."""
    mode = mode or p.backend
    problems: list[str] = []
    tp = p.tensor_parallel if p.engine == "vllm" else 1
    if mode == "single":
        gpus = [GpuPlan("the GPU", 1, trainer_phases(facts, p, shards=1, engine=colocated_engine(facts, p),
                                                          reference=p.reference))]
        label = "one process, 1 GPU" + (f" (+{tp - 1} for the engine)" if tp > 1 else "")
        shards = per_node = 1
    elif mode == "torchrun":
        n = shards = ranks or p.ranks
        gpus = [GpuPlan("each rank's GPU", n, trainer_phases(facts, p, shards=n, engine=colocated_engine(facts, p),
                                                              reference=p.reference))]
        label = f"torchrun over {_gpus_label(n, p.gpus_per_node)}"
        if tp > 1:
            engines = "" if n % tp else f"{n // tp} "
            label += f", {engines}engine{'' if n == tp else 's'} of {tp} GPUs"
        problems += _group_problems(n, tp, p.gpus_per_node)
        per_node = min(n, p.gpus_per_node)
    elif mode == "ray":
        shards = ranks or p.trainer_actors
        gpus = ray_gpus(facts, p, trainers=shards)
        rollout = p.rollout_actors * p.rollout_gpus
        label = f"Ray: {rollout} rollout + {shards} trainer GPU(s)"
        if rollout + shards > p.gpus_per_node:
            label += f" on {-(-(rollout + shards) // p.gpus_per_node)} nodes"
        if p.rollout_gpus > p.gpus_per_node:
            problems.append(f"a rollout actor's {p.rollout_gpus} GPUs (rollout.tensor_parallel_size) are more than "
                            f"a node's {p.gpus_per_node} (--gpus-per-node): an engine's GPUs sit on one node")
        per_node = min(shards, p.gpus_per_node)
    else:
        raise ValueError(f"unknown launch mode {mode!r}; valid: single, torchrun, ray")
    if p.offload:  # the trainers' states, in host memory
        gpus[-1].host = (host_states(facts, p, shards, reference=ray_trainer_reference(p),
                                     scores="teacher" not in p.rollout_models) if mode == "ray"
                         else host_states(facts, p, shards))
        label += ", offload"
    plan = LaunchPlan(mode, label, gpus, p.gpu_bytes, problems=problems, processes_per_node=per_node)
    for g in gpus:
        if g.peak > p.gpu_bytes:
            plan.problems.append(f"{g.name}: {g.peak / GIB:.1f} GiB in {g.peak_phase} on a "
                                 f"{p.gpu_bytes / GIB:.0f} GiB GPU")
    problem = engine_problem(facts, p)
    if problem:
        plan.problems.append(problem)
    return plan


def _gpus_label(n: int, per_node: int) -> str:
    return f"{n} GPUs" + (f" ({-(-n // per_node)} nodes x {per_node})" if n > per_node else "")


def _group_problems(ranks: int, tp: int, per_node: int) -> list[str]:
    """Why torchrun's ranks cannot form engine groups of ``tp`` (none when they can): the groups must divide the
    ranks and each sit on one node."""
    if tp <= 1:
        return []
    if ranks % tp:
        return [f"rollout.tensor_parallel_size={tp} does not divide the {ranks} torchrun ranks (the ranks form "
                f"groups of {tp} that share one engine)"]
    if tp > per_node or (ranks > per_node and per_node % tp):
        return [f"rollout.tensor_parallel_size={tp}: an engine's group of {tp} ranks must sit on one node of "
                f"{per_node} GPUs (--gpus-per-node); use a divisor of {per_node}"]
    return []


def ray_gpus(facts: ModelFacts, p: PlanInputs, *, trainers: int) -> list[GpuPlan]:
    """A rollout actor's GPU (its share of the engine; the transformers engine: the float32 policy it generates
    with and its KV cache; and whatever it scores with, ``p.rollout_models``, with its scoring forward) and a
    trainer actor's GPU (the training states, the shards of the scoring models it holds, its scoring forwards)."""
    c = facts.counts
    if p.engine == "vllm":
        resident = {"engine (vLLM, awake)": int(p.utilization * p.gpu_bytes)}
    else:
        resident = {"policy copy (float32, transformers engine)": (c.total + c.lora) * p.master_bytes,
                    "generation KV cache (transformers engine)":
                        p.generate_rows * p.max_model_len * kv_bytes_per_token(facts, p.compute_bytes)}
    resident.update(rollout_scoring_models(facts, p))
    judges = judge_engines(p)
    phases = {"generate": {**resident, **judges.get("generate", {})}}
    if p.rollout_models:  # its engine stays awake (a rollout actor's engine never sleeps)
        n = numerics(p.compute_bytes, p.master_bytes, sharded=False)
        phases["score"] = {**resident, "scoring forward": scoring_bytes(facts, n, p.score.tokens,
                                                                        p.score.response_tokens, p.chunk)}
    rollout = GpuPlan("a rollout actor's GPU", p.rollout_actors * p.rollout_gpus,
                      {k: {n_: v for n_, v in parts.items() if v} for k, parts in phases.items()})
    trainer = GpuPlan("a trainer actor's GPU", trainers,
                      trainer_phases(facts, p, shards=trainers, engine={}, reference=ray_trainer_reference(p),
                                     scores="teacher" not in p.rollout_models))
    trainer.phases.pop("generate", None)
    return [rollout, trainer]


def ray_trainer_reference(p: PlanInputs) -> bool:
    """Whether the Ray trainer actors hold the (sharded) reference: the run has one and no rollout actor keeps it."""
    return p.reference and "reference" not in p.rollout_models


def rollout_scoring_models(facts: ModelFacts, p: PlanInputs) -> dict[str, int]:
    """What a Ray rollout actor scores with beside its engine, whole (``p.rollout_models``): a float32 copy of the
    policy (a vLLM engine's; the transformers engine's is its own module), the reference and teacher in
    ``model.dtype``, a float32 critic."""
    c, models = facts.counts, p.rollout_models
    out = {}
    if "policy" in models and p.engine == "vllm":
        out["policy scoring copy weights (float32)"] = (c.total + c.lora) * p.master_bytes
    out.update(scoring_models(facts, p, 1, reference=p.reference and "reference" in models,
                              scores="teacher" in models))
    if "critic" in models:
        out["critic copy weights (float32)"] = (c.total + facts.decoder.hidden + 1) * p.master_bytes
    return out


def summary_modes(p: PlanInputs) -> list[tuple[str, int | None]]:
    """The launch modes every plan lists: one process, torchrun over 2 / 4 / 8 GPUs and over the planned ranks
    (``--ranks``) when that is more, Ray as configured."""
    sizes = [2, 4, 8] + ([p.ranks] if p.ranks > 8 else [])
    return [("single", None), *(("torchrun", n) for n in sizes), ("ray", None)]
