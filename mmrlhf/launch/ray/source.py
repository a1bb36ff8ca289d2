"""``RayRollouts``: the rollout source of the Ray mode. The rollout actors generate and score; the trainer ranks
(the Ray trainer actors, a :class:`~mmrlhf.parallel.world.World` of their own) train through the one loop.

Rank 0 drives the rollout actors under the staleness bound ``k`` (``distributed.max_staleness``): at step ``t`` the
rollouts of every step up to ``t + k`` have been asked for, with policy version ``>= s - k`` for step ``s``. It
awaits step ``t``'s shares, counts them in the ledger, splits their samples over the ranks (whole GRPO groups per
rank) and hands each rank its part. Every rank re-scores its samples with its own policy: the engine-vs-trainer
check of the weight sync (``engine_logprob_diff/trainer_*``: a fresh sample was drawn with the very weights the
trainer holds), and with ``k >= 1`` the old-policy log-probs of the PPO ratio at the trainer's current version. After
the update every rank takes part in gathering the new weights, and rank 0 pushes them to the rollout actors in
buckets (each bucket put in the object store once).

A resume with ``k >= 1`` regenerates the rollouts that were in flight at the save with the policy versions that
generated them (the checkpoint keeps those versions' trainable tensors in ``inflight/``) and the same sampling
seeds, so the resumed run continues exactly as the straight one would.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from mmrlhf.experience.batching import group_keys, split_experience
from mmrlhf.experience.rollout import merge_share_metrics
from mmrlhf.launch.ray.holder import holder_name
from mmrlhf.launch.ray.ledger import ExperienceLedger, StalenessStats, check_staleness, min_rollout_version
from mmrlhf.parallel.world import World
from mmrlhf.trainer.rollouts import RolloutSourceError, StepBatch

logger = logging.getLogger(__name__)


class RolloutActorFailure(RolloutSourceError):
    """A rollout actor died and the run may not (or can no longer) restart it."""


@dataclass(frozen=True)
class RaySettings:
    max_steps: int
    max_staleness: int
    on_rollout_failure: str  # "stop" | "restart"
    max_actor_restarts: int
    bucket_bytes: int
    weight_kind: str  # "full" | "lora" (only the adapters travel)
    push_weights: bool = True  # False: the control of the sync check (versions announced, no tensor sent)
    # The trainer ranks' re-scoring forwards, no-grad like the experience maker's: rollout.micro_rollout_batch_size
    # and rollout.max_tokens_per_micro_batch (mmrlhf.parallel.micro_batches)
    scoring_micro_batch_size: int = 16
    scoring_max_tokens: int | str | None = None


class RayRollouts:
    def __init__(self, pool: Any, world: World, settings: RaySettings) -> None:
        self.pool, self.world, self.s = pool, world, settings
        self.k = settings.max_staleness
        self.version = 0
        self.ledger, self.stats = ExperienceLedger(), StalenessStats()
        self.restarts = [0] * pool.count  # this run's, per rollout actor (each has its own restart budget)
        self.restarts_before = 0  # what the runs before a resume restarted (the metric counts the whole run)
        self.failures: list[str] = []
        self.pending: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.submitted = -1
        self.deferred: str | None = None  # why the run must stop (a rollout actor lost): raised at the next collect
        self.versions: dict[int, list[tuple[str, torch.Tensor]]] = {}  # rank 0, k >= 1: the last k pushed versions
        self.resume: dict[str, Any] | None = None
        self.stream_after: dict[int, dict[str, Any]] = {}  # step -> the prompt stream's state after its prompts
        self.t_start = time.perf_counter()
        self.trainer_wait = self.rollout_wait = 0.0
        self.policy = self.critic = None

    # ---- start -------------------------------------------------------------------------------------------------
    def start(self, step: int, policy: Any, critic: Any | None) -> None:
        self.policy, self.critic = policy, critic
        self.version, self.submitted = step, step - 1
        if self.world.is_main and self.resume is not None:
            self._check_position(step)
            # regenerate what was in flight at the save, each step with the version that generated it
            for entry in self.resume.get("inflight", []):
                version = entry["version"]
                self._send(self.resume["tensors"][version], range(self.pool.count), version)
                self._submit_step(entry["step"])
                for share in range(self.pool.count):
                    self._await_share(entry["step"], share)
        self._push(range(self.pool.count))  # every rank: the gather of sharded weights is collective

    def _check_position(self, step: int) -> None:
        import ray

        holder = self.pool.handles[0]
        want = ray.get(holder.stream_state.remote(step))
        have = self.resume["stream"]
        if ray.get(holder.stream_index.remote(have)) != ray.get(holder.stream_index.remote(want)):
            raise ValueError(f"the checkpoint's prompt stream is at epoch {have['epoch']} position {have['position']},"
                             f" but the Ray mode's rollout actors read step {step}'s prompts at epoch {want['epoch']} "
                             f"position {want['position']} (was it written with algorithm.dynamic_sampling?): resume "
                             "it in the launch mode that wrote it")

    # ---- collect -----------------------------------------------------------------------------------------------
    def collect(self, step: int) -> StepBatch:
        t0 = time.perf_counter()
        if self.world.is_main:
            try:
                parts = self._parts(step)
            except Exception as exc:  # the other ranks wait for their parts: they stop too, then this one raises
                self.world.scatter_objects([("error", f"{type(exc).__name__}: {exc}")] * self.world.world_size)
                raise
            mine = self.world.scatter_objects(parts)
        else:
            mine = self.world.scatter_objects(None)
            if isinstance(mine, tuple):
                raise RolloutSourceError(mine[1])
        items, temperature, truncation = mine["items"], mine["temperature"], mine["truncation"]
        with torch.no_grad():
            current, outside = self._log_probs(items, temperature, truncation)  # [A_i] per item each
        for it, out in zip(items, outside):  # outside this policy's kept set: out of the loss (and of the check)
            it.token["loss_mask"] = it.token["loss_mask"] & ~out
        metrics = self._sync_check(items, current, mine["fresh"])
        if self.k >= 1:
            for it, lp in zip(items, current):
                it.token["action_log_probs"] = lp
        metrics.update(mine["metrics"])
        return StepBatch(items, metrics, temperature=temperature, truncation=truncation,
                         seconds={"rollout": time.perf_counter() - t0})

    def _parts(self, step: int) -> list[dict[str, Any]]:
        """Rank 0: step ``step``'s samples from every rollout actor, split over the ranks (whole groups)."""
        import ray

        if self.deferred is not None:
            raise RolloutActorFailure(self.deferred)
        t0 = time.perf_counter()
        while self.submitted < min(step + self.k, self.s.max_steps - 1):
            self._submit_step(self.submitted + 1)
        metas = [self._await_share(step, share) for share in range(self.pool.count)]
        self.stream_after = {step: metas[0]["stream"]}
        waited = time.perf_counter() - t0
        self.trainer_wait += waited
        payloads = ray.get([self.pending[(step, share)][1] for share in range(self.pool.count)])
        for share in range(self.pool.count):
            del self.pending[(step, share)]
        scorings = {(p["temperature"], p["truncation"]) for p in payloads}
        if len(scorings) != 1:
            raise ValueError(f"step {step}: experiences scored under different distributions "
                             f"{sorted(map(str, scorings))}")
        n, (temperature, truncation) = self.world.world_size, scorings.pop()
        parts = [{"items": [], "fresh": [], "temperature": temperature, "truncation": truncation,
                  "metrics": {"samples": 0.0}} for _ in range(n)]
        staleness, order = [], {}
        for p in payloads:
            s = check_staleness(self.version, p["version"], self.k)
            share_items = [it for exp in p["experiences"] for it in split_experience(exp)]
            # An item's tensors are views of its experience's: handed to another rank (pickled), a view would carry
            # the experience's whole storage with it.
            if n > 1:
                share_items = [_compact(it) for it in share_items]
            if len(share_items) != p["samples"]:
                raise RuntimeError(f"step {step}, share {p['share']}: {p['samples']} samples announced, "
                                   f"{len(share_items)} in the experiences")
            self.ledger.produce(step, p["share"], p["samples"])
            self.ledger.consume(step, p["share"], len(share_items))
            staleness.append(s)
            self.stats.add(s, p["samples"])
            for it, key in zip(share_items, group_keys(share_items)):
                rank = order.setdefault((p["share"], key), len(order) % n)  # whole groups, dealt in turn
                parts[rank]["items"].append(it)
                parts[rank]["fresh"].append(s == 0)
        parts[0]["metrics"] = self._step_metrics(step, metas, staleness, waited)
        for part in parts:  # each rank's own count: the loop weighs its per-rank metrics by it, and sums it
            part["metrics"]["samples"] = float(len(part["items"]))
        return parts

    def _step_metrics(self, step: int, metas: Sequence[dict], staleness: list[int], waited: float) -> dict:
        """The rollout metrics of the step's shares merged (counts summed, per-sample means weighted), the ledger's
        counts and the ``async/*`` timings (rank 0 reports them once for the step)."""
        out = merge_share_metrics([m["metrics"] for m in metas], [m["samples"] for m in metas])
        out["samples"] = float(sum(m["samples"] for m in metas))
        out["async/generate_s"] = max(m["generate_s"] for m in metas)
        out.update(self.ledger.check_step(step, self.pool.count))
        rollout_wait = sum(m["rollout_wait_s"] for m in metas) / len(metas)
        self.rollout_wait += rollout_wait
        wall = time.perf_counter() - self.t_start
        out.update(self.stats.metrics(staleness))
        out.update({"async/trainer_wait_s": waited, "async/rollout_wait_s": rollout_wait,
                    "async/trainer_wait_share": self.trainer_wait / wall,
                    "async/rollout_wait_share": self.rollout_wait / wall,
                    "async/policy_version": float(self.version), "time/wall": wall,
                    "ray/actor_restarts": float(self.restarts_before + sum(self.restarts))})
        return out

    def _submit_step(self, step: int) -> None:
        for share in range(self.pool.count):
            self._submit(step, share)
        self.submitted = max(self.submitted, step)

    def _submit(self, step: int, share: int) -> None:
        meta, data = self.pool.handles[share].generate.options(num_returns=2).remote(
            step, min_rollout_version(step, self.k))
        self.pending[(step, share)] = (meta, data)

    def _await_share(self, step: int, share: int) -> dict[str, Any]:
        """The metadata of ``step``'s share from rollout actor ``share``, restarting the actor (and regenerating its
        unfinished batches) when it died and the policy allows."""
        import ray

        from mmrlhf.launch.ray.runtime import describe_actor_error

        while True:
            try:
                return ray.get(self.pending[(step, share)][0])
            except ray.exceptions.RayActorError as exc:
                self._on_failure(share, describe_actor_error(exc), self.versions.get(self.version))

    def _on_failure(self, share: int, error: str, named: list | None) -> None:
        """Apply ``distributed.on_rollout_failure`` to the death of rollout actor ``share`` (rank 0)."""
        message = f"rollout actor {holder_name(share)!r} died: {error}"
        self.failures.append(message)
        logger.error(message)
        s = self.s
        if s.on_rollout_failure == "stop" or self.restarts[share] >= s.max_actor_restarts or named is None:
            why = ("distributed.on_rollout_failure=stop" if s.on_rollout_failure == "stop" else
                   f"distributed.max_actor_restarts={s.max_actor_restarts} reached")
            self.deferred = f"{message} ({why})"  # the run stops: a save must not wait on the dead actor
            raise RolloutActorFailure(self.deferred)
        self.restarts[share] += 1
        self.pool.restart(share)
        failed = self._send(named, [share], self.version)
        if failed:
            self.deferred = f"restarted {holder_name(share)!r} died again: {failed}"
            raise RolloutActorFailure(self.deferred)
        lost = sorted(key for key in self.pending if key[1] == share)
        for step, _ in lost:  # nothing of these reached the trainer (the ledger would refuse a second delivery)
            self._submit(step, share)
        logger.warning("restarted %r (%d/%d); regenerating steps %s", holder_name(share), self.restarts[share],
                       s.max_actor_restarts, [st for st, _ in lost])

    # ---- scoring -----------------------------------------------------------------------------------------------
    def _log_probs(self, items: list[Any], temperature: float,
                   truncation: Any = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """[A_i] log-probs of each item's response under this rank's policy, in item order, and [A_i] bool: the
        token lay outside this policy's kept set (all False untruncated). The micro-batches are planned by cost
        (``scoring_max_tokens``, :mod:`mmrlhf.parallel.micro_batches`) and every rank runs as many forwards as the
        plan agrees on (sharded forwards are collective); a padding forward repeats a micro-batch and is dropped."""
        from mmrlhf.experience.batching import collate
        from mmrlhf.experience.costs import forward_layout, item_costs
        from mmrlhf.models.placement import to_host
        from mmrlhf.parallel.micro_batches import plan_micro_batches

        s, actor = self.policy.s, self.policy.actor
        actor.eval()
        layout = forward_layout(packing=s.packing, shared_prompt=s.shared_prompt,
                                max_row_tokens=s.shared_prompt_max_tokens)
        plan = plan_micro_batches(item_costs(items, adapter=actor.adapter, grouped=s.shared_prompt),
                                  [list(range(len(items)))], layout, samples=self.s.scoring_micro_batch_size,
                                  tokens=self.s.scoring_max_tokens, world=self.world)
        out: list[torch.Tensor | None] = [None] * len(items)
        outside: list[torch.Tensor | None] = [None] * len(items)
        first = next((m for m in plan.micro_batches[0] if m), list(range(min(len(items), 1))))
        for micro in plan.micro_batches[0]:
            part = [items[i] for i in micro or first]
            batch = collate(part, packed=s.packing, pad_id=self.policy.pad_id, adapter=actor.adapter,
                            shared_prompt=s.shared_prompt, max_row_tokens=s.shared_prompt_max_tokens)
            scored = to_host(actor(batch.samples, vision_extra=batch.vision_extra, temperature=temperature,
                                   truncation=truncation))
            lp = scored.log_probs
            cut = scored.outside if scored.outside is not None else torch.zeros_like(scored.action_mask)
            for j, i in enumerate(micro):  # none for a padding forward
                out[i] = lp[j, : len(items[i].response_ids)].float()  # [b, A] -> [A_i]
                outside[i] = cut[j, : len(items[i].response_ids)].bool()
        return out, outside

    def _sync_check(self, items: Sequence[Any], current: Sequence[torch.Tensor], fresh: Sequence[bool]) -> dict:
        """Mean / max |engine log-prob - trainer log-prob| over the response tokens of fresh (staleness 0) samples,
        over all ranks."""
        diffs = [(it.token["rollout_log_probs"] - lp).abs()[it.token["loss_mask"]]
                 for it, lp, f in zip(items, current, fresh) if f and "rollout_log_probs" in it.token]
        d = torch.cat(diffs) if diffs else torch.zeros(0)
        total, count = self.world.all_sum([float(d.sum()), float(d.numel())])
        top = self.world.all_max([float(d.max()) if d.numel() else 0.0])[0]
        if not count:
            return {}
        return {"engine_logprob_diff/trainer_mean": total / count, "engine_logprob_diff/trainer_max": top}

    # ---- publish -----------------------------------------------------------------------------------------------
    def publish(self, policy: Any, critic: Any | None, *, updated: bool) -> dict[str, float]:
        if not updated:
            return {}
        self.version += 1
        return self._push(range(self.pool.count))

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The trainable policy tensors (``policy.``) and the critic's (``critic.``), full CPU tensors; every rank
        takes part in the gathers of sharded ones."""
        from mmrlhf.parallel.world import full
        from mmrlhf.rollout.weight_sync import policy_weights

        named = [(f"policy.{n}", t.cpu()) for n, t in policy_weights(self.policy.actor.model)]
        if self.critic is not None:
            named += [(f"critic.{n}", full(p.detach()).cpu()) for n, p in self.critic.critic.named_parameters()
                      if p.requires_grad]
        return named if self.world.is_main else []

    def _push(self, targets: Sequence[int]) -> dict[str, float]:
        """The current version to rollout actors ``targets``: ``sync/*`` metrics (rank 0)."""
        t0 = time.perf_counter()
        named = self._named_weights()
        if not self.world.is_main:
            return {}
        if self.k >= 1:  # copies (the parameters move on): in-flight rollouts of a resume are regenerated with these
            self.versions[self.version] = [(n, t.clone()) for n, t in named]
            for old in [v for v in self.versions if v < self.version - self.k]:
                del self.versions[old]
        else:
            self.versions = {self.version: named}  # a restarted actor gets the current version (no copy needed)
        failed = self._send(named, targets, self.version)
        for share, error in failed.items():
            try:
                self._on_failure(share, error, named)
            except RolloutActorFailure:  # self.deferred: every rank learns it at the next collect, saves, stops
                break
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return {"sync/seconds": time.perf_counter() - t0, "sync/megabytes": nbytes / 2**20}

    def _send(self, named: list[tuple[str, torch.Tensor]], targets: Sequence[int], version: int) -> dict[int, str]:
        """Send ``named`` as ``version`` to the rollout actors ``targets`` in buckets; {index: error} of those that
        died receiving it."""
        import ray

        from mmrlhf.launch.ray.runtime import describe_actor_error
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
        for i, refs in pending.items():
            try:
                ray.get(refs)
            except ray.exceptions.RayActorError as exc:
                failed[i] = describe_actor_error(exc)
        return failed

    # ---- the rest ----------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        import ray

        return ray.get(self.pool.handles[0].evaluate.remote())

    def save(self, folder: Path, step: int) -> dict[str, Any]:
        """Rank 0: the data position the rollout actors read at ``step`` (the one-process format, so every mode can
        resume it) and, with ``k >= 1``, the rollouts in flight: their steps, the versions that generate them, and
        those versions' tensors (``inflight/``). A run stopped by a dead rollout actor records none: its resume
        generates those steps with the checkpoint's version."""
        import ray
        from safetensors.torch import save_file

        if not self.world.is_main:
            return {}
        stream = self.stream_after.get(step - 1)  # read from the last step's metadata: its actor may be gone since
        if stream is None:
            stream = ray.get(self.pool.handles[0].stream_state.remote(step))
        state = {"stream": stream, "maker": {"calls": step * self.pool.count}, "policy_version": self.version,
                 "staleness": self.stats.state_dict(), "actor_restarts": self.restarts_before + sum(self.restarts),
                 "inflight": []}
        if self.deferred is not None:
            return state  # stopped by a dead rollout actor: what was in flight is regenerated by a resume
        for s in sorted({st for st, _ in self.pending}):
            versions = {self._await_share(s, share)["version"] for share in range(self.pool.count)}
            if len(versions) != 1:
                raise RuntimeError(f"step {s} in flight with several versions {sorted(versions)}")
            version = versions.pop()
            state["inflight"].append({"step": s, "version": version})
            path = folder / "inflight" / f"version-{version}.safetensors"
            if not path.exists():
                path.parent.mkdir(exist_ok=True)
                save_file({n: t.contiguous() for n, t in self.versions[version]}, str(path))
        return state

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        from safetensors.torch import load_file

        self.resume = dict(state)
        self.resume["tensors"] = {}
        # the run-long counts go on (a checkpoint of another launch mode has none: every sample there was fresh,
        # and the histogram starts at this resume)
        self.stats.load_state_dict(state.get("staleness", {}))
        self.restarts_before = int(state.get("actor_restarts", 0))
        if self.world.is_main:
            for entry in state.get("inflight", []):
                v = entry["version"]
                if v not in self.resume["tensors"]:
                    loaded = load_file(str(folder / "inflight" / f"version-{v}.safetensors"))
                    self.resume["tensors"][v] = list(loaded.items())

    def close(self) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """What the driver prints at the end (rank 0)."""
        produced, consumed = self.ledger.check_all() if not self.pending else (0, 0)
        return {"produced": produced, "consumed": consumed, "staleness": dict(sorted(self.stats.counts.items())),
                "failures": list(self.failures)}


def _compact(item: Any) -> Any:
    """``item`` with its own copies of its tensors (not views into the experience it was split from)."""
    def own(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in d.items()}

    return replace(item, vision=own(item.vision), vision_extra=own(item.vision_extra), token=own(item.token),
                   info=own(item.info), policy_mask=None if item.policy_mask is None else item.policy_mask.clone())
