"""The step-wide statistics on 2 training ranks, and on 2 Ray rollout actors, equal one process's on the same
global step.

Two gloo processes (``torch.multiprocessing``, no model, no engine) each run the real code on their share of a
synthetic step: the shaping (reward normalisation, the adaptive KL controller, the advantage estimators' batch
statistics, advantage whitening; ``experience.step_shaping``), the high-entropy token selection
(``prepare_policy_targets``) and dynamic sampling (``LocalRollouts``). The rollout actors' shares run the same shaping
and dynamic sampling in two threads, meeting through the step exchange (``launch.ray.exchange``: the real
``StepExchange`` on an asyncio loop, as its Ray actor runs it). One process runs the same code on the whole step;
each check has a control that must differ: every rank on its own, with its own share's statistics.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from mmrlhf.algorithms.dynamic_sampling import choose_first
from mmrlhf.algorithms.kl import AdaptiveKLController, approx_kl
from mmrlhf.algorithms.shaping import RunningRewardNorm
from mmrlhf.data.types import PromptRecord
from mmrlhf.experience.batching import TrainItem
from mmrlhf.experience.rollout import Rollout, ScoredRollout
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.experience.step_shaping import shape_step
from mmrlhf.launch.ray.exchange import SharesWorld, StepExchange
from mmrlhf.parallel.world import World, join, leave, single
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale
from mmrlhf.trainer.policy_update import PolicyUpdateSettings, prepare_policy_targets
from mmrlhf.trainer.rollouts import LocalRollouts, LocalSettings

RANKS = 2
N_PER_GROUP, GROUPS, WIDTH = 4, 6, 7
# advantage estimator -> its parameters and the shaping around it: group statistics under the maker's whitening;
# the estimator's own batch whitening; its batch counts (cpgd's up-weighting; no KL in the reward, which would give
# every group some spread, and no whitening, which would hide the weight)
ESTIMATORS = {
    "grpo": ({"eps": 1e-6, "norm_by_std": True}, {"advantage_whitening": True}),
    "reinforce_baseline": ({"gamma": 1.0}, {}),
    "cpgd": ({"weight": "clip_filter"}, {"kl_in_reward": False}),
}


# ---- the synthetic step ----------------------------------------------------------------------------------------
def _step(seed: int) -> dict[str, Any]:
    """A whole step: GROUPS groups of N_PER_GROUP samples, rows of different lengths, two samples masked out by the
    reward engine, rewards and log-probs that differ from group to group (so shares differ in their statistics),
    and one group whose samples all score the same."""
    g = torch.Generator().manual_seed(seed)
    n = GROUPS * N_PER_GROUP
    group = torch.arange(n) // N_PER_GROUP
    valid = torch.ones(n, dtype=torch.bool)
    valid[[3, 17]] = False
    lengths = torch.randint(1, WIDTH + 1, (n,), generator=g)
    mask = torch.arange(WIDTH)[None] < lengths[:, None]  # [N, A]
    rewards = torch.rand(n, generator=g) + group.float() * 0.3
    last = group == GROUPS - 1  # a group without spread (rank 1's): cpgd weights the others up
    rewards[last], lengths[last] = 0.5, lengths[last].clamp(max=WIDTH - 2)  # no overlong penalty either
    log_probs = -torch.rand(n, WIDTH, generator=g) * (1 + (group[:, None] % 2))
    ref = log_probs - 0.05 * torch.randn(n, WIDTH, generator=g)
    return {"group": group, "valid": valid, "lengths": lengths, "mask": mask, "rewards": rewards,
            "log_probs": log_probs, "ref": ref}


def _rows(rank: int | None) -> torch.Tensor:
    """The samples of a rank's share (whole groups ``rank::RANKS``, in order), or the whole step."""
    groups = torch.arange(GROUPS) if rank is None else torch.arange(rank, GROUPS, RANKS)
    return torch.cat([torch.arange(k * N_PER_GROUP, (k + 1) * N_PER_GROUP) for k in groups.tolist()])


def _kl_target(step: dict[str, Any]) -> float:
    """A target near the step's KL, so the controller's error is not clipped and its update depends on the KL."""
    m = step["mask"] & step["valid"][:, None]
    seq = approx_kl(step["log_probs"], step["ref"], m, "k1").sum(-1)[m.any(-1)]
    return 1.1 * float(seq.mean())


def _settings(estimator: str) -> ExperienceSettings:
    params, shaping = ESTIMATORS[estimator]
    return ExperienceSettings(**{"n_samples_per_prompt": N_PER_GROUP, "advantage_estimator": estimator,
                                 "advantage_params": params, "kl_estimator": "k1", "kl_in_reward": True,
                                 "need_reference": True, "overlong_buffer_len": 2, "reward_normalization": True,
                                 **shaping})


def _shape(estimator: str, rank: int | None, world: World) -> list[dict[str, Any]]:
    """Two consecutive steps shaped by the real code on ``rank``'s share (None: the whole step) in ``world``;
    per step: the share's outputs and the running state after it."""
    norm = RunningRewardNorm()
    norm.load_state_dict({"count": 10, "mean": 0.3, "m2": 2.0})  # earlier steps' statistics
    first = _step(0)
    controller = AdaptiveKLController(0.1, target=_kl_target(first), horizon=50)
    out = []
    for step in (first, _step(1)):
        rows = _rows(rank)
        local_group = torch.unique(step["group"][rows], return_inverse=True)[1]  # a share numbers its own groups
        rewards = RewardResult(rewards=step["rewards"][rows], valid=step["valid"][rows], sources={}, parts={},
                               metrics={})
        shaped = shape_step(_settings(estimator), groups=local_group.tolist(), rewards=rewards,
                            lengths=step["lengths"][rows], max_new_tokens=WIDTH, mask=step["mask"][rows],
                            log_probs=step["log_probs"][rows], ref_log_probs=step["ref"][rows], values=None,
                            reward_norm=norm, kl_controller=controller, world=world)
        out.append({"rows": rows, "advantages": shaped["advantages"], "returns": shaped["returns"],
                    "seq_reward": shaped["seq_reward"], "metrics": shaped["metrics"], "norm": norm.state_dict(),
                    "kl_coef": controller.value})
    return out


def _items(rank: int) -> list[TrainItem]:
    """A rank's share of a step's trained tokens: entropies on a coarse grid (many ties at any threshold), rank 1's
    higher on the whole, so its own quantile is not the step's."""
    g = torch.Generator().manual_seed(10 + rank)
    items = []
    for _ in range(5 + 2 * rank):
        a = int(torch.randint(2, 9, (1,), generator=g))
        mask = torch.rand(a, generator=g) > 0.2
        entropy = torch.floor(torch.rand(a, generator=g) * 6) / 6 + 0.5 * rank
        items.append(TrainItem([], [], {}, {}, {"loss_mask": mask, "action_entropy": entropy}))
    return items


ENTROPY = PolicyUpdateSettings(high_entropy_top_p=0.5)  # the threshold ties tokens of both ranks


# ---- dynamic sampling: a stream of labelled prompts and a maker that scores them by their label ----------------
# Global round order (8 prompts, split 0,2,4,6 to rank 0 and 1,3,5,7 to rank 1). Round 1 keeps 5 groups; round 2 has
# 5 candidates for the 3 places left, and one skipped prompt on rank 0 shifts the place of its later groups.
ROUNDS = {
    "mixed": ["vary", "vary", "vary", "vary", "flat", "flat", "vary", "flat",
              "vary", "vary", "skip", "vary", "vary", "vary", "flat", "flat"] + ["flat"] * 16,
    # only rank 0's share ever varies: rank 1 keeps nothing and trains one inert sample
    "one_sided": ["vary", "flat", "vary", "flat", "flat", "flat", "flat", "flat"] + ["flat"] * 24,
    # every prompt of rank 1's share is skipped in every round: it has nothing of its own, not even an inert sample
    "one_skipped": ["vary", "skip", "vary", "skip", "flat", "skip", "flat", "skip"] * 4,
}
# Without dynamic sampling (4 prompts a step, 2 each): rank 1's whole share skipped, or the whole step.
PLAIN = {"one_empty": ["vary", "skip", "flat", "skip"], "all_empty": ["skip"] * 4}


class _Stream:
    def __init__(self, labels: list[str]) -> None:
        self.records = [PromptRecord(index=i, prompt=f"p{i}", reference=label, record_id=f"r{i}")
                        for i, label in enumerate(labels)]
        self.position = 0

    def next_batch(self, n: int) -> list[PromptRecord]:
        batch = self.records[self.position: self.position + n]
        self.position += n
        return batch


class _Maker:
    """``generate_rollout`` as the experience maker's: a group per generated prompt, numbered in request order (a
    skipped prompt has none); rewards by label. One sample of each varying group is masked out by the reward
    engine in odd prompts (a group of its own, as group_rewards makes it)."""

    engine = None

    def generate_rollout(self, *, prompts, references, record_ids, **_: Any) -> ScoredRollout:
        cols: dict[str, list] = {name: [] for name in Rollout.__dataclass_fields__}
        rewards, valid = [], []
        kept = [(ref, rid) for ref, rid in zip(references, record_ids) if ref != "skip"]
        for group, (ref, rid) in enumerate(kept):
            for j in range(N_PER_GROUP):
                for name, value in (("sample_index", len(cols["group"])), ("group", group), ("prompt_ids", [1]),
                                    ("response_ids", [2]), ("engine_logprobs", None), ("finished", True),
                                    ("vision", {}), ("prompts", ref), ("labels", None), ("references", ref),
                                    ("images", []), ("record_ids", rid)):
                    cols[name].append(value)
                rewards.append(float(j % 2) if ref == "vary" else 1.0)
                valid.append(not (ref == "vary" and j == 0 and int(rid[1:]) % 2))
        result = RewardResult(rewards=torch.tensor(rewards, dtype=torch.float32),
                              valid=torch.tensor(valid, dtype=torch.bool), sources={}, parts={}, metrics={})
        skipped = [f"record {rid}: missing image" for ref, rid in zip(references, record_ids) if ref == "skip"]
        return ScoredRollout(Rollout(**cols), result, SamplingSettings(), {"samples": float(len(rewards))},
                             skipped=skipped)


def _sampled(case: str, world: World, *, control: bool = False) -> dict[str, Any]:
    """This rank's rollout of dynamic sampling over the case's rounds: the record ids of the groups it kept, in
    order, whether it trains, its validity and the fill metrics. ``control``: each rank decides on its own share."""
    source = LocalRollouts(_Maker(), _Stream(ROUNDS[case]), world,
                           LocalSettings(rollout_batch_size=8, dynamic_sampling=True,
                                         dynamic_sampling_max_extra_rounds=3))
    if control:
        source._choose = choose_first  # every rank takes its first informative groups, as one process alone would
    rollout, metrics, trains = source.sample_step(0)
    ids = list(dict.fromkeys(rollout.rows.record_ids)) if trains else []  # an inert sample keeps no group
    return {"ids": ids, "trains": trains, "valid": None if rollout is None else rollout.rewards.valid,
            "metrics": {k: v for k, v in metrics.items() if k.startswith("dynamic_sampling/")},
            "inert_ids": None if trains or rollout is None else rollout.rows.record_ids}


def _plain(case: str, world: World) -> dict[str, Any]:
    """This rank's rollout of one step without dynamic sampling (or the error it raised): its record ids, whether it
    trains, its validity and its count of skipped prompts."""
    from mmrlhf.trainer.rollouts import EmptyStepError

    source = LocalRollouts(_Maker(), _Stream(PLAIN[case]), world, LocalSettings(rollout_batch_size=4))
    try:
        rollout, metrics, trains = source.sample_step(2)
    except EmptyStepError as exc:
        return {"error": str(exc)}
    return {"ids": rollout.rows.record_ids, "trains": trains, "valid": rollout.rewards.valid.tolist(),
            "samples": metrics["samples"]}


# ---- the 2 ranks -----------------------------------------------------------------------------------------------
def _worker(rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    world = join(rank, RANKS, rank, launch="torchrun", process_group="gloo", init_method=f"tcp://127.0.0.1:{port}")
    try:
        items = _items(rank)
        items, entropy_metrics = prepare_policy_targets(items, ENTROPY, world)
        result = {
            "shaping": {name: _shape(name, rank, world) for name in ESTIMATORS},
            "entropy": ([it.token["policy_loss_mask"] for it in items], entropy_metrics),
            "sampling": {case: _sampled(case, world) for case in ROUNDS},
            "sampling_control": _sampled("mixed", world, control=True),
            "plain": {case: _plain(case, world) for case in PLAIN},
        }
        torch.save(result, out / f"rank{rank}.pt")
    finally:
        leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, out), nprocs=RANKS, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]


class _LoopExchange:
    """A :class:`StepExchange` on an asyncio loop of its own thread, called as a rollout actor calls the Ray one."""

    def __init__(self, count: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.exchange = StepExchange(count)

    def gather(self, step: int, call: int, share: int, part: Any) -> list[Any]:
        return asyncio.run_coroutine_threadsafe(self.exchange.gather(step, call, share, part), self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _actor(rank: int, exchange: _LoopExchange, out: list[Any]) -> None:
    try:
        world = lambda step: SharesWorld(rank=rank, world_size=RANKS, launch="ray", exchange=exchange,  # noqa: E731
                                         step=step)
        out[rank] = {"shaping": {name: _shape(name, rank, world(k)) for k, name in enumerate(ESTIMATORS)},
                     "sampling": {case: _sampled(case, world(10 + k)) for k, case in enumerate(ROUNDS)},
                     "sampling_control": _sampled("mixed", world(20), control=True),
                     "plain": {case: _plain(case, world(30 + k)) for k, case in enumerate(PLAIN)}}
    except BaseException as exc:  # noqa: BLE001 (reported by the fixture)
        out[rank] = exc


@pytest.fixture(scope="module")
def actors() -> list[dict[str, Any]]:
    """The rollout actors' shares: two threads meeting in one step exchange."""
    exchange, out = _LoopExchange(RANKS), [None] * RANKS
    threads = [threading.Thread(target=_actor, args=(r, exchange, out)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    exchange.close()
    for r, result in enumerate(out):
        if not isinstance(result, dict):
            raise AssertionError(f"rollout actor share {r} failed: {result!r}")
    assert exchange.exchange.pending() == []  # every collective met
    return out


@pytest.fixture(params=["torchrun_ranks", "rollout_actors"])
def shares(request) -> list[dict[str, Any]]:
    return request.getfixturevalue("ranks" if request.param == "torchrun_ranks" else "actors")


def _gathered(shares: list[dict[str, Any]], key: str) -> torch.Tensor:
    """A per-sample output of the ranks' shares put back in the step's sample order."""
    first = shares[0][key]
    whole = torch.zeros((GROUPS * N_PER_GROUP, *first.shape[1:]), dtype=first.dtype)
    for share in shares:
        whole[share["rows"]] = share[key]
    return whole


# ---- shaping ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_shaping_over_ranks_is_the_one_process_shaping(shares, estimator):
    """Advantages, returns and shaped rewards of both steps, and the running reward statistics and KL coefficient
    every rank (rollout actor) holds after each, equal one process's; the control (each rank on its own share)
    does not."""
    ranks = shares
    alone = _shape(estimator, None, single())
    control = [_shape(estimator, r, single()) for r in range(RANKS)]
    for step, one in enumerate(alone):
        shares = [ranks[r]["shaping"][estimator][step] for r in range(RANKS)]
        for key in ("advantages", "returns", "seq_reward"):
            assert_close_at_scale(_gathered(shares, key), one[key], msg=f"step {step} {key}")
        assert float(one["advantages"].abs().max()) > 0.1
        for share in shares:  # the same running state on every rank, the one-process state
            assert share["norm"]["count"] == one["norm"]["count"]
            for key in ("mean", "m2"):
                assert share["norm"][key] == pytest.approx(one["norm"][key], rel=1e-12, abs=1e-12)
            assert share["kl_coef"] == pytest.approx(one["kl_coef"], rel=1e-12)
            for key in ("advantage_mean", "advantage_std", "kl_seq", "reward_running_mean", "reward_running_std"):
                if key in one["metrics"]:
                    assert share["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
        own = [control[r][step] for r in range(RANKS)]
        assert not close_at_scale(_gathered(own, "advantages"), one["advantages"])
        assert own[0]["norm"]["mean"] != pytest.approx(one["norm"]["mean"], rel=1e-3)
    if _settings(estimator).kl_in_reward:
        assert alone[1]["kl_coef"] != pytest.approx(0.1, rel=1e-3)  # the controller moved ...
        assert control[0][1]["kl_coef"] != pytest.approx(alone[1]["kl_coef"], rel=1e-6)  # ... by the step's KL


# ---- high-entropy token selection ------------------------------------------------------------------------------
def test_entropy_selection_over_ranks_is_the_one_process_selection(ranks):
    """The step's quantile over both ranks' tokens: each rank keeps exactly what one process keeps of the step
    (rank 0's items, then rank 1's: tokens tied at the threshold are taken in that order); the control, each rank's
    own quantile, keeps other tokens."""
    items, metrics = prepare_policy_targets(_items(0) + _items(1), ENTROPY)
    expected = [it.token["policy_loss_mask"] for it in items]
    got = ranks[0]["entropy"][0] + ranks[1]["entropy"][0]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    candidates = sum(int(it.token["loss_mask"].sum()) for it in items)
    tied = torch.cat([it.token["action_entropy"][m] for it, m in zip(items, expected)]).min()
    assert int(sum(int(m.sum()) for m in expected)) == -(-candidates // 2)  # ceil(0.5 n)
    every = torch.cat([it.token["action_entropy"][it.token["loss_mask"]] for it in items])
    assert int((every == tied).sum()) > int(sum(int(((it.token["action_entropy"] == tied) & m).sum())
                                                for it, m in zip(items, expected)))  # ties were broken
    for r in range(RANKS):
        assert ranks[r]["entropy"][1]["policy/high_entropy_kept_frac"] == metrics["policy/high_entropy_kept_frac"]
    own = []
    for r in range(RANKS):
        share, _ = prepare_policy_targets(_items(r), ENTROPY)
        own += [it.token["policy_loss_mask"] for it in share]
    assert any(not torch.equal(a, b) for a, b in zip(own, expected))


# ---- dynamic sampling ------------------------------------------------------------------------------------------
def _step_order(ids: list[str]) -> list[str]:
    return sorted(ids, key=lambda rid: int(rid[1:]))


@pytest.mark.parametrize("case", list(ROUNDS))
def test_dynamic_sampling_over_ranks_keeps_the_one_process_groups(shares, case):
    """The groups the ranks (rollout actors) keep together are the ones one process keeps on the whole rounds, found
    in as many rounds; each rank holds its own. A rank that kept none trains one inert sample."""
    ranks = shares
    alone = _sampled(case, single())
    shares = [ranks[r]["sampling"][case] for r in range(RANKS)]
    assert _step_order(shares[0]["ids"] + shares[1]["ids"]) == _step_order(alone["ids"])
    for r, share in enumerate(shares):
        assert all(int(rid[1:]) % RANKS == r for rid in share["ids"])  # its own prompts
        assert share["metrics"] == alone["metrics"]  # rounds, fill rate, sampled groups: the step's
    if case == "mixed":
        assert alone["ids"] == ["r0", "r1", "r2", "r3", "r6", "r8", "r9", "r11"]
        assert alone["metrics"]["dynamic_sampling/rounds"] == 2
        assert all(s["trains"] for s in shares)
    elif case == "one_sided":
        assert alone["ids"] == ["r0", "r2"] and alone["metrics"]["dynamic_sampling/rounds"] == 4
        assert shares[0]["trains"] and shares[0]["valid"].all()
        assert not shares[1]["trains"] and shares[1]["valid"].tolist() == [False]  # inert: trains nothing
        assert int(shares[1]["inert_ids"][0][1:]) % RANKS == 1  # its own last round's first sample
    else:  # rank 1 generated nothing: it trains the first sample of rank 0's share, inert
        assert alone["ids"] == ["r0", "r2", "r8", "r10", "r16", "r18", "r24", "r26"]
        assert shares[0]["trains"] and shares[0]["valid"].all()
        assert not shares[1]["trains"] and shares[1]["valid"].tolist() == [False]
        assert shares[1]["inert_ids"] == ["r0"]


def test_a_share_whose_every_prompt_was_skipped_trains_an_inert_sample_of_another(shares):
    """Without dynamic sampling: rank 1's two prompts were skipped (bad input, too long). It trains rank 0's first
    sample made inert (valid False: it trains nothing and counts in no statistic) beside rank 0's own share, and
    counts no sample of its own; rank 0 trains its share as it is."""
    ranks = [share["plain"]["one_empty"] for share in shares]
    assert ranks[0]["trains"] and ranks[0]["ids"] == ["r0"] * N_PER_GROUP + ["r2"] * N_PER_GROUP
    assert ranks[0]["valid"].count(False) == 0 and ranks[0]["samples"] == 2 * N_PER_GROUP
    assert not ranks[1]["trains"] and ranks[1]["ids"] == ["r0"] and ranks[1]["valid"] == [False]
    assert ranks[1]["samples"] == 0


def test_a_step_with_no_sample_on_any_share_is_one_error_naming_the_step_and_the_records(shares):
    """Every prompt of the step skipped: every share raises the same error, which names the step (the third: the
    worker asks for step index 2), each skipped record and the keys that skip prompts."""
    errors = [share["plain"]["all_empty"]["error"] for share in shares]
    assert errors[0] == errors[1]
    assert errors[0].startswith("step 3: no sample to train on any of the 2 ranks / rollout actors")
    for rid in ("r0", "r1", "r2", "r3"):
        assert f"record {rid}: missing image" in errors[0]
    assert "data.on_bad_input" in errors[0] and "rollout.prompt_too_long" in errors[0]
    alone = LocalRollouts(_Maker(), _Stream(PLAIN["all_empty"]), single(), LocalSettings(rollout_batch_size=4))
    from mmrlhf.trainer.rollouts import EmptyStepError

    with pytest.raises(EmptyStepError, match="step 1: no sample to train in this process"):
        alone.sample_step(0)


def test_dynamic_sampling_control_per_rank_decisions_differ(shares):
    """Each rank filling the batch from its own share alone keeps other groups (and too many of them)."""
    ranks = shares
    alone = _sampled("mixed", single())
    control = [ranks[r]["sampling_control"] for r in range(RANKS)]
    assert _step_order(control[0]["ids"] + control[1]["ids"]) != _step_order(alone["ids"])
