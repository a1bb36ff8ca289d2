"""Per-component reward normalisation (GDPO): against a plain-loop oracle, the drowning case it exists for, and its
edge cases (constant terms, missing scores, mixed recipes in one group)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mmrlhf.algorithms.advantages import compute_advantages
from mmrlhf.algorithms.dynamic_sampling import filter_groups
from mmrlhf.algorithms.reward_components import per_component_rewards

NAN = float("nan")


def _ref(scores, weights, gids, eps):
    """The definition, one sample and one term at a time: z over the group's samples that have a score for the term
    (unbiased std; 0 when the term is constant there), weighted by the sample's own recipe weight, summed."""
    out = []
    for i, gid in enumerate(gids):
        total = 0.0
        for c in range(len(scores[i])):
            s, w = scores[i][c], weights[i][c]
            if math.isnan(s) or w == 0:
                continue
            peers = [scores[j][c] for j in range(len(gids))
                     if gids[j] == gid and not math.isnan(scores[j][c]) and weights[j][c] != 0]
            if max(peers) == min(peers):
                continue
            mean = sum(peers) / len(peers)
            std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (len(peers) - 1))
            total += w * (s - mean) / (std + eps)
        out.append(total)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_matches_the_definition(seed):
    rng = random.Random(seed)
    n, c = rng.randint(1, 14), rng.randint(1, 4)
    gids = [rng.choice([-3, 0, 7, 1000]) for _ in range(n)]
    scores = [[rng.choice([0.0, 1.0]) if k == 0 else (NAN if rng.random() < 0.2 else rng.uniform(-5, 5))
               for k in range(c)] for _ in range(n)]
    weights = [[rng.choice([0.0, 0.1, 1.0, 2.5, -1.0]) for _ in range(c)] for _ in range(n)]
    eps = rng.choice([1e-6, 0.5])
    got = per_component_rewards(torch.tensor(scores), torch.tensor(weights), torch.tensor(gids), eps=eps)
    # float32 scores in, float64 statistics: the oracle reads the same float32 values
    want = _ref(torch.tensor(scores).double().tolist(), torch.tensor(weights).double().tolist(), gids, eps)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_a_large_scale_term_drowns_correctness_when_summed_but_not_per_component():
    """Correctness 0/1 (weight 1) next to a quality score in [0, 10] (weight 0.5) whose spread is far larger: summed,
    the wrong answers outrank the right ones and GRPO pushes them up; per component, correctness counts as its
    weight says and the right answers get the positive advantages."""
    correct = [1.0, 0.0, 1.0, 0.0]
    quality = [2.0, 9.0, 3.0, 8.0]
    scores = torch.tensor([correct, quality]).T  # [4, 2]
    weights = torch.tensor([[1.0, 0.5]] * 4)
    gids = torch.zeros(4, dtype=torch.long)
    summed = (scores * weights).sum(-1)  # [2.0, 4.5, 2.5, 4.0]
    assert summed.tolist() == [2.0, 4.5, 2.5, 4.0]
    per_comp = per_component_rewards(scores, weights, gids)
    # written out: correctness z = +-0.5 / sqrt(1/3) = +-0.8660; quality mean 5.5, std sqrt(37/3) = 3.5119,
    # 0.5 z = 0.5 * [-3.5, 3.5, -2.5, 2.5] / 3.5119
    z_ok = 0.5 / math.sqrt(1 / 3)
    q_std = math.sqrt(37 / 3)
    want = [z_ok - 0.5 * 3.5 / q_std, -z_ok + 0.5 * 3.5 / q_std, z_ok - 0.5 * 2.5 / q_std, -z_ok + 0.5 * 2.5 / q_std]
    torch.testing.assert_close(per_comp, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)

    def grpo_adv(seq):  # one token per response: the sequence reward is the token reward
        adv, _ = compute_advantages("grpo", seq.float()[:, None], torch.ones(4, 1, dtype=torch.bool), group_ids=gids)
        return adv[:, 0]

    right = torch.tensor(correct).bool()
    assert (grpo_adv(summed)[right] < 0).all() and (grpo_adv(summed)[~right] > 0).all()  # drowned
    assert (grpo_adv(per_comp)[right] > 0).all() and (grpo_adv(per_comp)[~right] < 0).all()


def test_constant_terms_give_zero_and_a_group_with_every_term_constant_is_uninformative():
    scores = torch.tensor([[1.0, 0.3], [1.0, 0.7], [0.0, 5.0], [0.0, 5.0], [1.0, 2.0], [0.0, 2.0]])
    weights = torch.ones(6, 2)
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    out = per_component_rewards(scores, weights, gids)
    # group 0: the first term is constant (adds 0); the second is (0.3 - 0.5) / (sqrt(0.08) + eps) = -0.7071
    assert out[0].item() == pytest.approx(-0.5 * 0.4 / (math.sqrt(0.08) + 1e-6))
    assert out[0].item() == pytest.approx(-out[1].item())
    assert out[2].item() == out[3].item() == 0.0  # every term constant: exactly 0, no eps-sized noise
    sel = filter_groups(out, gids)
    assert sel.kept_groups.tolist() == [0, 2]  # dynamic sampling drops group 1
    assert per_component_rewards(scores[:1], weights[:1], gids[:1]).item() == 0.0  # a group of one


def test_a_missing_score_is_left_out_of_its_terms_statistics_and_adds_zero():
    scores = torch.tensor([[1.0, 4.0], [0.0, NAN], [1.0, 2.0], [0.0, 9.0]])
    weights = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    gids = torch.zeros(4, dtype=torch.long)
    out = per_component_rewards(scores, weights, gids)
    first = per_component_rewards(scores[:, :1], weights[:, :1], gids)  # the first term alone
    kept = torch.tensor([0, 2, 3])  # the second term's statistics: the three samples that have it
    second = per_component_rewards(scores[kept, 1:], weights[kept, 1:], gids[kept])
    assert out[1].item() == first[1].item()  # the NaN term adds exactly 0
    torch.testing.assert_close(out[kept], first[kept] + second)
    # a weight of 0 is the same as no score: the term is not in that sample's recipe
    zero_w = weights.clone()
    zero_w[1, 1] = 0.0
    torch.testing.assert_close(per_component_rewards(scores.nan_to_num(123.0), zero_w, gids), out)


def test_samples_of_different_recipes_in_one_group_weigh_their_own_terms():
    """Label a: 1 x acc + 0.5 x fmt; label b: 2 x acc only (fmt not in its recipe: weight 0, no score). acc's
    statistics pool all four samples; fmt's only the two of label a."""
    scores = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, NAN], [0.0, NAN]])
    weights = torch.tensor([[1.0, 0.5], [1.0, 0.5], [2.0, 0.0], [2.0, 0.0]])
    out = per_component_rewards(scores, weights, torch.zeros(4, dtype=torch.long))
    z_acc = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # acc over [1, 0, 1, 0]
    z_fmt = 0.5 / (math.sqrt(0.5) + 1e-6)  # fmt over [1, 0]
    want = [z_acc + 0.5 * z_fmt, -z_acc - 0.5 * z_fmt, 2 * z_acc, -2 * z_acc]
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float64))


def test_bad_shapes_and_eps_are_refused():
    with pytest.raises(ValueError, match=r"\[N, C\]"):
        per_component_rewards(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        per_component_rewards(torch.zeros(3, 1), torch.ones(3, 1), torch.zeros(3, dtype=torch.long), eps=0.0)
