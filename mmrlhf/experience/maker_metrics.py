"""The metrics the experience maker reports about a step: what was sampled (:func:`rollout_metrics`, stage 1) and
how the scoring forwards agreed with the sampler (:func:`outside_metrics`, :func:`engine_mismatch`, stage 2), and the
shaping's step-wide means (:func:`shaped_means`, stage 2).

Kept apart from the maker so that the maker stays orchestration; every function here reads plain rows and tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.experience.kinds.base import Generated
from mmrlhf.experience.rollout import Rollout
from mmrlhf.experience.timing import PhaseTimer
from mmrlhf.parallel.world import World


def rollout_metrics(batch: Any, out: Generated, timer: PhaseTimer) -> dict[str, float]:
    """Counts, lengths and throughput of what a kind generated from the processor's ``batch``. Response lengths
    count policy tokens (a multi-turn response's observation tokens are in ``agent/observation_tokens/mean``)."""
    rows = out.rows
    counts = {
        "prompts": float(out.prompts),
        "samples": float(len(rows)),
        "skipped_prompts": float(len(out.skipped) + len(batch.skipped)),
        "truncated_prompts": float(batch.truncated),
        "generated_tokens": float(out.generated_tokens),
    }
    if not len(rows):  # an empty share: its counts only (a mean of nothing would be NaN in the step's merge)
        return counts
    lengths = torch.tensor(rows.policy_lengths(), dtype=torch.float32)  # [N]
    truncated = torch.tensor([not f for f in rows.finished], dtype=torch.float32)  # [N]
    return {
        **counts,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "truncation_rate": float(truncated.mean()),
        "throughput/gen_tokens_per_s": out.generated_tokens / max(timer.seconds.get("generate", 0.0), 1e-9),
    }


def outside_metrics(scored) -> dict[str, float]:
    """Under ``logprob_mode: sampled`` with a truncating sampler: the share of scored tokens that lay outside the
    actor's kept set (masked out of the loss; only float disagreement at the boundary puts a sampled token there, so
    anything but ~0 means the engine truncates differently) and outside the reference's (its untruncated log-prob
    stands in: KL against a reference that would never sample the token)."""
    if scored[0].get("outside") is None:
        return {}
    tokens = sum(int(p["action_mask"].sum()) for p in scored)
    out = {"logprobs/outside_kept_frac": sum(int(p["outside"].sum()) for p in scored) / max(tokens, 1)}
    if scored[0].get("ref_outside") is not None:
        out["logprobs/ref_outside_kept_frac"] = sum(int(p["ref_outside"].sum()) for p in scored) / max(tokens, 1)
    return out


def engine_mismatch(rollout: Rollout, scored) -> dict[str, float]:
    """Mean / max |engine log-prob - actor log-prob| over response tokens: the off-policy gap of the rollout.
    Tokens outside the actor's kept set (scored untruncated, out of the loss) are left out: they are counted in
    ``logprobs/outside_kept_frac``. With ``rollout.partial`` only the tokens of the newest version count: the scoring
    copy holds that version, the earlier segments were sampled by versions it no longer has."""
    diffs, turns, row = [], [], 0
    newest = max((max(v) for v in rollout.token_versions if v), default=None)
    for part in scored:
        lp, mask, outside = part["log_probs"], part["action_mask"], part.get("outside")
        for i in range(lp.shape[0]):
            eng = rollout.engine_logprobs[row + i]
            if eng is None:
                continue
            keep = mask[i, : len(eng)].bool()  # policy tokens of the response (all of a single-turn one)
            inside = keep if outside is None else keep & ~outside[i, : keep.shape[0]].bool()
            if newest is not None:
                versions = torch.tensor(rollout.token_versions[row + i][: keep.shape[0]], dtype=torch.long)
                inside = inside & torch.nn.functional.pad(versions == newest, (0, keep.shape[0] - len(versions)))
            diffs.append((torch.tensor(eng[: keep.shape[0]])[inside] - lp[i, : keep.shape[0]][inside]).abs())
            if rollout.multi_turn:  # the turn of each policy token: a turn starts where a run of policy tokens does
                starts = keep & ~torch.nn.functional.pad(keep, (1, 0))[:-1]
                turns.append(torch.cumsum(starts.long(), 0)[inside])
        row += lp.shape[0]
    if not diffs:
        return {}
    d = torch.cat(diffs)
    out = {"engine_logprob_diff/mean": float(d.mean()), "engine_logprob_diff/max": float(d.max())}
    if turns:  # a divergence that grows with the turn points at observations (pixels, positions) going wrong
        t = torch.cat(turns)
        for k in sorted(set(t.tolist())):
            out[f"engine_logprob_diff/turn_{k}/max"] = float(d[t == k].max())
    return out


def shaped_means(shaped: dict[str, Any], world: World) -> dict[str, float]:
    """The step's ``reward/shaped_mean`` (over the valid samples) and ``kl/mean`` (with a KL term in the reward,
    ``kl`` too: the same per-token mean) over the trained tokens of every rank's share: a collective over ``world``,
    so each rank logs the step's value. A mean of the ranks' own means, weighted by their sample counts (the step
    merge's rule), is not the step's: the token counts differ from rank to rank, and where the Ray trainer actors
    make the experiences rank 0's count also holds what dynamic sampling dropped. ``shaped``: :func:`~mmrlhf.
    experience.step_shaping.shape_step`'s answer (``seq_reward`` [N], ``valid`` [N], ``kl`` [N, A] or None, ``mask``
    [N, A], ``metrics``)."""
    valid, kl, mask = shaped["valid"], shaped["kl"], shaped["mask"]
    sums = [float(shaped["seq_reward"][valid].double().sum()), float(valid.sum())]
    if kl is not None:
        sums += [float(kl[mask].double().sum()), float(mask.sum())]
    sums = world.all_sum(sums)
    out = {"reward/shaped_mean": sums[0] / sums[1] if sums[1] else 0.0}
    if kl is not None:
        out["kl/mean"] = sums[2] / sums[3] if sums[3] else 0.0
        if "kl" in shaped["metrics"]:
            out["kl"] = out["kl/mean"]
    return out
