"""The memory plan's accounting per launch mode and phase, its verdict and fixes (``mmrlhf.models.memory``)."""

from __future__ import annotations

import json

import pytest

from mmrlhf.config import build_config, load_config
from mmrlhf.models.memory.advice import memory_plan, to_json
from mmrlhf.models.memory.inputs import PlanError, checkpointing, facts_of, plan_inputs, token_budget
from mmrlhf.models.memory import activations as act
from mmrlhf.models.memory.activations import numerics
from mmrlhf.models.memory.plan import GIB, plan_launch

RECIPE_7B = "examples/grpo_geometry3k_qwen2_5_vl_7b.yaml"


def _config(overrides=(), path=RECIPE_7B):
    return load_config(path, list(overrides))


def _plan(overrides=(), shape="qwen2_5_vl_7b", gpu=80.0):
    cfg = _config(overrides)
    facts = facts_of(cfg, shape)
    return facts, plan_inputs(cfg, facts, gpu_gib=gpu)


def test_torchrun_divides_the_sharded_states_by_the_ranks_and_nothing_else():
    facts, p = _plan(["algorithm.kl_loss_coef=0.01"])
    one = plan_launch(facts, p, "single").gpus[0].phases
    for n in (2, 4, 8):
        rank = plan_launch(facts, p, "torchrun", n).gpus[0].phases
        for name in ("actor weights (float32)", "actor AdamW moments (float32)"):
            assert rank["generate"][name] == one["generate"][name] // n
        assert rank["update"]["actor gradients (float32)"] == one["update"]["actor gradients (float32)"] // n
        assert rank["step"]["AdamW step temporaries"] == one["step"]["AdamW step temporaries"] // n
        # not sharded: the reference (every rank keeps a whole one) and the engine's share
        assert rank["generate"]["reference (model.dtype)"] == one["generate"]["reference (model.dtype)"]
        assert rank["generate"]["engine (vLLM, awake)"] == one["generate"]["engine (vLLM, awake)"]
        assert "FSDP gathered parameters" in rank["update"] and "FSDP gathered parameters" not in one["update"]
    # FSDP2's mixed precision: no bf16 weight copies under torchrun; the compute copy (trainer.compute_copy: auto)
    # in one process
    sharded = plan_launch(facts, p, "torchrun", 4).gpus[0].phases["update"]
    assert "compute copy (bf16 Linears)" in one["update"]
    assert not {"compute copy (bf16 Linears)", "autocast weight copies"} & set(sharded)


def test_the_compute_copy_holds_every_linear_weight_where_autocast_held_those_on_the_backwards_path():
    facts, p = _plan()
    d, c = facts.decoder, facts.counts
    on = plan_launch(facts, p, "single").gpus[0].phases["update"]
    assert p.compute_copy and on["compute copy (bf16 Linears)"] == 2 * (
        c.linear_weights + d.vocab * d.hidden + c.merger_linear_weights + c.tower_linear_weights)
    facts, p = _plan(["trainer.compute_copy=false"])
    off = plan_launch(facts, p, "single").gpus[0].phases["update"]
    # autocast saves no copy of the frozen tower (no backward runs through it): the copy holds that much more
    assert off["autocast weight copies"] == on["compute copy (bf16 Linears)"] - 2 * c.tower_linear_weights
    # auto is off with checkpointing; forced on, the recomputed layer casts nothing and the copy stays whole
    facts, p = _plan(["trainer.gradient_checkpointing=true"])
    assert not p.compute_copy
    ckpt = plan_launch(facts, p, "single").gpus[0].phases["update"]
    facts, p = _plan(["trainer.gradient_checkpointing=true", "trainer.compute_copy=true"])
    forced = plan_launch(facts, p, "single").gpus[0].phases["update"]
    assert forced["compute copy (bf16 Linears)"] == on["compute copy (bf16 Linears)"]
    assert ckpt["recomputed layer"] - forced["recomputed layer"] == 2 * c.linear_weights // d.layers


def test_the_trainer_keeps_16_bytes_per_trained_parameter_and_4_per_frozen_one():
    facts, p = _plan()
    c, update = facts.counts, plan_launch(facts, p, "single").gpus[0].phases["update"]
    assert update["actor weights (float32)"] == 4 * c.total  # the frozen tower is float32 too
    assert update["actor gradients (float32)"] + update["actor AdamW moments (float32)"] == 12 * c.trainable
    assert c.frozen == c.vision_tower  # trainer.freeze_vision_tower (default): the merger trains


def test_ray_puts_the_engine_and_scoring_copies_on_rollout_gpus_and_states_on_trainer_gpus():
    facts, p = _plan(["distributed.backend=ray", "distributed.num_trainer_actors=4", "rollout.enable_sleep=false"])
    rollout, trainer = plan_launch(facts, p).gpus
    assert "engine (vLLM, awake)" in rollout.phases["generate"]
    assert rollout.phases["generate"]["policy scoring copy (float32)"] == 4 * facts.counts.total
    assert all("engine" not in name for parts in trainer.phases.values() for name in parts)
    assert trainer.count == 4
    assert trainer.phases["update"]["actor weights (float32)"] == 4 * facts.counts.total // 4


def test_sleep_frees_the_engine_between_generation_and_sync():
    facts, p = _plan(["rollout.enable_sleep=true"])
    asleep = plan_launch(facts, p, "single").gpus[0].phases
    facts, p = _plan(["rollout.enable_sleep=false"])
    awake = plan_launch(facts, p, "single").gpus[0].phases
    share = awake["update"]["engine (vLLM, awake)"]
    assert share == int(0.35 * 80 * GIB)
    assert all(not name.startswith("engine") for name in asleep["update"])
    assert asleep["sync"]["engine weights (woken for the sync)"] == 2 * facts.counts.total  # bf16 weights only
    assert asleep["generate"]["engine (vLLM, awake)"] == share


def test_reference_only_with_a_kl_term_and_not_with_lora_and_critic_only_for_gae():
    def parts(overrides):
        facts, p = _plan(overrides)
        return plan_launch(facts, p, "single").gpus[0].phases

    assert "reference (model.dtype)" not in parts([])["generate"]
    with_kl = parts(["algorithm.kl_loss_coef=0.01"])["generate"]
    assert with_kl["reference (model.dtype)"] == 2 * facts_of(_config(), "qwen2_5_vl_7b").counts.total
    assert "reference (model.dtype)" not in parts(["algorithm.kl_loss_coef=0.01", "model.lora.rank=16"])["generate"]
    gae = parts(["algorithm.advantage_estimator=gae"])
    assert "critic" in gae and "critic weights (float32)" in gae["generate"]
    assert "critic" not in parts([])


def test_a_7b_full_finetune_does_not_fit_one_80_gib_gpu_and_the_suggested_keys_fix_it():
    cfg = _config()
    plan = memory_plan(cfg, shape="qwen2_5_vl_7b", gpu_gib=80)
    assert not plan.launch.fits
    text = plan.verdict
    assert text.startswith("does not fit") and "80 GiB" in text
    assert plan.fixes and any("model.lora.rank" in f.label for f in plan.fixes)
    assert any("torchrun over 4 GPUs" in f.label for f in plan.fixes)
    for fix in plan.fixes:  # every suggestion, applied, gives a plan that fits
        fixed_cfg = load_config(RECIPE_7B, fix.overrides)
        fixed = memory_plan(fixed_cfg, shape="qwen2_5_vl_7b", gpu_gib=80, ranks=None, suggest=False)
        launch = plan_launch(fixed.facts, fixed.inputs, "torchrun", int(fix.launch.split()[2])) if fix.launch \
            else fixed.launch
        assert launch.fits, fix.label
        assert launch.peak == fix.peak
    # control: the same run on a 2B shape fits as it is, with nothing to suggest
    small = memory_plan(cfg, shape="qwen2_vl_2b", gpu_gib=80)
    assert small.launch.fits and small.verdict.startswith("fits") and not small.fixes


def test_an_engine_share_too_small_for_its_weights_is_named():
    cfg = _config(["rollout.gpu_memory_utilization=0.1"])
    plan = memory_plan(cfg, shape="qwen2_5_vl_7b", gpu_gib=80, suggest=False)
    assert any(p.startswith("vLLM cannot start") and "rollout.gpu_memory_utilization" in p
               for p in plan.launch.problems)


def test_checkpointing_and_the_token_budget_are_read_in_one_place():
    cfg = _config()
    assert checkpointing(cfg) is False and token_budget(cfg) is None
    on = _config(["trainer.gradient_checkpointing=true"])
    assert checkpointing(on) is True
    facts = facts_of(cfg, "qwen2_5_vl_7b")
    off_update = plan_launch(facts, plan_inputs(cfg, facts, gpu_gib=80), "single").gpus[0].phases["update"]
    on_update = plan_launch(facts, plan_inputs(on, facts, gpu_gib=80), "single").gpus[0].phases["update"]
    assert on_update["activations (saved)"] < off_update["activations (saved)"] / 10
    # auto's budget is the count split's costliest micro-batch: the plan's micro-batch is the count's
    assert token_budget(_config(["trainer.max_tokens_per_micro_batch=auto"])) is None
    # a fixed budget sizes the micro-batch by tokens
    fixed = ["trainer.shared_prompt=false", "trainer.packing_samples=false", "trainer.max_tokens_per_micro_batch=8192"]
    budget = plan_inputs(_config(fixed), facts, gpu_gib=80)
    assert budget.train.rows == 8192 // 2048 and budget.train.tokens == 8192


def test_missing_model_is_an_error_naming_the_key(tmp_path):
    cfg = build_config({})
    with pytest.raises(PlanError, match=r"model\.pretrain.*--shape"):
        memory_plan(cfg)
    cfg = build_config({"model": {"pretrain": str(tmp_path)}})
    with pytest.raises(PlanError, match=r"model\.pretrain=.*no config\.json"):
        memory_plan(cfg)
    with pytest.raises(ValueError, match="unknown model shape"):
        memory_plan(cfg, shape="qwen9")


def test_json_round_trips_and_agrees_with_the_tables():
    plan = memory_plan(_config(), shape="qwen2_5_vl_7b", gpu_gib=80)
    data = to_json(plan)
    back = json.loads(json.dumps(data))
    assert back == data
    gpu = back["launch"]["gpus"][0]
    assert gpu["peak_bytes"] == max(sum(parts.values()) for parts in gpu["phases"].values())
    assert back["fits"] is False and back["fixes"] and back["parameters"]["total"] == plan.facts.counts.total


def test_a_lora_base_in_bf16_halves_the_frozen_linears_and_leaves_only_the_adapters_to_copy():
    facts, p = _plan(["model.lora.rank=64"])  # base_dtype auto: bf16 on the planned GPU
    c = facts.counts
    assert p.lora_base_bytes == 2 and 0 < c.frozen_linear < c.frozen
    update = plan_launch(facts, p, "single").gpus[0].phases["update"]
    assert update["actor weights (float32, frozen Linears bf16)"] == 4 * (c.total + c.lora) - 2 * c.frozen_linear
    assert update["compute copy (bf16 Linears)"] == 2 * c.lora
    facts32, p32 = _plan(["model.lora.rank=64", "model.lora.base_dtype=float32"])
    update32 = plan_launch(facts32, p32, "single").gpus[0].phases["update"]
    assert update32["actor weights (float32)"] == 4 * (c.total + c.lora)
    assert plan_launch(facts, p, "single").gpus[0].peak < plan_launch(facts32, p32, "single").gpus[0].peak - 15 * GIB


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_the_planned_frozen_linears_are_what_the_trainer_stores_in_bf16(family):
    """The plan's count (a meta model under the LoRA rule) against ``store_frozen_linears`` on the real model."""
    import torch

    from mmrlhf.config.model import LoraConfig
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.lora import apply_lora
    from mmrlhf.models.precision import store_frozen_linears
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = str(tiny_model_dir(family))
    cfg = build_config({"model": {"pretrain": path, "lora": {"rank": 4, "vision": "merger"}}})
    facts = facts_of(cfg)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32)
    from mmrlhf.trainer.optim import freeze_vision

    freeze_vision(actor.model, actor.adapter, tower=True, merger=False)
    apply_lora(actor, LoraConfig(rank=4, vision="merger"))
    assert store_frozen_linears(actor, torch.bfloat16) == facts.counts.frozen_linear


def test_offload_moves_the_trained_states_to_host_memory_and_fits_a_7b_full_finetune_on_one_80_gib_gpu():
    """``distributed.offload=params``: the actor's weights, gradients, moments and step temporaries leave the GPU
    for host memory (per process: divided by the ranks), FSDP2's gathered units and reduction come in even on one
    GPU, and a 7B full fine-tune then fits one 80 GiB GPU; without it, the plan suggests it."""
    facts, off = _plan(["distributed.offload=params"])
    _, on_gpu = _plan()
    c = facts.counts
    gpu = plan_launch(facts, off, "single").gpus[0]
    states = ("actor weights (float32)", "actor AdamW moments (float32)", "actor gradients (float32)",
              "AdamW step temporaries")
    assert not {n for parts in gpu.phases.values() for n in parts} & set(states)
    assert {"FSDP gathered parameters", "FSDP gradient reduction"} <= set(gpu.phases["update"])
    assert gpu.host == {"actor weights (float32)": 4 * c.total, "actor AdamW moments (float32)": 8 * c.trainable,
                        "actor gradients (float32)": 4 * c.trainable, "AdamW step temporaries": 4 * c.trainable}
    assert gpu.total("step") == 0  # AdamW steps on the CPU
    for n in (2, 4):
        rank = plan_launch(facts, off, "torchrun", n).gpus[0]
        assert rank.host == {k: v // n for k, v in gpu.host.items()}
    # control: the same launch without offload keeps them on the GPU, with nothing on the host
    plain = plan_launch(facts, on_gpu, "single").gpus[0]
    assert set(states) <= set(plain.phases["step"]) and not plain.host
    plan = memory_plan(_config(["distributed.offload=params"]), shape="qwen2_5_vl_7b", gpu_gib=80)
    assert plan.launch.fits and plan.launch.peak < 40 * GIB and "host memory" in plan.verdict
    suggested = memory_plan(_config(), shape="qwen2_5_vl_7b", gpu_gib=80)
    assert any(f.overrides == ["distributed.offload=params"] and not f.launch for f in suggested.fixes)
    critic = plan_launch(*_plan(["distributed.offload=params", "algorithm.advantage_estimator=gae"]), "single")
    assert "critic gradients (float32)" in critic.gpus[0].host
    assert "critic weights (float32)" not in critic.gpus[0].phases["critic"]


def test_a_hybrid_model_caches_kv_for_its_attention_layers_and_a_state_per_sequence():
    from mmrlhf.models.memory.plan import kv_bytes_per_token, recurrent_state_bytes

    facts, p = _plan(shape="qwen3_5_9b")
    d = facts.decoder
    assert kv_bytes_per_token(facts, 2) == 2 * 8 * d.kv_dim * 2  # 8 attention layers of 32
    state = recurrent_state_bytes(facts, 2)
    assert state == 24 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 2  # 25 MiB per running sequence
    assert recurrent_state_bytes(facts_of(_config(), "qwen2_5_vl_7b"), 2) == 0
    layers = dict(act.layer_bytes(facts, numerics(2, 4, sharded=False), p.train))
    assert len(layers) == 2  # attention and linear-attention layers save differently


def test_experts_are_copied_by_autocast_beside_the_compute_copy_and_routing_replay_is_counted():
    facts, p = _plan(["rollout.routing_replay=replay"], shape="qwen3_vl_30b_a3b")
    update = plan_launch(facts, p, "single").gpus[0].phases["update"]
    c, d = facts.counts, facts.decoder
    assert update["compute copy (bf16 Linears)"] == 2 * (
        c.linear_weights + d.vocab * d.hidden + c.merger_linear_weights + c.tower_linear_weights + c.expert_weights)
    assert update["routing replay (engine's experts)"] == p.train.tokens * 48 * 8 * 8
    facts, p = _plan(shape="qwen3_vl_30b_a3b")
    assert "routing replay (engine's experts)" not in plan_launch(facts, p, "single").gpus[0].phases["update"]


def test_a_teacher_is_stored_where_scoring_runs_and_must_be_found():
    distill = "examples/distill_geometry3k_qwen2_5_vl_7b_to_3b.yaml"
    cfg = _config(path=distill)
    plan = memory_plan(cfg, shape="qwen2_5_vl_3b", teacher_shape="qwen2_5_vl_7b", gpu_gib=80, suggest=False)
    teacher = 2 * facts_of(cfg, "qwen2_5_vl_7b").counts.total
    assert plan.inputs.teacher_bytes == teacher
    assert all(parts["teacher (model.dtype)"] == teacher for parts in plan.launch.gpus[0].phases.values())
    ray = plan_launch(plan.facts, plan.inputs, "ray")
    rollout, trainer = ray.gpus
    assert rollout.phases["score"]["teacher (model.dtype)"] == teacher
    assert all("teacher (model.dtype)" not in parts for parts in trainer.phases.values())
    with pytest.raises(PlanError, match="model.teacher=.*--teacher-shape"):
        memory_plan(cfg, shape="qwen2_5_vl_3b", gpu_gib=80)
    off = _config(["algorithm.distill_coef=0", "algorithm.distill_loss_coef=0", "model.teacher="], path=distill)
    assert memory_plan(off, shape="qwen2_5_vl_3b", gpu_gib=80, suggest=False).inputs.teacher_bytes == 0


@pytest.mark.parametrize("sleep", [True, False])
def test_an_in_process_judge_takes_its_share_while_it_judges(sleep):
    judge = ("reward.label_map.judge={type: judge, backend: vllm, model: /judge, sleep: %s, "
             "engine: {gpu_memory_utilization: 0.25}}" % str(sleep).lower())
    facts, p = _plan([judge])
    assert p.judges == ((0.25, sleep),)
    phases = plan_launch(facts, p, "single").gpus[0].phases
    share = int(0.25 * 80 * GIB)
    assert phases["generate"]["judge engine (vLLM)"] == share
    assert ("judge engine (vLLM)" in phases["update"]) == (not sleep)
    _, none = _plan()
    assert none.judges == ()
