"""``RayRollouts``: the rollout source of the Ray mode. The rollout actors generate and score; the trainer ranks
(the Ray trainer actors, a :class:`~mmrlhf.parallel.world.World` of their own) train through the one loop.

Rank 0 asks the rollout actors for step ``t``'s rollouts under the staleness bound ``k`` (``distributed.max_staleness``,
:mod:`mmrlhf.launch.ray.schedule`), awaits its shares, counts them in the ledger, and deals their samples to the
ranks (whole GRPO groups per rank). Every rank re-scores its samples with its own policy
(``PolicyUpdater.score``, through the rank-aligned forward loop every forward shares): the engine-vs-trainer check of
the weight sync (``engine_logprob_diff/trainer_*``: a fresh sample was drawn with the very weights the trainer
holds), and with ``k >= 1`` the old-policy log-probs of the PPO ratio at the trainer's current version. After the
update every rank takes part in gathering the new weights, which rank 0 pushes to the rollout actors
(:mod:`mmrlhf.launch.ray.delivery`). Items travel between processes columnar (:mod:`mmrlhf.experience.wire`).

A resume with ``k >= 1`` regenerates the rollouts that were in flight at the save with the policy versions that
generated them (the checkpoint keeps those versions' trainable tensors in ``inflight/``) and the same sampling
seeds, and the run-long counts (staleness histogram, actor restarts) go on from the checkpoint, so the resumed run
continues, and reports, exactly as the straight one would.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mmrlhf.experience.batching import group_keys, inert_item
from mmrlhf.experience.costs import patch_rows
from mmrlhf.experience.rescoring import score_items, with_reference, with_teacher
from mmrlhf.experience.rollout import merge_share_metrics
from mmrlhf.experience.wire import PackedItems, pack_items, unpack_items
from mmrlhf.launch.ray.delivery import DeliverySettings, WeightDelivery
from mmrlhf.launch.ray.holder import running_state
from mmrlhf.launch.ray.ledger import ExperienceLedger, StalenessStats, WaitShares, check_staleness
from mmrlhf.launch.ray.schedule import RolloutSchedule, ScheduleSettings
from mmrlhf.parallel.dealing import deal_by_cost, imbalance
from mmrlhf.parallel.world import World
from mmrlhf.trainer.rollouts import RolloutSourceError, StepBatch
from mmrlhf.trainer.run_checkpoint import RANK_SEEDS, rank_seeds_of

logger = logging.getLogger(__name__)

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
    report_steps: int = 0  # trainer.report_steps: rollout actor 0 sends those steps' report samples
    # algorithm.dynamic_sampling: the rollout actors read the stream on from step to step (a resume or a restart
    # sets where, rather than checking it)
    sequential: bool = False
    kl_estimator: str = "k3"  # algorithm.kl_estimator: the per-token KL recorded beside the trainers' reference
    distill_topk: int = 16  # algorithm.distill_topk: the teacher tokens the trainers record per position
    # the old-policy log-probs and entropies are computed here, before the update (the rollout actors hold no
    # scoring copy: mmrlhf.models.ray_placement.policy_on_trainers)
    old_policy: bool = False
    # the trainers make the experiences (mmrlhf.models.ray_placement.experiences_on_trainers): the rollout actors
    # send rows (generated and rewarded) and every rank makes its groups' experiences with ``RayRollouts.maker``
    rows: bool = False


class RayRollouts:
    def __init__(self, pool: Any, world: World, settings: RaySettings, *, reference: Any = None,
                 teacher: Any = None, maker: Any = None, merged_lora: bool = False) -> None:
        s = settings
        self.pool, self.world, self.s = pool, world, settings
        # the reference and the distillation teacher these ranks score the step's items with (sharded like the
        # policy), or None: the rollout actors scored them (or the run needs none)
        self.reference, self.teacher = reference, teacher
        # ``settings.rows``: this rank's experience maker without an engine (its models sharded with the policy:
        # mmrlhf.experience.builder.build_scoring_maker); it holds the running state (reward normaliser, KL
        # coefficient) that a checkpoint saves
        self.maker = maker
        if s.rows and maker is None:
            raise ValueError("RayRollouts: settings.rows needs the trainer's experience maker")
        self.weights = WeightDelivery(pool, world, DeliverySettings(s.max_staleness, s.bucket_bytes, s.weight_kind,
                                                                    s.push_weights, merged_lora))
        self.schedule = RolloutSchedule(pool, ScheduleSettings(s.max_steps, s.max_staleness, s.on_rollout_failure,
                                                               s.max_actor_restarts, s.report_steps), self.weights)
        self.weights.on_dead = self._dead
        self.schedule.place = self._place
        self.ledger, self.stats = ExperienceLedger(), StalenessStats()
        self.resume: dict[str, Any] | None = None
        # step -> the rollout actors' prompt stream and maker state after it (the running statistics: reward
        # normalisation, adaptive KL; with dynamic sampling also the sampling calls), for the last few steps taken:
        # where a checkpoint says the next step begins, and where a restarted actor regenerates from
        self.stream_after: dict[int, dict[str, Any]] = {}
        self.maker_after: dict[int, dict[str, Any]] = {}
        # the running statistics after the last trained step's shaping: what a checkpoint holds (steps generated
        # ahead are regenerated from it at a resume)
        self.running: dict[str, Any] = {}
        self.waits = WaitShares()
        # how the rollout actors > 0 derive their seeds with dynamic sampling (the checkpoint's, on a resume)
        self.rank_seeds = RANK_SEEDS

    def start(self, step: int, policy: Any, critic: Any | None) -> None:
        # (with rows the critic stays here: the rollout actors hold none)
        self.weights.policy, self.weights.critic = policy, None if self.s.rows else critic
        self.weights.version, self.schedule.submitted = step, step - 1
        if self.s.rows and self.resume is not None:  # every rank's maker shapes the steps to come
            self.maker.load_state_dict(running_state(self.resume.get("maker", {})))
        if self.world.is_main and self.resume is not None:
            import ray

            maker = self.resume.get("maker", {})
            if not self.s.sequential:  # (dynamic sampling: the stream goes on where it stood, whatever the step)
                check_position(self.pool.handles[0], step, self.resume["stream"])
            # dynamic sampling: the stream and the sampling calls go on where they stood; else the running state
            self.running = dict(maker) if self.s.sequential else running_state(maker)
            self.stream_after[step - 1], self.maker_after[step - 1] = self.resume["stream"], self.running
            self._place(range(self.pool.count), step)  # before anything is generated again, in flight or not
            for entry in self.resume.get("inflight", []):  # what was in flight at the save, with its version
                self.weights.send(self.resume["tensors"][entry["version"]], range(self.pool.count), entry["version"])
                self.schedule.submit_step(entry["step"], self._replays(entry))
                for share in range(self.pool.count):
                    self.schedule.await_share(entry["step"], share)
        self._push()  # every rank: the gather of sharded weights is collective

    def _replays(self, entry: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
        """Partial rollouts in flight at the save: per share, its recorded segment versions and their tensors."""
        if "segments" not in entry:
            return None
        tensors = self.resume["tensors"]
        return {int(share): {"segments": plan, "kind": self.s.weight_kind,
                             "weights": {v: tensors[v] for v in sorted({v for call in plan for v in call})}}
                for share, plan in entry["segments"].items()}

    def collect(self, step: int) -> StepBatch:
        t0 = time.perf_counter()
        if self.world.is_main:
            try:
                parts = self._parts(step)
            except Exception as exc:  # the other ranks wait for their parts: they stop too, then this one raises
                from mmrlhf.launch.report import user_message

                self.world.scatter_objects([("error", f"{type(exc).__name__}: {user_message(exc)}")]
                                           * self.world.world_size)
                raise
            mine = self.world.scatter_objects(parts if self.world.world_size == 1 or self.s.rows else
                                              [{**part, "items": pack_items(part["items"])} for part in parts])
        else:
            mine = self.world.scatter_objects(None)
            if isinstance(mine, tuple):
                raise RolloutSourceError(mine[1])
        if self.s.rows:
            return self._experiences(step, mine, t0)
        items, distribution = mine["items"], mine["distribution"]
        if isinstance(items, PackedItems):  # another rank's part, columnar on the wire (mmrlhf.experience.wire)
            items = unpack_items(items)
        split = {"micro_batch_size": self.s.scoring_micro_batch_size, "max_tokens": self.s.scoring_max_tokens}
        if self.s.old_policy:  # the behaviour policy's log-probs and entropies: this version's, before its update
            current, outside, entropy = self.weights.policy.score_old(items, distribution, self.world, **split)
            items = [it.with_token(action_entropy=e) for it, e in zip(items, entropy)]
        else:
            current, outside = self.weights.policy.score(items, distribution, self.world, **split)  # [A_i] each
        # outside this policy's kept set: out of the loss (and of the check)
        items = [it.with_token(loss_mask=it.token["loss_mask"] & ~out) for it, out in zip(items, outside)]
        metrics = self.weights.sync_check(items, current, mine["fresh"])
        if self.reference is not None:  # the KL loss's reference, scored here rather than on the rollout actors
            ref, _ = score_items(self.reference, items, distribution, self.weights.policy.item_layout(), self.world,
                                 **split)
            items, kl = with_reference(items, current, ref, self.s.kl_estimator, self.world)
            metrics.update(kl)
        if self.teacher is not None:  # the distillation loss term's teacher, likewise
            items = with_teacher(self.teacher, items, distribution, self.weights.policy.item_layout(), self.world,
                                 topk=self.s.distill_topk, **split)
        metrics.update(token_versions(items, self.weights.version, self.s.max_staleness))
        if self.s.max_staleness >= 1 or self.s.old_policy:  # the PPO ratio's old policy: the current version
            items = [it.with_token(action_log_probs=lp) for it, lp in zip(items, current)]
        metrics.update(mine["metrics"])
        return StepBatch(items, metrics, distribution, seconds={"rollout": time.perf_counter() - t0},
                         report=mine.get("report"))

    def _experiences(self, step: int, mine: dict[str, Any], t0: float) -> StepBatch:
        """``settings.rows``: this rank's experiences of its dealt rows, made by its maker over the ranks (the
        forwards of the sharded models paired, the shaping's step statistics and running state the step's), then
        the sync check as in :meth:`collect`. Every rank calls it; none has rows where the step kept no group."""
        from mmrlhf.experience.batching import split_experience

        rows, metrics = mine["rows"], dict(mine["metrics"])
        seconds = {"rollout": time.perf_counter() - t0}
        if rows is None:  # (every rank alike: dynamic sampling kept no group of the step)
            return StepBatch([], metrics, seconds=seconds)
        t1 = time.perf_counter()
        experiences = self.maker.experiences_from(rows, world=self.world, step=step)
        items = [item for exp in experiences for item in split_experience(exp)]
        seconds["experience"] = time.perf_counter() - t1
        if mine["describe"]:  # what the stage made (the rows' own metrics are the step's, on rank 0)
            made = experiences[0].info["batch"]
            metrics.update({k: v for k, v in made.items()
                            if k not in rows.metrics and k not in metrics and k != "time/total"})
        current = [it.token["action_log_probs"] for it in items]
        metrics.update(self.weights.sync_check(items, current, mine["fresh"]))
        metrics.update(token_versions(items, self.weights.version, self.s.max_staleness))
        describe = mine["describe"] and self.world.is_main
        return StepBatch(items, metrics, rows.distribution, rollout=rows if describe else None, seconds=seconds)

    def _parts(self, step: int) -> list[dict[str, Any]]:
        """Rank 0: step ``step``'s samples from every rollout actor, counted and dealt to the ranks."""
        t0 = time.perf_counter()
        self.schedule.ask_ahead(step)
        metas = [self.schedule.await_share(step, share) for share in range(self.pool.count)]
        self.stream_after[step], self.maker_after[step] = metas[0]["stream"], metas[0].get("maker", {})
        self.running = self.maker_after[step]  # (every actor's: they take the step's statistics together)
        for old in [s for s in self.stream_after if s < step - self.s.max_staleness - 2]:
            del self.stream_after[old], self.maker_after[old]
        waited = time.perf_counter() - t0
        payloads = self.schedule.take(step)
        staleness = [check_staleness(self.weights.version, p["version"], self.s.max_staleness) for p in payloads]
        parts = (deal_rows if self.s.rows else deal)(step, payloads, staleness, self.world.world_size, self.ledger)
        for s, p in zip(staleness, payloads):
            self.stats.add(s, p["samples"])
        parts[0]["metrics"].update(self._step_metrics(step, metas, staleness, waited))
        parts[0]["report"] = payloads[0].get("report")  # rollout actor 0's share, on report steps (rank 0 writes it)
        for part in parts:  # each rank's own count: the loop weighs its per-rank metrics by it, and sums it
            held = part["rows"] if self.s.rows else part["items"]
            part["metrics"]["samples"] = float((0 if held is None else len(held)) - part.pop("inert", 0))
        # what was sampled beyond what trains (dynamic sampling's dropped groups) counts as generated, as in one
        # process: on rank 0, so the ranks' sum is the step's
        parts[0]["metrics"]["samples"] += _generated(metas) - sum(p["metrics"]["samples"] for p in parts)
        return parts

    def _step_metrics(self, step: int, metas: Sequence[dict], staleness: list[int], waited: float) -> dict:
        """The step's shares' rollout metrics merged, its ledger counts, staleness and ``async/*`` timings."""
        out = merge_share_metrics([m["metrics"] for m in metas], [m["samples"] for m in metas])
        out["samples"] = _generated(metas)
        out["async/generate_s"] = max(m["generate_s"] for m in metas)
        calls = [call for m in metas for call in m.get("segment_versions") or []]
        if calls:  # partial rollouts: segments per engine call, and the calls whose versions changed in between
            out["partial/segments_mean"] = sum(len(c) for c in calls) / len(calls)
            out["partial/interrupted_calls_frac"] = sum(len(set(c)) > 1 for c in calls) / len(calls)
        out.update(self.ledger.check_step(step, self.pool.count))
        out.update(self.stats.metrics(staleness))
        out.update(self.waits.add(waited, sum(m["rollout_wait_s"] for m in metas) / len(metas)))
        out.update({"async/policy_version": float(self.weights.version),
                    "ray/actor_restarts": float(self.schedule.restarted()),
                    # models a rollout actor scores with beside its engine (0: the trainer actors score them all)
                    "ray/rollout_scoring_models": float(max(m.get("scoring_models", 0) for m in metas))})
        return out

    def publish(self, policy: Any, critic: Any | None, *, updated: bool) -> dict[str, float]:
        if not updated:
            return {}
        self.weights.version += 1
        return self._push()

    def _push(self) -> dict[str, float]:
        """The current version to every rollout actor; ``sync/*`` metrics (rank 0). An actor that died receiving it
        is handled at once (:meth:`_dead`)."""
        metrics, _ = self.weights.push(range(self.pool.count))
        return metrics

    def _place(self, shares: Sequence[int], step: int) -> None:
        """Rollout actors ``shares`` begin at step ``step`` (a resume: every actor; a restart: the new one, at its
        first lost step): they generate in order from there, with the running state, and with dynamic sampling the
        stream and the sampling calls, as they stood after the step before it (the record of that step, taken or
        read from the checkpoint; a run's very first step needs none)."""
        import ray

        handles = [self.pool.handles[i] for i in shares]
        stream, maker = self.stream_after.get(step - 1), self.maker_after.get(step - 1, {})
        if self.s.sequential and stream is not None:
            ray.get([h.load_position.remote(step, stream, maker, self.rank_seeds) for h in handles])
            return
        if running_state(maker):
            ray.get([h.load_running_state.remote(running_state(maker)) for h in handles])
        ray.get([h.expect.remote(step) for h in handles])

    def _dead(self, share: int, error: str) -> bool:
        """Rollout actor ``share`` died receiving a version: restarted (its lost steps asked for again), or, where
        the run cannot restart it, the run stops at the next collect (every rank learns it there); whether the push
        goes on."""
        self.schedule.on_failures({share: error})
        return self.schedule.deferred is None

    def evaluate(self) -> dict[str, float]:
        import ray

        return ray.get(self.pool.handles[0].evaluate.remote())

    def save(self, folder: Path, step: int) -> dict[str, Any]:
        """Rank 0: the data position the rollout actors read at ``step`` (the one-process format, so every mode can
        resume it), the run-long counts, and with ``k >= 1`` the rollouts in flight with their versions' tensors."""
        import ray

        if not self.world.is_main:
            return {}
        stream = self.stream_after.get(step - 1)  # read from the last step's metadata: its actor may be gone since
        if stream is None:
            stream = ray.get(self.pool.handles[0].stream_state.remote(step))
        running = dict(self.running)  # the rollout actors' maker after the last step (dynamic sampling: its calls)
        if self.s.rows:  # the running statistics are the trainers' (their makers shaped the steps)
            running.update(running_state(self.maker.state_dict()))
        state = {"stream": stream, "maker": {"calls": step * self.pool.count, **running},
                 "policy_version": self.weights.version,
                 "staleness": self.stats.state_dict(), "actor_restarts": self.schedule.restarted(), "inflight": []}
        if self.schedule.deferred is None:  # else a dead actor stopped the run: a resume generates with its version
            state["inflight"] = self.schedule.in_flight()
        for version in inflight_versions(state["inflight"]):
            self.weights.save(folder, version)
        return state

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        self.resume = dict(state)
        self.rank_seeds = rank_seeds_of(folder)
        if self.rank_seeds != RANK_SEEDS and self.s.sequential and self.pool.count > 1 and self.world.is_main:
            logger.warning("%s was written before the rollout actors' sampling seeds were mixed: this run keeps "
                           "rollout.seed + actor to its end (its streams go on as they began); a new run mixes them",
                           folder)
        inflight = inflight_versions(state.get("inflight", []))
        self.resume["tensors"] = WeightDelivery.load(folder, inflight) if self.world.is_main else {}
        # the run-long counts go on (a checkpoint of another launch mode has none: the histogram starts here)
        self.stats.load_state_dict(state.get("staleness", {}))
        self.schedule.restarts_before = int(state.get("actor_restarts", 0))

    def close(self) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """What the driver prints at the end (rank 0)."""
        produced, consumed = self.ledger.check_all() if not self.schedule.pending else (0, 0)
        return {"produced": produced, "consumed": consumed, "staleness": dict(sorted(self.stats.counts.items())),
                "failures": list(self.schedule.failures)}


def deal(step: int, payloads: Sequence[dict[str, Any]], staleness: Sequence[int], ranks: int,
         ledger: ExperienceLedger) -> list[dict[str, Any]]:
    """Step ``step``'s shares (``payloads``, each ``staleness`` versions old) as items dealt to ``ranks`` ranks,
    whole GRPO groups balanced by their cost (tokens and vision patch rows, :mod:`mmrlhf.parallel.dealing`; each
    rank as many groups as round-robin would give it), every share counted in the ledger; with the scoring
    distribution they share. Each rank's items keep the shares' order. Rank 0's part carries
    ``ray/rank_cost_imbalance`` (the most-loaded rank's cost over the mean)."""
    scorings = {p["distribution"] for p in payloads}
    if len(scorings) != 1:
        raise ValueError(f"step {step}: experiences scored under different distributions "
                         f"{sorted(map(str, scorings))}")
    distribution = scorings.pop()
    parts = [{"items": [], "fresh": [], "distribution": distribution,
              "metrics": {"samples": 0.0}} for _ in range(ranks)]
    dealt: list[tuple[Any, bool]] = []  # (item, fresh)
    keys, costs = [], []
    for p, s in zip(payloads, staleness):
        share_items = unpack_items(p["items"])  # columnar from the rollout actor (mmrlhf.experience.wire)
        _count(step, p, len(share_items), "items", ledger)
        for it, key in zip(share_items, group_keys(share_items)):
            keys.append((p["share"], key))
            costs.append(len(it.prompt_ids) + len(it.response_ids) + patch_rows(it.vision))
            dealt.append((it, s == 0))
    ranks_of, spread = _deal_groups(keys, costs, ranks)
    for (it, fresh), r in zip(dealt, ranks_of):
        parts[r]["items"].append(it)
        parts[r]["fresh"].append(fresh)
    for part in parts:
        if dealt and not part["items"]:  # fewer groups than ranks (dynamic sampling kept few): one inert copy pairs
            part["items"].append(inert_item(dealt[0][0]))  # this rank's forwards and update with the others'
            part["fresh"].append(False)
            part["inert"] = 1
    parts[0]["metrics"]["ray/rank_cost_imbalance"] = spread
    return parts


def _count(step: int, payload: dict[str, Any], sent: int, what: str, ledger: ExperienceLedger) -> None:
    """A share's announced samples against the ``sent`` ones it carries, both counted in the ledger."""
    if sent != payload["samples"]:
        raise RuntimeError(f"step {step}, share {payload['share']}: {payload['samples']} samples announced, "
                           f"{sent} {what} sent")
    ledger.produce(step, payload["share"], payload["samples"])
    ledger.consume(step, payload["share"], sent)


def _deal_groups(keys: Sequence[Any], costs: Sequence[float], ranks: int) -> tuple[list[int], float]:
    """Each sample's rank (its group's: whole groups, by ``keys`` in arrival order, dealt by their summed cost,
    :mod:`mmrlhf.parallel.dealing`) and the most-loaded rank's cost over the mean."""
    group: dict[Any, int] = {}
    cost: list[float] = []
    index = []
    for key, c in zip(keys, costs):
        g = group.setdefault(key, len(group))
        if g == len(cost):
            cost.append(0.0)
        cost[g] += c
        index.append(g)
    rank_of = deal_by_cost(cost, ranks)
    return [rank_of[g] for g in index], imbalance(cost, rank_of, ranks)


def deal_rows(step: int, payloads: Sequence[dict[str, Any]], staleness: Sequence[int], ranks: int,
              ledger: ExperienceLedger) -> list[dict[str, Any]]:
    """:func:`deal` for rows (where the trainers make the experiences,
    :func:`~mmrlhf.models.ray_placement.experiences_on_trainers`): the shares' rows (``ScoredRollout``, or None where
    a share trains nothing) joined and dealt to ``ranks`` ranks as whole groups by cost, each rank's in the shares'
    order, every share counted in the ledger. A rank left without a group (fewer groups than ranks) gets the first
    row made inert (its forwards and update pair with the others', it trains nothing); ``describe`` False there.
    Every part's ``rows`` is None when no share sent any."""
    from mmrlhf.experience.rollout import ScoredRollout
    from mmrlhf.trainer.rollouts import inert

    sent = [(p, s) for p, s in zip(payloads, staleness) if p.get("rows") is not None]
    for p in payloads:
        _count(step, p, 0 if p.get("rows") is None else len(p["rows"]), "rows", ledger)
    parts = [{"rows": None, "fresh": [], "describe": False, "metrics": {"samples": 0.0}} for _ in range(ranks)]
    if not sent:
        parts[0]["metrics"]["ray/rank_cost_imbalance"] = 1.0
        return parts
    scorings = {p["rows"].distribution for p, _ in sent}
    if len(scorings) != 1:
        raise ValueError(f"step {step}: rows sampled under different distributions {sorted(map(str, scorings))}")
    joined = ScoredRollout.concat([p["rows"] for p, _ in sent])  # group ids made unique over the shares
    joined.seconds = {}  # (generation's phases are the rollout actors', reported with the step's metrics)
    fresh = [s == 0 for p, s in sent for _ in range(len(p["rows"]))]
    rows = joined.rows
    ranks_of, spread = _deal_groups(rows.group, [len(rows.prompt_ids[i]) + len(rows.response_ids[i])
                                                 + patch_rows(rows.vision[i]) for i in range(len(rows.group))], ranks)
    for r, part in enumerate(parts):
        mine = [i for i, rank in enumerate(ranks_of) if rank == r]
        if mine:
            part.update(rows=joined.select(mine), fresh=[fresh[i] for i in mine], describe=True)
        else:  # fewer groups than ranks (dynamic sampling kept few): one inert copy pairs this rank's work
            part.update(rows=inert(joined), fresh=[False], inert=1)
    parts[0]["metrics"]["ray/rank_cost_imbalance"] = spread
    return parts


def _generated(metas: Sequence[dict[str, Any]]) -> float:
    """The samples the rollout actors generated for a step: what they sent, or with dynamic sampling every round's
    (their rollout's ``samples``)."""
    return float(sum(m["metrics"].get("samples", m["samples"]) for m in metas))


def inflight_versions(inflight: Sequence[dict[str, Any]]) -> list[int]:
    """Every policy version a checkpoint's in-flight rollouts were generated with (partial ones: every segment's)."""
    versions = {int(entry["version"]) for entry in inflight}
    for entry in inflight:
        versions.update(int(v) for plan in entry.get("segments", {}).values() for call in plan for v in call)
    return sorted(versions)


def token_versions(items: Sequence[Any], trainer_version: int, max_staleness: int) -> dict[str, float]:
    """Partial rollouts (per-token ``rollout_versions``): the staleness bound checked on every response token (the
    oldest one decides), and ``partial/*`` metrics: token staleness and the share of samples whose tokens came from
    more than one version. Empty without per-token versions."""
    versions = [it.token["rollout_versions"][it.token["loss_mask"]] for it in items
                if "rollout_versions" in it.token]
    if not versions:
        return {}
    flat = torch.cat(versions)
    if flat.numel():
        check_staleness(trainer_version, int(flat.min()), max_staleness)
    staleness = (trainer_version - flat).float()
    return {"partial/token_staleness_mean": float(staleness.mean()) if flat.numel() else 0.0,
            "partial/token_staleness_max": float(staleness.max()) if flat.numel() else 0.0,
            "partial/spanning_frac": sum(int(v.numel() > 0 and bool((v != v[0]).any())) for v in versions)
            / len(versions)}


def check_position(holder: Any, step: int, have: dict[str, Any]) -> None:
    """A resume reads the prompts the checkpoint's stream points at (a run of another mode may have read more)."""
    import ray

    want = ray.get(holder.stream_state.remote(step))
    if ray.get(holder.stream_index.remote(have)) != ray.get(holder.stream_index.remote(want)):
        raise ValueError(f"the checkpoint's prompt stream is at epoch {have['epoch']} position {have['position']},"
                         f" but the Ray mode's rollout actors read step {step}'s prompts at epoch {want['epoch']} "
                         f"position {want['position']} (was it written with algorithm.dynamic_sampling?): resume "
                         "it in the launch mode that wrote it")
