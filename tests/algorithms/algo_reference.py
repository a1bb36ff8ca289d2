"""Slow, obviously correct reference implementations (plain Python loops over floats) and random batch makers.

Nothing here imports mmrlhf.algorithms: the references must not share code with what they check.
"""

from __future__ import annotations

import math
import random

import torch


def random_batch(seed: int, *, holes: bool = False, min_len: int = 0, dtype=torch.float64):
    """Right-padded responses of random lengths (some empty unless ``min_len`` > 0), uneven groups with arbitrary
    (negative, large, unsorted) ids, token rewards everywhere (padding included, so leaks would show), values.
    ``holes`` also masks random tokens inside responses (multi-turn tool output)."""
    rng = random.Random(seed)
    n_groups = rng.randint(1, 5)
    ids_pool = rng.sample([-7, 0, 3, 11, 42, 1000, 99999, -1], n_groups)
    sizes = [rng.randint(1, 5) for _ in ids_pool]
    gids = [g for g, s in zip(ids_pool, sizes) for _ in range(s)]
    rng.shuffle(gids)
    b = len(gids)
    a = rng.randint(1, 9)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, a, generator=g, dtype=dtype)
    # make a zero-variance group sometimes: identical sequence rewards need identical token rewards
    values = torch.randn(b, a, generator=g, dtype=dtype)
    mask = torch.zeros(b, a, dtype=torch.bool)
    for i in range(b):
        n = rng.randint(min(min_len, a), a)
        mask[i, :n] = True
        if holes:
            for t in range(n):
                if rng.random() < 0.25:
                    mask[i, t] = False
    if rng.random() < 0.5 and n_groups > 1:
        target = gids[0]
        for i in range(b):
            if gids[i] == target:
                mask[i] = mask[0]
                rewards[i] = rewards[0]
    return rewards, mask, values, torch.tensor(gids)


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def rows(x):
    return [[float(v) for v in row] for row in x.tolist()]


def mask_rows(m):
    return [[bool(v) for v in row] for row in m.tolist()]


def ref_seq_rewards(r, m):
    return [sum(rv for rv, mv in zip(rr, mm) if mv) for rr, mm in zip(rows(r), mask_rows(m))]


def ref_groups(gids):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def broadcast(seq_adv, m):
    return _t([[seq_adv[i] if mv else 0.0 for mv in row] for i, row in enumerate(mask_rows(m))])


def ref_gae(r, v, m, gamma, lam):
    out = []
    for rr, vv, mm in zip(rows(r), rows(v), mask_rows(m)):
        pos = [t for t in range(len(mm)) if mm[t]]
        adv = [0.0] * len(mm)
        last = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_v = vv[pos[k + 1]] if k + 1 < len(pos) else 0.0
            delta = rr[t] + gamma * next_v - vv[t]
            last = delta + gamma * lam * last
            adv[t] = last
        out.append(adv)
    adv = _t(out)
    ret = _t([[a + (vv[t] if mm[t] else 0.0) if mm[t] else 0.0 for t, a in enumerate(ar)]
                        for ar, vv, mm in zip(out, rows(v), mask_rows(m))])
    return adv, ret


def _std(xs, unbiased):
    mu = sum(xs) / len(xs)
    d = len(xs) - 1 if unbiased else len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / d)


def ref_group_norm(r, m, gids, *, eps=1e-6, by_std=True, unbiased=True):
    seq = ref_seq_rewards(r, m)
    adv = [0.0] * len(seq)
    for members in ref_groups(gids).values():
        vals = [seq[i] for i in members]
        if len(vals) == 1 or max(vals) == min(vals):
            continue
        mu = sum(vals) / len(vals)
        for i in members:
            adv[i] = (seq[i] - mu) / (_std(vals, unbiased) + eps) if by_std else seq[i] - mu
    return broadcast(adv, m)


def ref_rloo(r, m, gids):
    seq = ref_seq_rewards(r, m)
    adv = [0.0] * len(seq)
    for members in ref_groups(gids).values():
        if len(members) == 1 or len({seq[i] for i in members}) == 1:
            continue
        for i in members:
            others = [seq[j] for j in members if j != i]
            adv[i] = seq[i] - sum(others) / len(others)
    return broadcast(adv, m)


def ref_reward_to_go(r, m, gamma):
    out = []
    for rr, mm in zip(rows(r), mask_rows(m)):
        g = [0.0] * len(rr)
        for t in range(len(rr)):
            if not mm[t]:
                continue
            k, total = 0, 0.0
            for u in range(t, len(rr)):
                if mm[u]:
                    total += gamma**k * rr[u]
                    k += 1
            g[t] = total
        out.append(g)
    return _t(out)


def ref_whiten(x, m, eps=1e-8):
    vals = [v for vr, mr in zip(rows(x), mask_rows(m)) for v, mv in zip(vr, mr) if mv]
    if not vals or max(vals) == min(vals):
        return torch.zeros(x.shape, dtype=torch.float64)
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    return _t([[(v - mu) / math.sqrt(var + eps) if mv else 0.0 for v, mv in zip(vr, mr)]
                         for vr, mr in zip(rows(x), mask_rows(m))])


def ref_reinforce_baseline(r, m, gids, gamma):
    g = ref_reward_to_go(r, m, gamma)
    mr = mask_rows(m)
    g0 = []
    for i, row in enumerate(mr):
        first = next((t for t in range(len(row)) if row[t]), None)
        g0.append(float(g[i, first]) if first is not None else 0.0)
    centred = g.clone()
    for members in ref_groups(gids).values():
        mu = sum(g0[i] for i in members) / len(members)
        for i in members:
            for t in range(len(mr[i])):
                centred[i, t] = g[i, t] - mu if mr[i][t] else 0.0
    return ref_whiten(centred, m), g


def ref_cpgd_clip_filter(r, m, gids, max_weight=3.0):
    seq = ref_seq_rewards(r, m)
    valid = [members for members in ref_groups(gids).values()
             if len(members) > 1 and len({seq[i] for i in members}) > 1]
    n_valid = sum(1 for g in valid for i in g if any(mask_rows(m)[i]))
    present = sum(1 for row in mask_rows(m) if any(row))  # samples with a response token (masked-out ones have none)
    scale = min(present / n_valid, max_weight) if n_valid else 0.0
    adv = [0.0] * len(seq)
    for members in valid:
        mu = sum(seq[i] for i in members) / len(members)
        for i in members:
            adv[i] = (seq[i] - mu) * scale
    return broadcast(adv, m)


def ref_agg(loss, m, mode, norm_len=None):
    lr, mr = rows(loss), mask_rows(m)
    if mode == "token-mean":
        vals = [v for a, b in zip(lr, mr) for v, k in zip(a, b) if k]
        return sum(vals) / len(vals) if vals else 0.0
    per_seq = []
    for a, b in zip(lr, mr):
        vals = [v for v, k in zip(a, b) if k]
        if not vals:
            continue
        if mode == "seq-mean-token-mean":
            per_seq.append(sum(vals) / len(vals))
        elif mode == "seq-mean-token-sum":
            per_seq.append(sum(vals))
        else:
            per_seq.append(sum(vals) / (norm_len or len(a)))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


def custom_estimator(token_rewards, mask, *, values=None, group_ids=None, scale: float = 1.0):
    """Used by the ``path/file.py:function`` registry test."""
    return token_rewards * scale, token_rewards * scale
