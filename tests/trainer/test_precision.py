"""The precision rule (``model.dtype`` = compute dtype over float32 master weights) and what ``rollout_correction:
auto`` resolves to for each engine / trainer / device combination."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.config import build_config, load_config
from mmrlhf.config.algorithm import AlgorithmConfig
from mmrlhf.config.loader import ConfigError
from mmrlhf.trainer.builder import resolve_rollout_correction

TOY = "examples/grpo_toy_shapes_cpu.yaml"

# engine, engine dtype, trainer (compute) dtype, trainer device -> what ``auto`` must pick
CORRECTION_TABLE = [
    ("vllm", "bfloat16", "bfloat16", "cuda:0", "tis"),  # GPU defaults: same dtype, different kernels
    ("vllm", "float32", "float32", "cuda", "tis"),  # vLLM's CUDA kernels are not transformers' even in float32
    ("vllm", "bfloat16", "float32", "cuda", "tis"),
    ("vllm", "float32", "bfloat16", "cuda", "tis"),
    ("vllm", "float32", "float32", "cpu", "none"),  # measured: agree to ~1e-6
    ("vllm", "bfloat16", "float32", "cpu", "tis"),  # measured: <= 0.0045 apart
    ("vllm", "float32", "bfloat16", "cpu", "tis"),
    ("vllm", "bfloat16", "bfloat16", "cpu", "tis"),  # not measured to agree: correct
    ("transformers", "bfloat16", "bfloat16", "cuda", "none"),  # the engine is the actor's own module
    ("transformers", "float32", "float32", "cpu", "none"),
]


@pytest.mark.parametrize("engine, engine_dtype, train_dtype, device, expected", CORRECTION_TABLE)
def test_auto_rollout_correction_by_engine_and_device(engine, engine_dtype, train_dtype, device, expected):
    """``auto`` corrects whenever engine and trainer run different kernels; the device is passed in, not read from
    this machine. (Before: bf16 vLLM + bf16 trainer on a GPU resolved to ``none``.)"""
    algo = AlgorithmConfig()
    assert algo.rollout_correction == "auto"
    got = resolve_rollout_correction(algo, engine=engine, engine_dtype=engine_dtype, train_dtype=train_dtype,
                                     device=torch.device(device))
    assert got == expected


@pytest.mark.parametrize("explicit", ["none", "tis", "mis"])
def test_explicit_rollout_correction_is_kept(explicit):
    algo = AlgorithmConfig(rollout_correction=explicit)
    for engine, edt, tdt, dev, _ in CORRECTION_TABLE:
        assert resolve_rollout_correction(algo, engine=engine, engine_dtype=edt, train_dtype=tdt,
                                          device=dev) == explicit


def test_precision_rule():
    from mmrlhf.models.precision import precision

    bf16 = precision("bfloat16")
    assert (bf16.compute, bf16.master, bf16.frozen) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert bf16.autocast_dtype == torch.bfloat16
    fp32 = precision("float32")
    assert (fp32.compute, fp32.master, fp32.frozen, fp32.autocast_dtype) == (torch.float32,) * 3 + (None,)


def test_float16_and_contradicting_mixed_precision_are_refused_by_key():
    with pytest.raises(ConfigError, match=r"model.dtype=float16.*gradient scaler.*model.dtype=bfloat16"):
        load_config(TOY, ["model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"distributed.mixed_precision=bf16 contradicts model.dtype=float32"):
        load_config(TOY, ["distributed.mixed_precision=bf16"])
    with pytest.raises(ConfigError, match=r"distributed.mixed_precision=none contradicts model.dtype=bfloat16"):
        load_config(TOY, ["model.dtype=bfloat16", "distributed.mixed_precision=none"])
    assert load_config(TOY, ["model.dtype=bfloat16", "distributed.mixed_precision=bf16"]).model.dtype == "bfloat16"
    assert build_config({}).distributed.mixed_precision == "auto"


def test_fsdp_policy_follows_model_dtype():
    from mmrlhf.models.sharding import mixed_precision_policy

    assert mixed_precision_policy("float32") is None
    bf16 = mixed_precision_policy("bfloat16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32


# ---- bf16 compute over float32 master weights, end to end ------------------------------------------------------


def _train_and_load(out, dtype: str, steps: int):
    """``steps`` GRPO steps of the toy task through the real (float32, CPU) vLLM engine at lr 1e-6; the saved
    model's weights."""
    from mmrlhf.testing.updates import load_weights
    from mmrlhf.trainer.builder import build_trainer
    from trainer_helpers import toy_config

    cfg = toy_config(out, engine="vllm", model={"dtype": dtype},
                     reward={"label_map": {"parity": {"type": "function",
                                                      "function": "trainer_helpers:parity_reward"}},
                             "default_recipe": [["parity", 1.0]]},
                     trainer={"lr": 1e-6, "max_steps": steps, "save_steps": steps})
    trainer = build_trainer(cfg)
    try:
        with trainer.p.tracker:
            trainer.fit()
        folder = trainer.p.checkpoints.latest() / "model"
    finally:
        trainer.p.source.maker.engine.close()
    return load_weights(folder)


# ||du_bf16 - du_fp32|| / ||du_fp32||, scale-free. bf16 matmuls carry ~2^-8 relative error; Adam's first steps move
# each weight by about lr * g / |g|, so a weight whose gradient is within that error of 0 may step the other way.
# Measured on this run (3 steps, CPU): rel_error 0.034, cosine 0.9994, 69.20% of the weights moved in both runs;
# the control (no master weights): 1.43% moved, rel_error 0.992. The bound leaves room for other CPUs' kernels.
UPDATE_REL_TOLERANCE = 0.25


@pytest.mark.slow
@pytest.mark.vllm
def test_bf16_compute_trains_like_float32(tmp_path, monkeypatch):
    """model.dtype=bfloat16 at lr 1e-6 moves (nearly) every weight the float32 run moves, by the same update within
    the bf16 compute tolerance. Control: the rule before (parameters stored in bf16, AdamW stepping them) fails
    both: its updates round away."""
    pytest.importorskip("vllm")
    import mmrlhf.experience.builder as experience_builder
    from mmrlhf.models.precision import Precision
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.testing.updates import load_weights, moved_fraction, update_agreement

    steps = 3
    initial = load_weights(tiny_model_dir("qwen2_vl"))
    fp32 = _train_and_load(tmp_path / "fp32", "float32", steps)
    bf16 = _train_and_load(tmp_path / "bf16", "bfloat16", steps)
    moved_fp32, moved_bf16 = moved_fraction(initial, fp32), moved_fraction(initial, bf16)
    agree = update_agreement(initial, bf16, fp32)
    print(f"moved: float32 {moved_fp32:.4%}, bf16 compute {moved_bf16:.4%}; bf16 vs float32 update: {agree}")
    assert moved_fp32 > 0.3, moved_fp32  # the float32 run trains: the comparison is not vacuous
    assert moved_bf16 >= 0.9 * moved_fp32, (moved_bf16, moved_fp32)
    assert agree["rel_error"] < UPDATE_REL_TOLERANCE, agree

    def bf16_parameters(dtype):  # the rule before: no float32 master copy
        return Precision(compute=torch.bfloat16, master=torch.bfloat16, frozen=torch.bfloat16)

    monkeypatch.setattr(experience_builder, "precision", bf16_parameters)
    old = _train_and_load(tmp_path / "old", "bfloat16", steps)
    moved_old, agree_old = moved_fraction(initial, old), update_agreement(initial, old, fp32)
    print(f"control (bf16 parameters): moved {moved_old:.4%}; update vs float32: {agree_old}")
    assert moved_old < 0.9 * moved_fp32
    assert agree_old["rel_error"] >= UPDATE_REL_TOLERANCE
