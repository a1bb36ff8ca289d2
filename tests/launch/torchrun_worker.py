"""One process of the torchrun acceptance test (``test_torchrun.py``): the toy task's first training step.

Run plainly it is the one-process reference; under ``torchrun --nproc-per-node 2`` each rank is one FSDP2 shard.
Either way the SAME global first rollout trains: the process (or rank 0) generates it from the seeded prompt
stream and engine (rank 0 samples with the one-process seed), rank 0 broadcasts it, and each rank keeps the prompts
``rank::world`` (the split the trainer's own ``_sample`` uses). The worker records the full gradients the
optimiser receives (all-gathered from the shards), the update metrics and the updated parameters.

The reward leaves about a third of the samples out of the loss, so the ranks train on different numbers of
tokens. ``control=per-rank-norm``: each rank normalises its loss by its OWN token count (as if the denominator
were not summed over ranks); that must NOT match.

One launch runs several cases (``--case OUT[,control=per-rank-norm][,drop-group=N]``) on one trainer and its one
first rollout: a launch (the imports, the process group, the engine) costs several times the step, so the test
launches twice (one process, 2 ranks), not once per case. Every case but the last records its gradients (and their
norm) and skips its optimiser step (the weights, the optimiser and the shuffling generator stay as built), so each
case trains from the built state and the last, which steps, trains exactly as in a launch of its own. A control
cannot be the last: its step would train with the wrong normalisation. ``drop-group=N`` leaves group N out of the
trained share, as a skipped prompt would. Micro-batches are of 16 samples in every case, so that the uneven case's
ranks run different numbers of forwards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmrlhf.startup import defer_full_collections

defer_full_collections()  # as `mmrlhf train` does while it loads (build_trainer puts it back)
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def parse_case(spec: str) -> dict:
    """``OUT[,control=per-rank-norm][,drop-group=N]`` -> {out, control, drop_group}."""
    out, *options = spec.split(",")
    case = {"out": Path(out), "control": "", "drop_group": -1}
    for option in options:
        key, value = option.split("=", 1)
        if key == "control" and value == "per-rank-norm":
            case["control"] = value
        elif key == "drop-group":  # leave this group out (as if its prompt were skipped on its rank): the ranks
            # then hold different numbers of samples; micro-batches of 16 make their forward counts differ
            case["drop_group"] = int(value)
        else:
            raise SystemExit(f"unknown case option {option!r} in {spec!r}")
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--case", action="append", required=True, type=parse_case,
                    help="OUT[,control=per-rank-norm][,drop-group=N]; repeat for several cases in this launch (all but "
                         "the last record their gradients without stepping)")
    ap.add_argument("--offload", action="store_true",
                    help="one process with distributed.offload=params (FSDP2 over a world of one rank)")
    args = ap.parse_args()

    from mmrlhf.launch.backend import launched_by_torchrun
    from mmrlhf.parallel.world import join_alone, join_from_env, leave

    dist = None
    if launched_by_torchrun():
        dist = join_from_env("gloo")
    elif args.offload:  # as `mmrlhf train` makes it for the key (mmrlhf.launch.run)
        dist = join_alone("gloo", host_tensors=True)
    OFFLOAD[:] = ["distributed.offload=params"] if args.offload else []
    if args.case[-1]["control"]:
        raise SystemExit("the last case steps: it cannot be a control")
    first_step(dist, args.model, args.case)
    if dist is not None:
        leave()


OFFLOAD: list[str] = []  # the launch's distributed.offload override


def host_bytes(trainer) -> dict[str, float]:
    """Where the policy's states are (``distributed.offload``): the FSDP2 offload policy of the actor, and the bytes
    of its parameters' shards and AdamW moments, to set beside the memory plan's host rows."""
    actor = trainer.p.policy.actor
    state = actor._get_fsdp_state() if hasattr(actor, "_get_fsdp_state") else None
    policy = type(state._fsdp_param_group.offload_policy).__name__ if state is not None else "none"
    local = [p.to_local() if hasattr(p, "to_local") else p for p in actor.parameters()]
    moments = [t.to_local() if hasattr(t, "to_local") else t
               for st in trainer.p.policy.stepper.optimizer.state.values()
               for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"offload_policy": policy, "weights_bytes": float(sum(t.numel() * t.element_size() for t in local)),
            "moments_bytes": float(sum(t.numel() * t.element_size() for t in moments)),
            "on_host": float(all(t.device.type == "cpu" for t in local + moments))}


def first_step(dist, model: str, cases: list[dict]) -> None:
    """Build a trainer, generate the first rollout, and train this rank's share of it once per case (every case but
    the last without its optimiser step)."""
    from mmrlhf.config import load_config
    from mmrlhf.data.stream import record_columns
    from mmrlhf.parallel.world import full
    from mmrlhf.trainer.builder import build_trainer

    config = load_config(ROOT / "examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={model}", f"trainer.output_dir={cases[0]['out'] / 'run'}",
        "trainer.overwrite_output_dir=true", "trainer.eval_steps=0", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "trainer.rollout_batch_size=8", "trainer.train_batch_size=128",
        "rollout.n_samples_per_prompt=16", "algorithm.kl_loss_coef=0.05",
        "algorithm.entropy_coef=0.01",
        "reward.label_map={first_word: {type: function, function: \"mmrlhf.testing.rewards:partial_length_reward\"}}",
        "rollout.micro_rollout_batch_size=16", "trainer.micro_train_batch_size=16", *OFFLOAD])
    trainer = build_trainer(config, world=dist)
    source = trainer.p.source
    rank, world = (dist.rank, dist.world_size) if dist else (0, 1)

    rollout = None
    if rank == 0:
        records = source.stream.next_batch(config.trainer.rollout_batch_size)
        rollout = source.maker.generate_rollout(**record_columns(records))
    if dist is not None:
        rollout = dist.broadcast_object(rollout)
    groups = rollout.group_ids.tolist()

    stepper = trainer.p.policy.stepper
    original_step = stepper.step
    shuffle = trainer.p.shuffle.get_state()
    for case in cases:
        control, steps = case["control"] == "per-rank-norm", case is cases[-1]
        share = rollout.select([i for i, g in enumerate(groups) if g % world == rank and g != case["drop_group"]])
        captured: dict[str, torch.Tensor] = {}
        recorded: dict[str, float] = {}

        def recording_step(loss_finite: bool):
            for name, p in trainer.p.policy.actor.named_parameters():
                if p.grad is not None:
                    captured[f"grad.{name}"] = full(p.grad).detach().clone()
            if steps:
                return original_step(loss_finite)
            # only its gradients count: the norm as the step takes it (before clipping; an infinite bound leaves
            # the gradients as they are), then no step, so the next case starts from the built weights
            norm = torch.nn.utils.clip_grad_norm_(stepper.params, float("inf"))
            recorded["policy/grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            stepper.optimizer.zero_grad(set_to_none=True)
            return float("nan"), False

        stepper.step = recording_step
        trainer.p.shuffle.set_state(shuffle)  # each case draws the same mini-batch order
        if control:  # single-number sums are the loss denominators (and the finite flags)
            all_sum = dist.all_sum
            object.__setattr__(dist, "all_sum", lambda v: [x * world for x in v] if len(v) == 1 else all_sum(v))
        try:
            metrics = trainer.train_on(source.prepare(share, dict(share.metrics)))
        finally:
            if control:  # the next case sums over the ranks again
                object.__delattr__(dist, "all_sum")
        params = {f"param.{n}": full(p.detach()).clone() for n, p in trainer.p.policy.actor.named_parameters()
                  if p.requires_grad}
        if rank == 0:
            out = case["out"]
            torch.save({**captured, **params}, out / "tensors.pt")
            keep = {k: float(v) for k, v in metrics.items() if k.startswith(("policy/", "engine_logprob_diff/"))}
            keep.update(recorded)
            keep["samples_per_rank"] = float(len(share))
            keep["valid_rewards"] = float(rollout.rewards.valid.sum())
            keep["rewards_sum"] = float(rollout.rewards.rewards[rollout.rewards.valid].sum())
            keep.update(host_bytes(trainer))
            (out / "metrics.json").write_text(json.dumps(keep))
    stepper.step = original_step
    source.engine.close()


if __name__ == "__main__":
    main()
