"""Token-budget micro-batches vs the sample-count split, counted (no timing): forwards, costs, rank balance.

One GRPO step of ``--prompts`` x ``--n`` samples whose images vary 4x in side (224 to 896 px: 256 to 4,096 patch
rows, 64 to 1,024 vision tokens with Qwen2-VL's 14-px patches merged 2x2), answers of ``--min-answer`` to
``--max-answer`` tokens. The count split cuts the update's shuffled order (groups adjacent) into micro-batches of
``--micro`` samples; its costliest micro-batch is the peak. The token budget is given exactly that peak: same peak
memory, and the table shows how many forwards each needs, per layout, on one rank and on ``--ranks`` ranks (each
holding half the prompts; the forwards are collective, so the ranks run as many as the busiest needs).

Cost of a micro-batch = decoder positions of its layout (padding included) + vision patch rows
(``mmrlhf.parallel.micro_batches``). Deterministic: the same seed gives the same table on any machine.

Run:  python benchmarks/bench_token_budget.py [--prompts 8] [--n 8] [--micro 4] [--ranks 2]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATCH, MERGE, TEXT_TOKENS = 14, 2, 40  # Qwen2-VL: 14-px patches, 2x2 merged into one token; ~40 text tokens


def grpo_step(prompts: int = 8, n: int = 8, *, min_side: int = 224, max_side: int = 896, min_answer: int = 32,
              max_answer: int = 512, seed: int = 0):
    """SampleCosts of one step: prompt k has one square image, sides evenly spread from ``min_side`` to
    ``max_side`` (multiples of 28 px), answers uniform in ``[min_answer, max_answer]``; groups are the prompts."""
    from mmrlhf.parallel.micro_batches import SampleCost

    rng = random.Random(seed)
    unit = PATCH * MERGE
    costs = []
    for k in range(prompts):
        side = round((min_side + (max_side - min_side) * k / max(prompts - 1, 1)) / unit) * unit
        patches = (side // PATCH) ** 2
        prompt = TEXT_TOKENS + patches // MERGE**2
        costs += [SampleCost(prompt, rng.randint(min_answer, max_answer), patches, 0, k) for _ in range(n)]
    return costs


def _rank_orders(costs, ranks: int, seed: int) -> list[list[int]]:
    """Per rank, its samples in the update's order: whole groups dealt to ranks in turn, then each rank's epoch
    order (groups shuffled, members shuffled within: ``mmrlhf.trainer.minibatch.epoch_order``)."""
    import torch

    from mmrlhf.trainer.minibatch import epoch_order

    groups = sorted({c.group for c in costs})
    out = []
    for r in range(ranks):
        mine = [i for i, c in enumerate(costs) if groups.index(c.group) % ranks == r]
        order = epoch_order(len(mine), torch.Generator().manual_seed(seed + r), [costs[i].group for i in mine])
        out.append([mine[j] for j in order])
    return out


def split_table(costs, *, micro: int = 4, ranks_list=(1, 2), layouts=("padded", "packed", "grouped"),
                max_row_tokens: int | None = 8192, seed: int = 0) -> list[list]:
    """Rows ``[layout, ranks, split, forwards, max cost, mean cost, rank imbalance, count / budget forwards]``:
    the count split of ``micro`` samples against a token budget equal to the count split's peak (the most over
    ranks), one mini-batch of the whole step."""
    from mmrlhf.parallel.micro_batches import Layout, plan_micro_batches, split_metrics
    from mmrlhf.testing.lockstep import run_ranks

    rows = []
    for kind in layouts:
        layout = Layout(kind, max_row_tokens if kind == "grouped" else None)
        for ranks in ranks_list:
            orders = _rank_orders(costs, ranks, seed)

            def plan(world, tokens):
                p = plan_micro_batches(costs, [orders[world.rank]], layout, samples=micro, tokens=tokens, world=world)
                return split_metrics(p, world, "")

            counted = run_ranks(lambda w: plan(w, None), ranks)[0]
            peak = int(counted["micro_batch_tokens_max"])
            budgeted = run_ranks(lambda w: plan(w, peak), ranks)[0]
            for name, m in (("count", counted), (f"budget {peak}", budgeted)):
                rows.append([kind, ranks, name, int(m["micro_batches"]), int(m["micro_batch_tokens_max"]),
                             round(m["micro_batch_tokens_mean"]), round(m["micro_batch_rank_imbalance"], 3),
                             round(counted["micro_batches"] / m["micro_batches"], 2)])
    return rows


COLUMNS = ["layout", "ranks", "split", "forwards", "max cost", "mean cost", "rank imbalance", "fewer forwards"]


def markdown(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * 5) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--min-answer", type=int, default=32)
    ap.add_argument("--max-answer", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="same sizes (it is instantaneous)")
    ap.add_argument("--json")
    args = ap.parse_args()
    costs = grpo_step(args.prompts, args.n, min_answer=args.min_answer, max_answer=args.max_answer, seed=args.seed)
    rows = split_table(costs, micro=args.micro, ranks_list=sorted({1, args.ranks}), seed=args.seed)
    print(f"One GRPO step: {args.prompts} prompts x {args.n} samples, images 224-896 px, answers "
          f"{args.min_answer}-{args.max_answer} tokens; count split of {args.micro} vs a budget = its peak\n")
    print(markdown(rows))
    gains = [row[-1] for row in rows if row[2] != "count"]
    headline = f"token budget at the count split's peak: {min(gains):.2f}-{max(gains):.2f}x fewer forwards"
    print(f"\n{headline}")
    if args.json:
        from _results import table, write_json

        write_json(args.json, "token_budget", headline, vars(args), [table("forwards", COLUMNS, rows)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
