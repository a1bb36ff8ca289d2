"""Keys changed on --resume: refused ones are named before anything loads; the learning rate and the KL
controller's settings are written into the restored state (the record then tells the truth); pure diffing."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.trainer.builder import build_trainer
from mmrlhf.trainer.resume_changes import KERNEL_KEYS, Change, check_changes, config_changes
from trainer_helpers import metrics_rows, toy_config


def test_changes_are_found_and_refused_keys_named():
    saved = {"model": {"dtype": "float32", "lora": {"rank": 0}}, "trainer": {"lr": 1e-3, "max_steps": 3},
             "data": {"generator_options": {"task": "colour"}}}
    new = {"model": {"dtype": "bfloat16", "lora": {"rank": 8}}, "trainer": {"lr": 5e-4, "max_steps": 3},
           "data": {"generator_options": {"task": "count"}}}
    assert [c.key for c in config_changes(saved, new)] == [
        "data.generator_options.task", "model.dtype", "model.lora.rank", "trainer.lr"]
    with pytest.raises(ValueError) as err:
        check_changes(saved, new, "ckpt")
    text = str(err.value)
    assert "model.dtype: 'float32' -> 'bfloat16'" in text and "model.lora.rank" in text
    assert "data.generator_options.task" in text and "trainer.lr" not in text
    assert check_changes(saved, {**saved, "trainer": {"lr": 5e-4, "max_steps": 9}}, "ckpt") == [
        Change("trainer.lr", 1e-3, 5e-4), Change("trainer.max_steps", 3, 9)]


def test_a_key_added_after_the_checkpoint_counts_as_its_default():
    """A checkpoint written before a key existed (here model.teacher, under the refused ``model.`` section) resumes
    when the new config leaves the key at its default, and is refused when it sets it."""
    from mmrlhf.config import build_config

    new = build_config({"model": {"pretrain": "/models/policy"}}).model_dump(mode="json")
    saved = {**new, "model": {k: v for k, v in new["model"].items() if k != "teacher"}}
    assert check_changes(saved, new, "ckpt") == []
    assert [c.key for c in config_changes(saved, new)] == ["model.teacher"]  # without the defaults: a change
    teacher = {**new, "model": {**new["model"], "teacher": "/models/teacher"}}
    with pytest.raises(ValueError, match=r"model\.teacher: '' -> '/models/teacher'"):
        check_changes(saved, teacher, "ckpt")


# a value other than the default for every key of KERNEL_KEYS (each runs on the CPU: vllm_lora only matters with LoRA)
KERNEL_CHANGES = {"model.attn_implementation": "eager", "model.masked_attention": "dense",
                  "model.linear_attention_kernel": "torch", "model.lora.sync": "vllm_lora"}


def _with(tree: dict, key: str, value) -> dict:
    """``tree`` (a config dump) with dotted ``key`` set to ``value``."""
    import copy

    out = copy.deepcopy(tree)
    *path, last = key.split(".")
    node = out
    for part in path:
        node = node[part]
    node[last] = value
    return out


def test_each_kernel_key_may_change_on_resume_and_a_key_of_the_saved_state_may_not():
    """A kernel choice (how the saved weights compute) resumes, each on its own; the policy's path and the adapter's
    rank are still refused by name, also when they come with a kernel change."""
    from mmrlhf.config import build_config

    assert set(KERNEL_CHANGES) == set(KERNEL_KEYS)
    saved = build_config({"model": {"pretrain": "/models/policy"}}).model_dump(mode="json")
    for key, value in KERNEL_CHANGES.items():
        new = _with(saved, key, value)
        changes = check_changes(saved, new, "ckpt")
        assert [c.key for c in changes] == [key]
        assert KERNEL_KEYS[key] in changes[0].line()
    kernels = saved
    for key, value in KERNEL_CHANGES.items():
        kernels = _with(kernels, key, value)
    assert [c.key for c in check_changes(saved, kernels, "ckpt")] == sorted(KERNEL_CHANGES)
    for key, value in (("model.pretrain", "/models/other"), ("model.lora.rank", 8), ("model.lora.dropout", 0.1),
                       ("model.lora.base_dtype", "bfloat16"), ("model.dtype", "float32")):
        with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}: .*this policy") as err:
            check_changes(saved, _with(kernels, key, value), "ckpt")
        assert "attn_implementation" not in str(err.value)  # the kernel keys are not among the refused


def _lrs(trainer):
    return [g["lr"] for g in trainer.p.policy.stepper.optimizer.param_groups]


@pytest.mark.slow
def test_resume_applies_a_new_learning_rate_and_kl_target_takes_new_kernels_and_refuses_a_new_dtype(tmp_path, capsys):
    algo = {"kl_reward_coef": 0.05, "kl_controller": "adaptive", "kl_target": 6.0}
    base = dict(trainer={"max_steps": 2, "save_steps": 2, "lr": 1e-3, "lr_scheduler": "cosine"}, algorithm=algo)
    first = build_trainer(toy_config(tmp_path / "run", **base))
    with first.p.tracker:
        first.fit()
    lr_factor = _lrs(first)[0] / 1e-3

    # control: the same keys resume with the restored values
    same = build_trainer(toy_config(tmp_path / "run", trainer={**base["trainer"], "max_steps": 3}, algorithm=algo),
                         resume=True)
    assert _lrs(same)[0] == pytest.approx(1e-3 * lr_factor)

    changed = build_trainer(toy_config(tmp_path / "run", trainer={**base["trainer"], "max_steps": 3, "lr": 2e-4},
                                       algorithm={**algo, "kl_target": 3.0}), resume=True)
    assert _lrs(changed)[0] == pytest.approx(2e-4 * lr_factor)  # the schedule continues, from the new base
    assert changed.p.policy.stepper.scheduler.base_lrs == [2e-4] * len(_lrs(changed))
    assert changed.p.source.maker.kl_controller.target == 3.0
    err = capsys.readouterr().err
    assert "resume: trainer.lr: 0.001 -> 0.0002" in err and "resume: algorithm.kl_target: 6.0 -> 3.0" in err
    assert changed.s.config["trainer"]["lr"] == 2e-4  # what the next checkpoint records

    with pytest.raises(ValueError, match=r"model.dtype: 'float32' -> 'bfloat16'.*this policy"):
        build_trainer(toy_config(tmp_path / "run", model={"dtype": "bfloat16"}, trainer=base["trainer"],
                                 algorithm=algo), resume=True)

    # every kernel key changed at once: accepted, the state is the checkpoint's (as the unchanged resume has it), and
    # the run goes on from there
    capsys.readouterr()
    model = toy_config(tmp_path / "run").model.model_dump(mode="json")
    model.update(attn_implementation="eager", masked_attention="dense", linear_attention_kernel="torch",
                 lora={**model["lora"], "sync": "vllm_lora"})
    kernels = build_trainer(toy_config(tmp_path / "run", model=model, trainer={**base["trainer"], "max_steps": 3},
                                       algorithm=algo), resume=True)
    err = capsys.readouterr().err
    for key, value in KERNEL_CHANGES.items():
        assert f"resume: {key}: " in err and f"-> {value!r} ({KERNEL_KEYS[key]})" in err
    assert kernels.state.step == same.state.step == 2
    assert kernels.p.policy.actor.model.config._attn_implementation == "eager"
    weights, control = kernels.p.policy.actor.state_dict(), same.p.policy.actor.state_dict()
    assert weights.keys() == control.keys() and all(torch.equal(weights[k], control[k]) for k in weights)
    restored = list(kernels.p.policy.stepper.optimizer.state.values())
    assert restored and all(torch.equal(a[k], b[k]) for a, b in
                            zip(restored, same.p.policy.stepper.optimizer.state.values()) for k in a)
    assert all(float(s["step"]) > 0 for s in restored)  # the checkpoint's optimiser state, not a fresh one
    assert kernels.p.source.stream.state_dict() == same.p.source.stream.state_dict()
    with kernels.p.tracker:
        kernels.fit()
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2, 3]
    assert kernels.s.config["model"]["attn_implementation"] == "eager"  # what the next checkpoint records
