"""``deal_rows``: under ``distributed.scoring: trainer`` trainer rank 0 joins the rollout actors' rows and deals them
to the trainer ranks as whole groups by cost, counted in the ledger; a rank without a group trains an inert copy."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.experience.rollout import Rollout, ScoredRollout
from mmrlhf.launch.ray.ledger import ExperienceLedger
from mmrlhf.launch.ray.source import deal_rows
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings


def _share(share: int, lengths: list[list[int]]) -> dict:
    """A rollout actor's payload: groups of samples with these response lengths (the rewards number the rows)."""
    cols: dict[str, list] = {name: [] for name in Rollout.__dataclass_fields__}
    for group, sizes in enumerate(lengths):
        for n in sizes:
            for name, value in (("sample_index", len(cols["group"])), ("group", group), ("prompt_ids", [1, 1]),
                                ("response_ids", [2] * n), ("engine_logprobs", [-0.5] * n), ("finished", True),
                                ("vision", {}), ("prompts", "p"), ("labels", None), ("references", None),
                                ("images", []), ("record_ids", f"s{share}g{group}")):
                cols[name].append(value)
    n = len(cols["group"])
    rewards = RewardResult(rewards=torch.arange(n, dtype=torch.float32) + 100 * share,
                           valid=torch.ones(n, dtype=torch.bool), sources={}, parts={}, metrics={})
    rows = ScoredRollout(Rollout(**cols), rewards, SamplingSettings(), {"samples": float(n)})
    return {"share": share, "samples": n, "rows": rows}


def _groups(rows: ScoredRollout) -> dict[str, list[float]]:
    """record id -> the rewards of its rows (a group's identity across the join)."""
    out: dict[str, list[float]] = {}
    for rid, r in zip(rows.rows.record_ids, rows.rewards.rewards.tolist()):
        out.setdefault(rid, []).append(r)
    return out


def test_whole_groups_are_dealt_by_cost_and_counted():
    payloads = [_share(0, [[9, 9], [1, 1], [2, 2]]), _share(1, [[8, 8], [1, 1]])]
    ledger = ExperienceLedger()
    parts = deal_rows(3, payloads, [0, 1], 2, ledger)
    assert [len(p["rows"]) for p in parts] == [6, 4]  # ceil / floor of 5 groups, 2 samples each
    dealt = [_groups(p["rows"]) for p in parts]
    # every group whole on one rank, none lost or doubled: the shares' groups are told apart after the join
    assert sorted(k for d in dealt for k in d) == ["s0g0", "s0g1", "s0g2", "s1g0", "s1g1"]
    assert dealt[0]["s0g0"] == [0.0, 1.0] and dealt[1]["s1g0"] == [100.0, 101.0]
    assert len({g for p in parts for g in p["rows"].rows.group}) == 5  # the join keeps group ids apart
    # the two costliest groups (responses of 9 and 8) on different ranks; each rank's rows in the shares' order
    assert ("s0g0" in dealt[0]) != ("s1g0" in dealt[0])
    for p in parts:
        ids = p["rows"].rows.record_ids
        assert ids == sorted(ids, key=lambda rid: (rid[1], rid[3]))
        # freshness follows the share's staleness (share 1 is a version old: not in the sync check)
        assert p["fresh"] == [rid.startswith("s0") for rid in ids] and p["describe"]
    assert ledger.check_step(3, 2)["ledger/consumed"] == 10
    assert parts[0]["metrics"]["ray/rank_cost_imbalance"] >= 1.0


def test_a_rank_without_a_group_trains_an_inert_copy_and_a_step_without_rows_deals_none():
    parts = deal_rows(0, [_share(0, [[3, 3]]), {"share": 1, "samples": 0, "rows": None}], [0, 0], 2,
                      ExperienceLedger())
    assert len(parts[0]["rows"]) == 2 and parts[0]["describe"]
    inert = parts[1]["rows"]
    assert len(inert) == 1 and not parts[1]["describe"] and parts[1]["inert"] == 1
    assert not bool(inert.rewards.valid.any()) and float(inert.rewards.rewards.abs().sum()) == 0.0
    empty = deal_rows(1, [{"share": 0, "samples": 0, "rows": None}], [0], 2, ExperienceLedger())
    assert [p["rows"] for p in empty] == [None, None]


def test_a_share_whose_count_disagrees_with_its_rows_is_an_error():
    bad = _share(0, [[2, 2]])
    bad["samples"] = 3
    with pytest.raises(RuntimeError, match="share 0: 3 samples announced, 2 rows sent"):
        deal_rows(0, [bad], [0], 1, ExperienceLedger())
