"""``WeightDelivery``: the policy versions of a Ray run, from the trainer ranks to the rollout actors.

Why a module of its own: a version is made (every rank takes part in gathering sharded weights), numbered, sent in
buckets (each put in Ray's object store once), kept while rollouts generated with it may still be regenerated (the
last ``k + 1`` with ``distributed.max_staleness = k``), written into a checkpoint for those in flight, and checked:
an engine that really holds the trainer's weights samples log-probs the trainer reproduces. All of that is the
version's life; the scheduling of rollouts (:mod:`mmrlhf.launch.ray.schedule`) only asks for the current one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mmrlhf.parallel.world import World

Named = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class DeliverySettings:
    max_staleness: int
    bucket_bytes: int
    weight_kind: str  # "full" | "lora" (only the adapters travel)
    push_weights: bool = True  # False: the control of the sync check (versions announced, no tensor sent)
    # a LoRA policy's engine layers merged here (W + BA, kind "full"): rollout actors without a policy copy
    # (where the trainers make the experiences) cannot merge the adapters themselves
    merged_lora: bool = False


class WeightDelivery:
    """The versions rank 0 pushes to the rollout actors of ``pool`` (every rank gathers)."""

    def __init__(self, pool: Any, world: World, settings: DeliverySettings) -> None:
        self.pool, self.world, self.s = pool, world, settings
        self.version = 0
        self.versions: dict[int, Named] = {}  # rank 0: the current version, and with k >= 1 the k before it
        self.policy: Any = None
        self.critic: Any = None
        # (share, error) of a rollout actor seen dead while a version is pushed, handled at once (restarted, or the
        # run told to stop: False, and the push waits for no one else). At once, not once every other actor took
        # the version: several rollout actors meet inside each step (mmrlhf.launch.ray.exchange), so another one
        # may be waiting for the dead one and take the version only once its step is done.
        self.on_dead: Callable[[int, str], bool] | None = None

    # ---- pushing -----------------------------------------------------------------------------------------------
    def gather(self) -> Named:
        """The trainable policy tensors (``policy.``) and the critic's (``critic.``), full CPU tensors; every rank
        takes part in the gathers of sharded ones, rank 0 keeps them."""
        from mmrlhf.parallel.world import full
        from mmrlhf.rollout.weight_sync import policy_weights

        if self.s.merged_lora:
            from mmrlhf.models.lora import merged_weights

            named = [(f"policy.{n}", t.cpu()) for n, t in merged_weights(self.policy.actor.model)]
        else:
            named = [(f"policy.{n}", t.cpu()) for n, t in policy_weights(self.policy.actor.model)]
        if self.critic is not None:
            named += [(f"critic.{n}", full(p.detach()).cpu()) for n, p in self.critic.critic.named_parameters()
                      if p.requires_grad]
        return named if self.world.is_main else []

    def push(self, targets: Sequence[int]) -> tuple[dict[str, float], dict[int, str]]:
        """The current version to rollout actors ``targets`` (every rank: the gather is collective): ``sync/*``
        metrics (rank 0) and ``{share: error}`` of the actors that died receiving it (each already given to
        ``on_dead`` where it is set)."""
        t0 = time.perf_counter()
        named = self.gather()
        if not self.world.is_main:
            return {}, {}
        k = self.s.max_staleness
        if k >= 1:  # copies (the parameters move on): in-flight rollouts of a resume are regenerated with these
            self.versions[self.version] = [(n, t.clone()) for n, t in named]
            for old in [v for v in self.versions if v < self.version - k]:
                del self.versions[old]
        else:
            self.versions = {self.version: named}  # a restarted actor gets the current version (no copy needed)
        failed = self.send(named, targets, self.version, on_dead=self.on_dead)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return {"sync/seconds": time.perf_counter() - t0, "sync/megabytes": nbytes / 2**20}, failed

    def held(self) -> bool:
        return self.version in self.versions

    def resend(self, share: int) -> str | None:
        """The current version to a restarted rollout actor ``share``."""
        return self.send(self.versions[self.version], [share], self.version).get(share)

    def send(self, named: Named, targets: Sequence[int], version: int,
             on_dead: Callable[[int, str], bool] | None = None) -> dict[int, str]:
        """``named`` as ``version`` to the rollout actors ``targets`` in buckets; {index: error} of those that died
        receiving it, each given to ``on_dead`` as soon as it is seen (which returns whether to go on waiting for
        the others)."""
        import ray

        from mmrlhf.parallel.ray_actors import describe_actor_error
        from mmrlhf.rollout.base import iter_buckets

        sent = named if self.s.push_weights else []  # the control announces versions without tensors
        buckets = list(iter_buckets(iter(sent), self.s.bucket_bytes)) or [[]]
        pending: dict[int, list[Any]] = {i: [] for i in targets}
        for b, bucket in enumerate(buckets):
            ref = ray.put(bucket)
            for i in targets:
                pending[i].append(self.pool.handles[i].update_experience_maker.remote(
                    ref, version=version, last=b == len(buckets) - 1, kind=self.s.weight_kind))
        failed: dict[int, str] = {}
        waiting = {ref: i for i, refs in pending.items() for ref in refs}
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1)
            i = waiting.pop(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                failed[i] = describe_actor_error(exc)
                for ref in [r for r, j in waiting.items() if j == i]:
                    del waiting[ref]
                if on_dead is not None and not on_dead(i, failed[i]):
                    break  # the run stops: the others may wait for the dead one and never take the version
        return failed

    # ---- the sync check ----------------------------------------------------------------------------------------
    def sync_check(self, items: Sequence[Any], current: Sequence[torch.Tensor], fresh: Sequence[bool]) -> dict:
        """Mean / max |engine log-prob - trainer log-prob| over the response tokens the trainer's current version
        sampled, over all ranks: an engine that kept old weights shows here. Those are the tokens of fresh
        (staleness 0) samples, or with ``rollout.partial`` (per-token ``rollout_versions``) every token of this
        version, whichever sample it ends."""
        diffs = []
        for it, lp, f in zip(items, current, fresh):
            if "rollout_log_probs" not in it.token:
                continue
            mask = it.token["loss_mask"]
            if "rollout_versions" in it.token:
                mask = mask & (it.token["rollout_versions"] == self.version)
            elif not f:
                continue
            diffs.append((it.token["rollout_log_probs"] - lp).abs()[mask])
        d = torch.cat(diffs) if diffs else torch.zeros(0)
        total, count = self.world.all_sum([float(d.sum()), float(d.numel())])
        top = self.world.all_max([float(d.max()) if d.numel() else 0.0])[0]
        if not count:
            return {}
        return {"engine_logprob_diff/trainer_mean": total / count, "engine_logprob_diff/trainer_max": top}

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self, folder: Path, version: int) -> None:
        """Version ``version``'s tensors into ``folder/inflight/`` (a rollout in flight was generated with it)."""
        from safetensors.torch import save_file

        path = folder / "inflight" / f"version-{version}.safetensors"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            save_file({n: t.contiguous() for n, t in self.versions[version]}, str(path))

    @staticmethod
    def load(folder: Path, versions: Sequence[int]) -> dict[int, Named]:
        """What :meth:`save` wrote of ``versions``."""
        from safetensors.torch import load_file

        return {v: list(load_file(str(folder / "inflight" / f"version-{v}.safetensors")).items())
                for v in sorted(set(versions))}
