"""One rank of the sharded-scoring test (run by test_scoring_fsdp.py under ``torchrun --nproc-per-node 2``, gloo,
CPU).

The policy, the critic, the reference and the distillation teacher are sharded the way a run shards them
(:func:`mmrlhf.models.sharding.shard_models`, the reference and the teacher as ``scorers``), once without offload and
once with ``distributed.offload=params``; each rank makes the experiences of its share of the step
(scoring_testing.SHARES: rank 1's share is text-only and one forward long, so it runs padding forwards beside rank
0's image and video ones) through ``FastExperienceMaker.experiences_from`` over the world of both ranks. Written to
``--out``: every sample's per-token results, how each model is sharded, and a control: the same step after rank 1
alone moved its shard of one reference weight; and, for the first family, a LoRA run's step (its reference: the
policy's module with the adapters off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models_testing import load_bundle  # noqa: E402
from scoring_testing import (  # noqa: E402
    SHARES,
    lora_scoring_models,
    scored_items,
    scoring_maker,
    scoring_models,
    scoring_rollout,
)

from mmrlhf.models.sharding import shard_models  # noqa: E402
from mmrlhf.parallel.world import join_from_env, leave  # noqa: E402


def layout(model: torch.nn.Module) -> dict:
    """How ``model`` is held on this rank: the share of its elements stored here, whether every parameter is a
    shard, and the offload policy of its root unit."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    state = model._get_fsdp_state()._fsdp_param_group  # the root unit's (FSDP2 keeps no public accessor)
    return {"local_share": local / sum(p.numel() for p in params), "all_sharded": all(isinstance(p, DTensor)
                                                                                       for p in params),
            "offload": type(state.offload_policy).__name__}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("families", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = join_from_env("gloo")
    out = Path(args.out)
    try:
        for family in args.families:
            bundle = load_bundle(family)
            share = scoring_rollout(bundle).select(list(SHARES[world.rank]))
            results, meta = {}, {}
            for offload in ("none", "params"):
                models = scoring_models(bundle)
                shard_models(models["actor"], models["critic"], compute_dtype="float32", offload=offload,
                             scorers=(models["reference"], models["teacher"]))
                meta[offload] = {name: layout(models[name]) for name in ("reference", "teacher")}
                maker = scoring_maker(bundle, models)
                results[offload] = scored_items(maker, share, world=world)
            # control: rank 1 alone moves its shard of one language-block weight of the reference
            name, weight = next((n, p) for n, p in models["reference"].named_parameters() if "layers.0.mlp" in n)
            if world.rank == 1:
                with torch.no_grad():
                    weight.to_local().add_(0.5 * float(weight.to_local().abs().mean()))
            meta["perturbed"] = name
            results["perturbed"] = scored_items(maker, share, world=world)
            if family == args.families[0]:  # a LoRA run: its reference is the sharded policy with the adapters off
                models = lora_scoring_models(bundle)
                shard_models(models["actor"], models["critic"], compute_dtype="float32",
                             scorers=(models["reference"],))
                results["lora"] = scored_items(scoring_maker(bundle, models), share, world=world)
            torch.save(results, out / f"{family}.rank{world.rank}.pt")
            (out / f"{family}.rank{world.rank}.json").write_text(json.dumps(meta))
    finally:
        leave()


if __name__ == "__main__":
    main()
