"""The micro-batches of the experience maker's scoring forwards (actor old log-probs, reference, critic values),
planned by cost (``rollout.max_tokens_per_micro_batch``, :mod:`mmrlhf.parallel.micro_batches`), and the way back
from them to the experiences.

Why two partitions: the experiences keep the rollout's sample order in consecutive chunks of
``rollout.micro_rollout_batch_size`` (the trainer's shuffle, the reports and the Ray dealing read that order), while
the forwards may group any samples (longest first, so a chunk's samples are spread over several forwards). The
forwards' ``[b, A]`` outputs are scattered back to sample order and cut into the chunks (:func:`regroup`): what
each sample scores does not depend on its neighbours (every layout scores each sample on its own positions), so the
experiences equal the count split's up to float32 summation order.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mmrlhf.experience.costs import sample_costs
from mmrlhf.experience.rollout import Rollout
from mmrlhf.models.batch import pad_positions
from mmrlhf.parallel.micro_batches import Budget, Layout, SplitPlan, plan_micro_batches


def consecutive(n: int, micro: int) -> list[list[int]]:
    """Rows ``0 .. n-1`` in consecutive chunks of ``micro`` (the experiences' partition)."""
    return [list(range(s, min(s + micro, n))) for s in range(0, n, micro)]


def scoring_plan(rows: Rollout, *, micro: int, max_tokens: Budget, layout: Layout, adapter: Any,
                 world: Any) -> SplitPlan:
    """The scoring micro-batches of ``rows`` (one mini-batch: the whole rollout), agreed over ``world``'s ranks
    (collective: sharded forwards pair across ranks; empty lists are padding forwards)."""
    costs = sample_costs(rows.prompt_ids, rows.response_ids, rows.vision, adapter=adapter,
                         grouped=layout.kind == "grouped", keys=rows.group, multi_turn=rows.multi_turn)
    return plan_micro_batches(costs, [list(range(len(rows)))], layout, samples=micro, tokens=max_tokens, world=world)


def regroup(parts: Sequence[dict[str, torch.Tensor | None]], micros: Sequence[Sequence[int]],
            chunks: Sequence[Sequence[int]], widths: Sequence[int]) -> list[dict[str, torch.Tensor | None]]:
    """Per-forward outputs (``parts[k][key]``: [b_k, A_k] for the rows ``micros[k]``) as per-chunk outputs
    (``[len(chunks[c]), widths[c]]`` for the rows ``chunks[c]``, in that order). A key is None everywhere or
    nowhere; positions past a forward's width are zero (False), as its own padding was."""
    if len(parts) != len(micros):
        raise ValueError(f"{len(parts)} scored forwards for {len(micros)} micro-batches")
    n = sum(len(m) for m in micros)
    where = torch.empty(n, dtype=torch.long)  # [N] row -> position in the concatenated forwards
    where[torch.tensor([i for m in micros for i in m], dtype=torch.long)] = torch.arange(n)
    out: list[dict[str, torch.Tensor | None]] = [{} for _ in chunks]
    for key in parts[0]:
        values = [p[key] for p in parts]
        if all(v is None for v in values):
            for o in out:
                o[key] = None
            continue
        if any(v is None for v in values):
            raise ValueError(f"scored field {key!r} is missing from some forwards")
        width = max(max(v.shape[1] for v in values), max(widths, default=0))
        flat = torch.cat([pad_positions(v, width) for v in values])  # [N, W, ...]
        for o, chunk, w in zip(out, chunks, widths):
            o[key] = flat[where[torch.tensor(list(chunk), dtype=torch.long)], :w]  # [b_c, A_c]
    return out
