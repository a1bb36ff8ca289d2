"""One process of the torchrun acceptance test (``test_torchrun.py``): the toy task's first training step.

Run plainly it is the one-process reference; under ``torchrun --nproc-per-node 2`` each rank is one FSDP2 shard.
Either way the SAME global first rollout trains: the process (or rank 0) generates it from the seeded prompt
stream and engine (rank 0 samples with the one-process seed), rank 0 broadcasts it, and each rank keeps the prompts
``rank::world`` (the split the trainer's own ``_sample`` uses). The worker records the full gradients the
optimiser receives (all-gathered from the shards), the update metrics and the updated parameters.

The reward leaves about a third of the samples out of the loss, so the ranks train on different numbers of
tokens. ``--control per-rank-norm``: each rank normalises its loss by its OWN token count (as if the denominator
were not summed over ranks); that must NOT match.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--control", default="")
    ap.add_argument("--drop-group", type=int, default=-1,
                    help="leave this group out (as if its prompt were skipped on its rank): the ranks then hold "
                         "different numbers of samples; micro-batches of 16 make their forward counts differ")
    args = ap.parse_args()

    from mmrlhf.config import load_config
    from mmrlhf.data.stream import record_columns
    from mmrlhf.launch.backend import launched_by_torchrun
    from mmrlhf.parallel.world import full, join_from_env, leave
    from mmrlhf.trainer.builder import build_trainer

    dist = join_from_env("gloo") if launched_by_torchrun() else None
    out = Path(args.out)
    config = load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={args.model}", f"trainer.output_dir={out / 'run'}", "trainer.overwrite_output_dir=true",
        "trainer.eval_steps=0", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "trainer.rollout_batch_size=8", "trainer.train_batch_size=128", "trainer.micro_train_batch_size=32",
        "rollout.n_samples_per_prompt=16", "algorithm.kl_loss_coef=0.05", "algorithm.entropy_coef=0.01",
        "reward.label_map={first_word: {type: function, function: \"mmrlhf.testing.rewards:partial_length_reward\"}}",
        *(["rollout.micro_rollout_batch_size=16", "trainer.micro_train_batch_size=16"] if args.drop_group >= 0
          else [])])
    trainer = build_trainer(config, world=dist)
    source = trainer.p.source
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)

    rollout = None
    if rank == 0:
        records = source.stream.next_batch(config.trainer.rollout_batch_size)
        rollout = source.maker.generate_rollout(**record_columns(records))
    if dist is not None:
        rollout = dist.broadcast_object(rollout)
    if args.control == "per-rank-norm":  # single-number sums are the loss denominators (and the finite flags)
        all_sum = dist.all_sum
        object.__setattr__(dist, "all_sum", lambda v: [x * world for x in v] if len(v) == 1 else all_sum(v))
    groups = rollout.group_ids.tolist()
    rows = [i for i, g in enumerate(groups) if g % world == rank and g != args.drop_group]
    share = rollout.select(rows)

    captured: dict[str, torch.Tensor] = {}
    stepper = trainer.p.policy.stepper
    original_step = stepper.step

    def recording_step(loss_finite: bool):
        for name, p in trainer.p.policy.actor.named_parameters():
            if p.grad is not None:
                captured[f"grad.{name}"] = full(p.grad).detach().clone()
        return original_step(loss_finite)

    stepper.step = recording_step
    metrics = trainer.train_on(source.prepare(share, dict(share.metrics)))
    params = {f"param.{n}": full(p.detach()).clone() for n, p in trainer.p.policy.actor.named_parameters()
              if p.requires_grad}
    if rank == 0:
        torch.save({**captured, **params}, out / "tensors.pt")
        keep = {k: float(v) for k, v in metrics.items() if k.startswith(("policy/", "engine_logprob_diff/"))}
        keep["samples_per_rank"] = float(len(share))
        keep["valid_rewards"] = float(rollout.rewards.valid.sum())
        keep["rewards_sum"] = float(rollout.rewards.rewards[rollout.rewards.valid].sum())
        (out / "metrics.json").write_text(json.dumps(keep))
    source.engine.close()
    if dist is not None:
        leave()


if __name__ == "__main__":
    main()
