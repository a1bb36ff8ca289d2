"""``distributed``: how a run is spread over processes (single process, ``torchrun`` + FSDP2, or Ray actors) and how
the rollout side and the training side are coupled (synchronous or with bounded staleness)."""

from __future__ import annotations

from typing import Dict, Literal, Optional

from pydantic import Field, model_validator

from mmrlhf.config.base import Section


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # Ray's own: not custom resources


class DistributedConfig(Section):
    """Read by ``mmrlhf train`` before anything is built (``mmrlhf.launch``). Three launch modes:

    * one process: ``mmrlhf train CONFIG`` (the default, ``backend: auto`` outside torchrun);
    * ``torchrun --nproc-per-node N -m mmrlhf train CONFIG``: every rank trains an FSDP2 shard of the actor (and
      critic) and generates its share of the prompts with its own engine (``backend: auto`` picks this when
      ``WORLD_SIZE`` > 1);
    * ``mmrlhf train CONFIG distributed.backend=ray``: rollout actors (``ExperienceMakerHolder``) generate and score
      experiences and send them to trainer actors, which push the new weights back.
    """

    backend: Literal["auto", "single", "torchrun", "ray"] = "auto"
    """``auto``: ``torchrun`` when launched by torchrun (``WORLD_SIZE`` > 1), else ``single``. ``ray`` runs the rollout
    and training sides as Ray actors (see ``ray_address`` and the ``*_actors`` keys)."""
    process_group: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the training ranks: ``auto`` is ``nccl`` on CUDA, ``gloo`` on the CPU."""
    mixed_precision: Literal["auto", "none", "bf16", "fp16"] = "auto"
    """FSDP2 mixed precision of several training ranks (torchrun, Ray trainer actors), which FOLLOWS
    ``model.dtype`` (the one source of truth: the compute dtype in every launch mode): ``auto`` (default) casts the
    float32 parameter shards to ``model.dtype`` for the forward and backward and reduces gradients in float32 (none
    for ``model.dtype=float32``). An explicit value
    must agree with ``model.dtype`` (``bf16`` with ``bfloat16``, ``none`` with ``float32``); a contradiction is
    refused."""

    offload: Literal["none", "params"] = "none"
    """Host memory for the trained models' states, through FSDP2's CPU offload. ``params``: the actor's and the
    critic's float32 parameters, their gradients and their AdamW moments live in host memory (pinned on an
    accelerator); FSDP2 copies each unit's parameters to the device for its forward and backward (cast to
    ``model.dtype``) and its gradients back after the reduce-scatter, and the optimiser steps on the CPU. The frozen
    models that score beside them (the reference, a distillation teacher: sharded with the policy) keep their
    ``model.dtype`` weights there too. What stays on the GPU: the gathered units, the activations and the engine. The cost is time: every
    forward and backward moves the weights over the host link, and AdamW runs on the CPU (about 2 x 16 bytes per
    parameter read and written each step). One process shards over a world of one rank for it (a local process
    group is made); torchrun ranks and Ray trainer actors offload their own shards. ``mmrlhf config show CONFIG
    --plan`` shows what it saves (a Qwen2.5-VL-7B full fine-tune fits one 80 GB GPU with it) and the host memory it
    needs. Refused with ``rollout.engine: transformers`` (that engine generates with the policy itself)."""

    # ---- Ray -----------------------------------------------------------------------------------------------------
    ray_address: Optional[str] = None
    """Ray cluster to join (``ray://host:10001`` or ``auto``); None: ``RAY_ADDRESS`` if set, else a local Ray
    instance is started for the run (and stopped at its end)."""
    num_rollout_actors: int = Field(default=1, ge=1)
    """Rollout actors (``ExperienceMakerHolder``): each owns an engine, the scoring models and the rewards, takes its
    share of the prompts and sends finished experiences to trainer rank 0, which deals every trainer actor whole
    prompt groups."""
    rollout_actor_cpus: float = Field(default=1.0, gt=0)
    """CPUs reserved for each rollout actor."""
    rollout_actor_gpus: Optional[float] = Field(default=None, ge=0)
    """GPUs reserved for each rollout actor. None (auto): ``rollout.tensor_parallel_size`` GPUs on a cluster with
    GPUs (the actor's engine owns them), 0 on a CPU cluster. 0 on a GPU cluster is refused (Ray would leave every
    actor on GPU 0); a fraction shares a GPU (tensor_parallel_size 1 only)."""
    num_trainer_actors: int = Field(default=1, ge=1)
    """Trainer actors: the training ranks of the one loop, one torch process group (``process_group``) sharding the
    policy and critic with FSDP2; all gather the new weights after each update and the first pushes them to every
    rollout actor. ``trainer.rollout_batch_size`` and ``trainer.train_batch_size`` must be multiples of it."""
    trainer_actor_cpus: float = Field(default=1.0, gt=0)
    """CPUs reserved for each trainer actor."""
    trainer_actor_gpus: Optional[float] = Field(default=None, ge=0)
    """GPUs reserved for each trainer actor. None (auto): 1 on a cluster with GPUs, 0 on a CPU cluster; 0 on a GPU
    cluster is refused (the trainer would share GPU 0 with the engines)."""
    rollout_actor_resources: Dict[str, float] = Field(default_factory=dict)
    """Ray custom resources each rollout actor reserves besides its CPUs and GPUs (e.g. ``{rollout_node: 1}``): the
    actor's bundle goes only to a node started with that resource (``ray start --resources '{"rollout_node": 4}'``),
    so rollout actors and trainer actors land on the nodes meant for them. Empty (default): any node. The cluster
    must hold every resource the actors ask for in all (refused by key before any actor starts); ``CPU``, ``GPU``
    and ``memory`` are the ``*_cpus`` / ``*_gpus`` keys' business, not names here."""
    trainer_actor_resources: Dict[str, float] = Field(default_factory=dict)
    """Ray custom resources each trainer actor reserves (as ``rollout_actor_resources``), e.g.
    ``{trainer_node: 1}`` to put the training ranks on the nodes started with ``trainer_node``."""
    max_staleness: int = Field(default=0, ge=0)
    """Asynchronous training: how many policy versions an experience may lag behind the policy that trains on it.
    0 is synchronous (generation waits for every update); k >= 1 lets rollout actors generate the next batches while
    the trainer updates, with the importance-sampling rollout correction (``algorithm.rollout_correction``) on the
    engine's log-probs covering the gap. Ray mode only."""
    scoring: Literal["auto", "trainer", "rollout"] = "auto"
    """Ray mode: where the experiences are scored. ``trainer``: the rollout actors generate and reward only and send
    the step's rows; the trainer actors make the experiences (old-policy log-probs, reference, teacher, critic values,
    the shaping and its running state) with their FSDP2-sharded models, as torchrun ranks do, so a rollout actor
    holds its engine alone (a 32B policy's float32 copy is ~128 GiB) in every configuration (refused with
    ``model.lora.sync: vllm_lora``: the trainers send merged LoRA layers). ``auto``: the same wherever the rollout
    side would read the old policy (a KL term in the reward, the distillation advantage, a critic,
    ``rollout.routing_replay``, ``agent``, a truncating sampler scored as sampled), except with LoRA (each rollout
    actor keeps a policy copy that merges the adapters the trainers send: megabytes a sync) and a transformers engine
    (it generates with the policy's module); elsewhere the rollout actors make the experiences and the trainer
    actors re-score the old policy (and a KL-loss reference, a distillation-loss teacher). ``rollout``: each rollout
    actor scores with its own copy (it then also reports its engine-vs-copy ``engine_logprob_diff/mean|max``).
    ``ray/rollout_scoring_models`` counts the models a rollout actor scores with beside its engine; the memory plan
    counts them on its GPU. docs/distributed.md, "Where the Ray mode scores"."""
    on_rollout_failure: Literal["stop", "restart"] = "stop"
    """A rollout actor that dies: ``stop`` reports it by name and ends the run cleanly (checkpoint saved); ``restart``
    starts a new one (up to ``max_actor_restarts`` times) and regenerates its unfinished batch."""
    max_actor_restarts: int = Field(default=1, ge=0)
    """Restarts allowed per rollout actor with ``on_rollout_failure: restart``."""

    @model_validator(mode="after")
    def _check(self) -> "DistributedConfig":
        for key in ("rollout_actor_resources", "trainer_actor_resources"):
            for name, amount in getattr(self, key).items():
                if name in RAY_BUILTIN_RESOURCES:
                    own = {"CPU": "cpus", "GPU": "gpus"}.get(name)
                    hint = f"set distributed.{key.replace('resources', own)} instead" if own else "leave it out"
                    raise ValueError(f"distributed.{key}: {name!r} is one of Ray's own resources, not a custom one; "
                                     f"{hint}")
                if not amount > 0:
                    raise ValueError(f"distributed.{key}.{name}={amount:g}: an amount must be > 0 (leave the name out "
                                     "to place the actors on any node)")
        if self.max_staleness and self.backend not in ("ray",):
            raise ValueError(f"distributed.max_staleness={self.max_staleness} needs distributed.backend=ray "
                             f"(got {self.backend!r}); the other launch modes train synchronously")
        return self
