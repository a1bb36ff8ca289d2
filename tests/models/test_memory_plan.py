"""The memory plan's accounting per launch mode and phase, its verdict and fixes (``mmrlhf.models.memory``)."""

from __future__ import annotations

import dataclasses
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


def test_torchrun_divides_the_sharded_states_and_the_reference_by_the_ranks_and_not_the_engine_share():
    facts, p = _plan(["algorithm.kl_loss_coef=0.01"])
    one = plan_launch(facts, p, "single").gpus[0].phases
    assert one["generate"]["reference (model.dtype)"] == 2 * facts.counts.total  # whole in one process
    for n in (2, 4, 8):
        rank = plan_launch(facts, p, "torchrun", n).gpus[0].phases
        for name in ("actor weights (float32)", "actor AdamW moments (float32)", "reference (model.dtype)"):
            assert rank["generate"][name] == one["generate"][name] // n, name
        assert rank["update"]["actor gradients (float32)"] == one["update"]["actor gradients (float32)"] // n
        assert rank["step"]["AdamW step temporaries"] == one["step"]["AdamW step temporaries"] // n
        # not sharded: the engine's share of each GPU
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


def test_ray_rollout_gpus_hold_only_the_engine_and_the_sharded_trainers_score():
    facts, p = _plan(["distributed.backend=ray", "distributed.num_trainer_actors=4", "rollout.enable_sleep=false",
                      "algorithm.kl_loss_coef=0.01", "rollout.tensor_parallel_size=2"])
    rollout, trainer = plan_launch(facts, p).gpus
    assert rollout.count == 2 and rollout.phases == {"generate": {"engine (vLLM, awake)": int(0.35 * 80 * GIB)}}
    assert all("engine" not in name for parts in trainer.phases.values() for name in parts)
    assert trainer.count == 4 and set(trainer.phases) == {"score", "update", "step", "sync"}
    c = facts.counts
    assert trainer.phases["update"]["actor weights (float32)"] == 4 * c.total // 4
    score = trainer.phases["score"]  # old-policy and reference log-probs on the FSDP2-sharded trainer actors
    assert score["reference (model.dtype)"] == 2 * c.total // 4 and "scoring forward" in score
    assert "FSDP gathered parameters" in score
    # the transformers engine generates with a float32 copy of the policy on the rollout GPU
    facts, p = _plan(["distributed.backend=ray", "rollout.engine=transformers"])
    rollout = plan_launch(facts, p).gpus[0].phases["generate"]
    assert rollout["policy copy (float32, transformers engine)"] == 4 * facts.counts.total


def test_ray_rollout_gpus_hold_what_the_scoring_leaves_them_and_scoring_trainer_is_the_fix():
    """A KL term in the reward (and GAE) reads the old policy on the experience maker's side: ``distributed.scoring:
    auto`` then makes the experiences on the sharded trainer actors (the rollout GPU holds its engine alone), and
    ``rollout`` keeps a scoring copy, the reference and the critic whole on each rollout actor. LoRA keeps its copy
    under ``auto`` (the adapters' merge), which at 32B does not fit: the plan names ``distributed.scoring=trainer``."""
    ray = ["distributed.backend=ray", "distributed.num_trainer_actors=4", "rollout.tensor_parallel_size=2",
           "algorithm.kl_reward_coef=0.01", "algorithm.advantage_estimator=gae"]
    facts, p = _plan([*ray, "distributed.scoring=rollout"])
    assert p.rollout_models == ("policy", "reference", "critic")
    rollout, trainer = plan_launch(facts, p).gpus
    c = facts.counts
    assert rollout.phases["generate"]["policy scoring copy weights (float32)"] == 4 * c.total
    assert rollout.phases["score"]["reference (model.dtype)"] == 2 * c.total  # whole, not sharded
    assert rollout.phases["score"]["critic copy weights (float32)"] == 4 * (c.total + facts.decoder.hidden + 1)
    assert "scoring forward" in rollout.phases["score"]
    assert all("reference (model.dtype)" not in parts for parts in trainer.phases.values())
    for scoring in ("auto", "trainer"):
        facts, p = _plan([*ray, f"distributed.scoring={scoring}"])
        assert p.rollout_models == (), scoring
        rollout, trainer = plan_launch(facts, p).gpus
        assert set(rollout.phases) == {"generate"} and list(rollout.phases["generate"]) == ["engine (vLLM, awake)"]
        assert trainer.phases["score"]["reference (model.dtype)"] == 2 * c.total // 4
    # at 32B a LoRA run's rollout copies do not fit an 80 GiB GPU, and the plan names the key that moves them
    big = load_config("examples/grpo_geometry3k_qwen2_5_vl_32b.yaml",
                      ["distributed.backend=ray", "distributed.num_rollout_actors=2", "rollout.tensor_parallel_size=4",
                       "distributed.num_trainer_actors=4", "algorithm.kl_reward_coef=0.01", "model.lora.rank=64"])
    plan = memory_plan(big, shape="qwen2_5_vl_32b", gpu_gib=80)
    assert plan.inputs.rollout_models == ("policy",)
    assert not plan.launch.fits and plan.launch.gpus[0].peak > 80 * GIB
    assert ["distributed.scoring=trainer"] in [f.overrides for f in plan.fixes], [f.label for f in plan.fixes]
    rollout = memory_plan(big, shape="qwen2_5_vl_32b", gpu_gib=80, suggest=False)
    assert rollout.launch.gpus[0].peak > 80 * GIB  # (the control: the copy is what does not fit)
    moved = memory_plan(build_config(big.model_dump(), ["distributed.scoring=trainer"]), shape="qwen2_5_vl_32b",
                        gpu_gib=80, suggest=False)
    assert moved.launch.gpus[0].peak <= 80 * GIB
    # vLLM's own LoRA cannot take merged layers: the fix sets the sync too
    own = memory_plan(build_config(big.model_dump(), ["model.lora.sync=vllm_lora"]), shape="qwen2_5_vl_32b",
                      gpu_gib=80)
    assert ["distributed.scoring=trainer", "model.lora.sync=merged"] in [f.overrides for f in own.fixes]


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
    ray = plan_launch(plan.facts, plan.inputs, "ray", 2)
    rollout, trainer = ray.gpus
    assert all("teacher (model.dtype)" not in parts for parts in rollout.phases.values())
    assert trainer.phases["score"]["teacher (model.dtype)"] == teacher // 2  # sharded over the trainer actors
    rank = plan_launch(plan.facts, plan.inputs, "torchrun", 4).gpus[0]
    assert rank.phases["score"]["teacher (model.dtype)"] == teacher // 4
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


def test_torchrun_ranks_share_tensor_parallel_engines_in_groups_on_one_node():
    """rollout.tensor_parallel_size=4 under torchrun: every GPU keeps its share, holds a quarter of the engine's
    weights (the sync wakes that quarter) and a quarter of its per-token KV; groups must divide the ranks and sit
    on one node of --gpus-per-node GPUs."""
    from mmrlhf.models.memory.plan import engine_weight_bytes, kv_bytes_per_token

    facts, one = _plan(["distributed.backend=torchrun"], shape="qwen2_5_vl_32b")
    facts, tp4 = _plan(["distributed.backend=torchrun", "rollout.tensor_parallel_size=4"], shape="qwen2_5_vl_32b")
    c = facts.counts
    assert engine_weight_bytes(facts, one) == 2 * c.total and engine_weight_bytes(facts, tp4) == 2 * c.total // 4
    assert kv_bytes_per_token(facts, 2, 4) == kv_bytes_per_token(facts, 2) // 4
    a, b = (plan_launch(facts, x, "torchrun", 8) for x in (one, tp4))
    assert a.gpus[0].phases["generate"]["engine (vLLM, awake)"] == b.gpus[0].phases["generate"]["engine (vLLM, awake)"]
    assert b.gpus[0].phases["sync"]["engine weights (woken for the sync)"] == 2 * c.total // 4
    assert "2 engines of 4 GPUs" in b.label
    # the 62 GiB bf16 engine cannot start in one 28 GiB share; a quarter of it can
    assert any(m.startswith("vLLM cannot start") for m in a.problems)
    assert not any(m.startswith("vLLM cannot start") for m in b.problems)
    # groups of 4 do not divide 6 ranks; on nodes of 2 GPUs a group of 4 would span nodes; 16 ranks on 8 per node do
    assert any("does not divide the 6 torchrun ranks" in m for m in plan_launch(facts, tp4, "torchrun", 6).problems)
    small_nodes = dataclasses.replace(tp4, gpus_per_node=2)
    assert any("must sit on one node of 2 GPUs" in m for m in plan_launch(facts, small_nodes, "torchrun", 8).problems)
    wide = plan_launch(facts, tp4, "torchrun", 16)
    assert not any("tensor_parallel_size" in m for m in wide.problems)
    assert wide.label.startswith("torchrun over 16 GPUs (2 nodes x 8), 4 engines of 4 GPUs")


def test_offload_moves_the_reference_and_teacher_shards_to_host_memory_summed_per_node():
    facts, p = _plan(["algorithm.kl_loss_coef=0.01", "distributed.offload=params"])
    launch = plan_launch(facts, p, "torchrun", 16)
    rank = launch.gpus[0]
    assert not {n for parts in rank.phases.values() for n in parts} & {"reference (model.dtype)"}
    assert rank.host["reference (model.dtype)"] == 2 * facts.counts.total // 16
    assert "FSDP gathered parameters" in rank.phases["score"]  # the reference's units come in for its forward
    assert launch.processes_per_node == 8 and launch.host_per_node == 8 * sum(rank.host.values())
    single = plan_launch(facts, p, "single")
    assert single.processes_per_node == 1 and single.host_per_node == sum(single.gpus[0].host.values())
    # control: without offload the reference shard stays on the GPU and nothing is in host memory
    facts, q = _plan(["algorithm.kl_loss_coef=0.01"])
    plain = plan_launch(facts, q, "torchrun", 16)
    assert plain.gpus[0].phases["generate"]["reference (model.dtype)"] == 2 * facts.counts.total // 16
    assert plain.host_per_node == 0


def test_an_engine_that_cannot_start_gets_the_smallest_tensor_parallel_size_that_fits_a_node():
    from mmrlhf.models.memory.advice import tensor_parallel_fix

    facts, p = _plan(["distributed.backend=torchrun"], shape="qwen2_5_vl_72b")
    assert tensor_parallel_fix(facts, p) == ["rollout.tensor_parallel_size=8"]  # 137 GiB: an eighth fits 28 GiB
    facts32, p32 = _plan(["distributed.backend=torchrun"], shape="qwen2_5_vl_32b")
    assert tensor_parallel_fix(facts32, p32) == ["rollout.tensor_parallel_size=4"]  # a half (31 GiB) does not
    assert tensor_parallel_fix(facts32, dataclasses.replace(p32, gpus_per_node=2)) is None  # 4 > a node's GPUs
    assert tensor_parallel_fix(facts32, dataclasses.replace(p32, tensor_parallel=4)) is None  # it starts already
    # the fixes of a 32B full fine-tune on one node of 8 all set it, and name offload or LoRA with it
    plan = memory_plan(_config(["distributed.backend=torchrun"]), shape="qwen2_5_vl_32b", gpu_gib=80, ranks=8)
    assert not plan.launch.fits and plan.fixes
    assert all("rollout.tensor_parallel_size=4" in f.label for f in plan.fixes)
    assert {"distributed.offload=params", "model.lora.rank=64"} <= {o for f in plan.fixes for o in f.overrides}


def test_the_summary_lists_torchrun_over_the_planned_ranks_past_one_node():
    plan = memory_plan(_config(["distributed.backend=torchrun"]), shape="qwen2_5_vl_7b", gpu_gib=80, ranks=32,
                       gpus_per_node=8, suggest=False)
    labels = [m.label for m in plan.modes]
    assert "torchrun over 32 GPUs (4 nodes x 8)" in labels and "torchrun over 8 GPUs" in labels
    assert plan.launch.label == "torchrun over 32 GPUs (4 nodes x 8)"
    default = memory_plan(_config(), shape="qwen2_5_vl_7b", gpu_gib=80, suggest=False)
    assert [m.label for m in default.modes][1:4] == [f"torchrun over {n} GPUs" for n in (2, 4, 8)]
    assert len(default.modes) == 5
