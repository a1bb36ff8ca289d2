"""What ``--resume`` does with keys changed since the checkpoint was written.

A restored optimiser, scheduler or KL controller carries the OLD values of some keys (the learning rate in the
optimiser's groups, the controller's target), while ``config.yaml`` and the next checkpoint would record the new
ones: a silent drift. So on resume the saved config is compared with the new one, key by key:

- **refused** (:data:`REFUSED`): keys that change what the saved state means (the model, the data order, the
  critic's presence, the running statistics kept): an error names every such key and the way out; the ``model.``
  keys of :data:`KERNEL_KEYS` are not among them (how the same weights compute, not which);
- **applied** (:data:`APPLIED`): keys whose value lives in restored state; the builder writes the new value into
  that state (:func:`apply_changes`);
- everything else is read afresh from the config at every step anyway.

Every changed key is reported on one line, so the record (``config.yaml``, the next checkpoint) is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping

STREAM_REASON = ("the saved position in the prompt stream belongs to the old data; "
                 "data.restart_stream_on_resume=true starts the stream over on the new data")
STREAM_KEYS = ("data.prompt_data", "data.generator", "data.generator_options", "data.shuffle")

# prefix -> why it cannot change across a resume (a prefix ends with "." for a whole section)
REFUSED: dict[str, str] = {
    "model.": "the checkpoint holds this policy; start a new run from CHECKPOINT/model with model.pretrain instead",
    **{key: STREAM_REASON for key in STREAM_KEYS},
    "trainer.seed": "the data order and the saved RNG states follow the old seed",
    "trainer.output_dir": "a resume continues the run in its own folder",
    "algorithm.advantage_estimator": "the critic and its optimiser exist only for gae",
    "algorithm.kl_controller": "the saved KL controller is of the other kind",
    "algorithm.reward_normalization": "the running reward statistics would be dropped or made up",
}

# ``model.`` keys that choose how the saved weights compute, never which weights, in what precision, or what the
# checkpoint holds (a checkpoint is the same whatever their values): each choice computes the same function to
# rounding (docs/training.md, docs/models.md), so a run started on a CPU or with sdpa resumes on a GPU with flash
# attention. ``trainer.gradient_checkpointing`` (recompute in the backward) is no ``model.`` key: never refused.
# Kept out, refused with the section: the precision (model.dtype, model.lora.base_dtype: the values computed change,
# and the reference is stored in it), the paths (pretrain, reference, teacher, critic, lora.adapter), the family,
# trust_remote_code (another module may be built, whose names the saved weights may not match), and every adapter
# setting (lora.rank / alpha / target_modules / vision: the saved adapter has its shape; dropout changes what trains).
KERNEL_KEYS: dict[str, str] = {
    "model.attn_implementation": "the attention kernel (the same attention, another implementation)",
    "model.masked_attention": "how packed and shared-prompt rows are masked (the same values)",
    "model.linear_attention_kernel": "how the Gated DeltaNet layers run a batch (the same values)",
    "model.lora.sync": "how the engine receives the adapter (merged weights or vLLM's LoRA; the same policy)",
}

# keys whose value the restored state holds, and what applying them means
APPLIED: dict[str, str] = {
    "trainer.lr": "the policy optimiser's base learning rate (the schedule continues from its step)",
    "trainer.critic_lr": "the critic optimiser's base learning rate",
    "algorithm.kl_target": "the adaptive KL controller's target",
    "algorithm.kl_horizon": "the adaptive KL controller's horizon",
    "algorithm.kl_reward_coef": "the fixed KL controller's coefficient (an adaptive one keeps its running value)",
}


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def line(self) -> str:
        what = APPLIED.get(self.key) or KERNEL_KEYS.get(self.key) or "read from the new config"
        return f"resume: {self.key}: {self.old!r} -> {self.new!r} ({what})"


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any],
                   defaults: Mapping[str, Any] | None = None) -> list[Change]:
    """Every dotted key whose value differs between two ``model_dump(mode="json")`` trees, sorted. A key the saved
    tree lacks (added to the schema after the checkpoint was written) had its ``defaults`` value then: it changed
    only if the new config sets it otherwise."""
    a, b = dict(_flatten(saved)), dict(_flatten(new))
    d = dict(_flatten(defaults)) if defaults else {}
    old = {k: a[k] if k in a else d.get(k) for k in set(a) | set(b)}
    return [Change(k, old[k], b.get(k)) for k in sorted(old) if old[k] != b.get(k)]


def schema_defaults() -> dict[str, Any]:
    """The config tree of every key at its default (unvalidated: defaults only)."""
    from mmrlhf.config.schema import MMRLHFConfig

    return MMRLHFConfig.model_construct().model_dump(mode="json")


def refused(changes: list[Change]) -> list[tuple[Change, str]]:
    """The changes a resume cannot honour, each with its reason."""
    out = []
    for change in changes:
        if change.key in KERNEL_KEYS:
            continue
        reason = next((why for prefix, why in REFUSED.items()
                       if change.key == prefix or (prefix.endswith(".") and change.key.startswith(prefix))
                       or change.key.startswith(prefix + ".")), None)
        if reason is not None:
            out.append((change, reason))
    return out


def check_changes(saved: Mapping[str, Any], new: Mapping[str, Any], checkpoint: str) -> list[Change]:
    """The changed keys; raises ``ValueError`` naming every refused one (before any model is loaded)."""
    changes = config_changes(saved, new, schema_defaults())
    bad = refused(changes)
    if new.get("data", {}).get("restart_stream_on_resume"):  # the stream starts over: its data may change
        bad = [(c, why) for c, why in bad if not c.key.startswith(STREAM_KEYS)]
    if bad:
        lines = "\n".join(f"  {c.key}: {c.old!r} -> {c.new!r} ({why})" for c, why in bad)
        raise ValueError(f"--resume from {checkpoint}: these keys differ from the run's and cannot change across a "
                         f"resume:\n{lines}\nset them back, or start a new run")
    return changes


def set_base_lr(stepper: Any, lr: float) -> None:
    """Give a restored optimiser (and its LambdaLR schedule) a new base learning rate; the current factor of the
    schedule is kept, so the LR the next step uses is ``lr * factor(step)``."""
    sched = stepper.scheduler
    for i, group in enumerate(stepper.optimizer.param_groups):
        base = sched.base_lrs[i] if sched is not None else group["lr"]
        factor = group["lr"] / base if base else 1.0
        group["initial_lr"] = lr
        group["lr"] = lr * factor
    if sched is not None:
        sched.base_lrs = [lr] * len(stepper.optimizer.param_groups)
        sched._last_lr = [g["lr"] for g in stepper.optimizer.param_groups]  # what get_last_lr() reports


def apply_changes(changes: list[Change], *, policy_stepper: Any, critic_stepper: Any = None,
                  kl_controller: Any = None) -> list[str]:
    """Write the :data:`APPLIED` keys' new values into the restored state; returns one line per changed key."""
    for c in changes:
        if c.key == "trainer.lr":
            set_base_lr(policy_stepper, float(c.new))
        elif c.key == "trainer.critic_lr" and critic_stepper is not None:
            set_base_lr(critic_stepper, float(c.new))
        elif c.key == "algorithm.kl_target" and hasattr(kl_controller, "target"):
            kl_controller.target = float(c.new)
        elif c.key == "algorithm.kl_horizon" and hasattr(kl_controller, "horizon"):
            kl_controller.horizon = int(c.new)
        elif c.key == "algorithm.kl_reward_coef" and kl_controller is not None and not hasattr(kl_controller,
                                                                                               "target"):
            kl_controller.value = float(c.new)
    return [c.line() for c in changes]
