"""The Ray mode deals a step's prompt groups to its trainer ranks by cost (tokens and vision patch rows), each rank
as many groups as round-robin would give it (:mod:`mmrlhf.parallel.dealing`, ``launch/ray/source.deal``)."""

from __future__ import annotations

import torch

from mmrlhf.parallel.dealing import deal_by_cost, imbalance


def test_longest_first_to_the_least_loaded_rank_with_room():
    costs = [100, 100, 10, 10, 90, 10, 80, 10]  # round-robin: rank 0 gets 100 + 10 + 90 + 80 = 280, rank 1 130
    rr = [g % 2 for g in range(len(costs))]
    assert imbalance(costs, rr, 2) > 1.35
    ranks = deal_by_cost(costs, 2)
    assert [ranks.count(r) for r in range(2)] == [4, 4]  # as many groups as round-robin
    assert imbalance(costs, ranks, 2) < 1.03


def test_group_counts_follow_round_robin_and_the_deal_is_deterministic():
    for n, ranks in ((7, 3), (2, 4), (0, 2), (9, 1)):
        costs = [float((g * 37) % 11) for g in range(n)]
        got = deal_by_cost(costs, ranks)
        assert [got.count(r) for r in range(ranks)] == [[g % ranks for g in range(n)].count(r) for r in range(ranks)]
        assert got == deal_by_cost(costs, ranks)
    assert deal_by_cost([5.0, 5.0, 5.0, 5.0], 2) == [0, 1, 0, 1]  # ties: earlier group, lower rank


def _item(prompt: int, response: int, group: int, patches: int = 0):
    from mmrlhf.experience.batching import TrainItem

    vision = {} if not patches else {"pixel_values": torch.zeros(patches, 4),
                                     "image_grid_thw": torch.tensor([[1, 1, patches]])}
    return TrainItem(list(range(prompt)), list(range(response)), vision, {},
                     {"loss_mask": torch.ones(response, dtype=torch.bool)}, {"group": torch.tensor(group)})


def test_deal_balances_the_shares_groups_and_keeps_their_order():
    from mmrlhf.experience.wire import pack_items
    from mmrlhf.launch.ray.ledger import ExperienceLedger
    from mmrlhf.launch.ray.source import deal

    # each share: an image group first, then a light text group; round-robin would put both image groups on rank 0
    share0 = [_item(10, 20, 0, 400), _item(10, 20, 0, 400), _item(10, 5, 1), _item(10, 6, 1)]  # 860, 31
    share1 = [_item(8, 30, 0, 300), _item(8, 30, 0, 300), _item(8, 4, 1), _item(8, 3, 1)]  # 676, 23
    payloads = [{"share": i, "samples": 4, "items": pack_items(items), "distribution": "d"}
                for i, items in enumerate((share0, share1))]
    parts = deal(3, payloads, [0, 1], 2, ExperienceLedger())
    assert [sum(bool(it.vision) for it in p["items"]) for p in parts] == [2, 2]  # one image group per rank
    assert [len(p["items"]) for p in parts] == [4, 4]  # two groups each, as round-robin
    # the shares' order kept on each rank; share 1's items are one version old
    assert [len(it.response_ids) for it in parts[0]["items"]] == [20, 20, 4, 3]
    assert [len(it.response_ids) for it in parts[1]["items"]] == [5, 6, 30, 30]
    assert parts[0]["fresh"] == [True, True, False, False] and parts[1]["fresh"] == [True, True, False, False]
    got = parts[0]["metrics"]["ray/rank_cost_imbalance"]
    assert abs(got - 883 / 795) < 1e-9  # round-robin's: (860 + 676) / 795 = 1.93
    one = deal(3, payloads, [0, 0], 1, ExperienceLedger())[0]  # one rank: every item, in arrival order
    assert [len(it.response_ids) for it in one["items"]] == [20, 20, 5, 6, 30, 30, 4, 3]
    assert one["metrics"]["ray/rank_cost_imbalance"] == 1.0


def test_a_rank_without_a_group_trains_an_inert_copy():
    """Dynamic sampling may keep fewer groups than there are trainer ranks: a rank left without one gets an inert
    copy (no loss token, marked invalid), so its re-scoring forwards and its update pair with the others' (sharded
    parameters are gathered in collectives; without it the forward loop refuses a rank with nothing to repeat)."""
    from mmrlhf.experience.wire import pack_items
    from mmrlhf.launch.ray.ledger import ExperienceLedger
    from mmrlhf.launch.ray.source import deal

    items = [_item(10, 5, 0), _item(10, 7, 0)]
    for it in items:
        it.info["valid"] = torch.tensor(True)
    payloads = [{"share": 0, "samples": 2, "items": pack_items(items), "distribution": "d"},
                {"share": 1, "samples": 0, "items": pack_items([]), "distribution": "d"}]
    parts = deal(0, payloads, [0, 0], 3, ExperienceLedger())
    sizes = [len(p["items"]) for p in parts]
    assert sorted(sizes) == [1, 1, 2]
    for part in parts:
        if len(part["items"]) == 1:
            (inert,) = part["items"]
            assert part["inert"] == 1 and part["fresh"] == [False]
            assert not inert.token["loss_mask"].any() and not bool(inert.info["valid"])
        else:
            assert "inert" not in part and all(it.token["loss_mask"].all() for it in part["items"])
    assert all(bool(it.info["valid"]) for it in items)  # the originals are untouched
    empty = deal(0, [{"share": 0, "samples": 0, "items": pack_items([]), "distribution": "d"}], [0], 2,
                 ExperienceLedger())
    assert [p["items"] for p in empty] == [[], []]  # no group anywhere: nothing to pair, every rank skips alike
