"""LoRA (peft) on the policy: where adapters go, what trains, merged weights, save / reload, the engine sync.

The acceptance check: after a sync the fp32 vLLM engine's log-probs of its own samples match the adapted float32
actor's to 1e-4 (the engine-parity tolerance), for the merged sync and for vLLM's own LoRA support; an engine that
was not synced after the adapters changed is far off (control).
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrlhf.config.model import LoraConfig
from mmrlhf.experience.samples import build_padded_samples
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.lora import (
    AdapterOffScorer,
    apply_lora,
    lora_layers,
    lora_model,
    merged_weights,
    save_adapter,
    save_lora_checkpoint,
)
from mmrlhf.rollout.base import stop_token_ids
from mmrlhf.rollout.types import GenerationRequest, SamplingSettings
from mmrlhf.testing.engine_check import CheckCase, processor_inputs, solid_image
from mmrlhf.testing.tiny_models import tiny_model_dir

TOLERANCE = 1e-4  # fp32 engine vs fp32 actor (tests/models/test_models_engine_parity.py); measured ~1e-6
CAUGHT = 3 * TOLERANCE  # a control must move some log-prob by at least this much
NON_PROMPT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
LM_TARGETS = LoraConfig().target_modules


def _actor(family: str = "qwen2_vl", **lora) -> ActorVL:
    actor = ActorVL.from_pretrained(str(tiny_model_dir(family)), dtype=torch.float32).eval()
    if lora:
        apply_lora(actor, LoraConfig(**lora))
    return actor


def _perturb(actor: ActorVL, seed: int, scale: float = 0.3, only: str = "") -> None:
    """Stand-in for training: random B (fresh adapters have B = 0, i.e. no effect); ``only``: the B of layers whose
    name contains it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if ".lora_B." in name and only in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _tower_ids(actor: ActorVL) -> set[int]:
    tower, _ = actor.adapter.vision_parts(actor.model)
    return {id(m) for m in tower.modules()}


@pytest.fixture(scope="module")
def batch():
    return _image_batch("qwen2_vl")


def _image_batch(family: str):
    """Two prompts (text, one image) with fixed 5-token responses, as padded samples for the actor."""
    processor = AutoProcessor.from_pretrained(str(tiny_model_dir(family)))
    actor = _actor(family)

    def chat(parts):
        return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)

    ask = {"type": "text", "text": "What do you see?"}
    cases = [CheckCase("text", chat([ask])), CheckCase("image", chat([{"type": "image"}, ask]),
                                                       images=[solid_image((255, 0, 0))])]
    inputs = [processor_inputs(processor, actor.adapter, c) for c in cases]
    responses = [[17, 40, 99, 55, 230], [61, 18, 300, 12, 77]]  # no special tokens (ids < 16)
    built = build_padded_samples([x["input_ids"][0].tolist() for x in inputs], responses,
                                 pad_id=processor.tokenizer.pad_token_id, eos_id=[],
                                 adapter=actor.adapter,
                                 vision=[{k: v for k, v in x.items() if k not in NON_PROMPT_KEYS} for x in inputs])
    return built


def _logprobs(model, built) -> torch.Tensor:
    with torch.no_grad():
        return model(built.samples, vision_extra=built.vision_extra).log_probs  # [B, A]


# ---- where the adapters go, what trains -------------------------------------------------------------------------
def test_adapters_on_language_model_layers_only():
    actor = _actor(rank=4)
    tower = _tower_ids(actor)
    layers = dict(lora_layers(actor.model))
    n_layers = actor.model.config.text_config.num_hidden_layers
    assert len(layers) == n_layers * len(LM_TARGETS)
    assert not any(id(m) in tower for m in layers.values())
    assert {name.rsplit(".", 1)[-1] for name in layers} == set(LM_TARGETS)


# Linear layers of each family's vision side: per vision block, and in its merger(s)
VISION_LINEARS = {"qwen2_vl": (4, 2), "qwen2_5_vl": (5, 2), "qwen3_vl": (4, 4)}  # Qwen3-VL: + deepstack mergers


@pytest.mark.parametrize("family", list(VISION_LINEARS))
@pytest.mark.parametrize("vision", ["none", "tower", "merger", "both"])
def test_vision_puts_adapters_on_the_tower_and_merger(family, vision):
    """``model.lora.vision``: every Linear of the vision blocks (tower), of the merger(s), or both, beside the
    language model's targets; nothing of the vision side with ``none`` (Qwen2.5-VL's vision MLP is named like the
    language model's gate / up / down_proj, and stays out)."""
    actor = _actor(family, rank=4, vision=vision)
    tower, mergers = actor.adapter.vision_parts(actor.model)
    merger_ids = {id(m) for part in mergers for m in part.modules()}
    tower_ids = _tower_ids(actor)
    layers = dict(lora_layers(actor.model))
    in_merger = [n for n, m in layers.items() if id(m) in merger_ids]
    in_blocks = [n for n, m in layers.items() if id(m) in tower_ids and id(m) not in merger_ids]
    per_block, merger = VISION_LINEARS[family]
    depth = actor.model.config.vision_config.depth
    assert len(in_blocks) == (per_block * depth if vision in ("tower", "both") else 0), in_blocks
    assert len(in_merger) == (merger if vision in ("merger", "both") else 0), in_merger
    language = len(layers) - len(in_blocks) - len(in_merger)
    assert language == actor.model.config.text_config.num_hidden_layers * len(LM_TARGETS)
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(layers) and all(".lora_" in n for n in trainable)


def test_current_families_adapt_their_linear_layers_and_leave_routed_experts_to_full_training():
    """Qwen3.5: the default targets adapt the full-attention layers and the MLPs, and the linear-attention
    projections on request; Qwen3.5-MoE: the shared expert's Linear layers match, the routed experts (3-D weights) are
    not adapted; Qwen3-VL-MoE, whose MLPs are all routed: an MLP target is refused with the reason. Adapters move the
    log-probs of each (the actor's forward goes through them)."""
    hybrid = _actor("qwen3_5", rank=4, target_modules=["q_proj", "in_proj_qkv", "in_proj_z", "out_proj"])
    names = [n for n, _ in lora_layers(hybrid.model)]
    assert any("linear_attn.in_proj_qkv" in n for n in names) and any("self_attn.q_proj" in n for n in names)
    moe = _actor("qwen3_5_moe", rank=4)
    names = [n for n, _ in lora_layers(moe.model)]
    assert any("shared_expert.gate_proj" in n for n in names)
    assert not [n for n in names if ".experts." in n]
    assert not [n for n, p in moe.named_parameters() if p.requires_grad and "lora_" not in n]  # experts frozen
    with pytest.raises(ValueError, match=r"'gate_proj'.*routed experts.*model\.lora\.rank=0"):
        _actor("qwen3_vl_moe", rank=4)
    _actor("qwen3_vl_moe", rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    for family, actor in (("qwen3_5", hybrid), ("qwen3_5_moe", moe)):
        built = _image_batch(family)
        before = _logprobs(actor, built)
        _perturb(actor, seed=1)
        assert float((_logprobs(actor, built) - before).abs().max()) > CAUGHT, family


def test_the_old_include_vision_key_names_its_replacement():
    with pytest.raises(ValueError, match=r"model\.lora\.vision"):
        LoraConfig(rank=4, include_vision=True)


def test_only_adapters_train():
    actor = _actor(rank=4)
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(dict(lora_layers(actor.model)))


@pytest.mark.parametrize("lora, match", [
    (dict(target_modules=["q_proj", "no_such_layer"]), r"model\.lora\.target_modules: 'no_such_layer'"),
    (dict(target_modules=["qkv"]), r"model\.lora\.vision=tower"),
    (dict(target_modules=["lm_head"]), r"output head"),
])
def test_misconfigured_targets_name_the_key(lora, match):
    with pytest.raises(ValueError, match=match):
        _actor(rank=4, **lora)


def test_an_adapter_peft_saved_as_suffixes_reloads(tmp_path, batch):
    """From 20 layers on (any real model) peft saves the layer list as the fewest name suffixes that select it; the
    check resolves them against the model as peft does (it used to compare them with the exact paths and refused
    every such adapter: a resume of a real-size LoRA run). A config selecting other layers is still refused."""
    import json

    actor = _actor(rank=4, vision="both")  # 14 language + 10 vision layers
    _perturb(actor, 6)
    save_adapter(actor, tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"]
    assert len(saved) < len(dict(lora_layers(actor.model))), saved  # compressed by peft
    reloaded = _actor()
    apply_lora(reloaded, LoraConfig(rank=4, vision="both", adapter=str(tmp_path / "a")))
    assert torch.equal(_logprobs(reloaded, batch), _logprobs(actor, batch))
    with pytest.raises(ValueError, match="adapts other layers"):
        apply_lora(_actor(), LoraConfig(rank=4, vision="tower", adapter=str(tmp_path / "a")))


def test_saved_adapter_of_another_rank_is_refused(tmp_path):
    save_adapter(_actor(rank=4), tmp_path / "a")
    with pytest.raises(ValueError, match=r"model\.lora\.rank=8"):
        apply_lora(_actor(), LoraConfig(rank=8, adapter=str(tmp_path / "a")))
    with pytest.raises(FileNotFoundError, match="model.lora.adapter"):
        apply_lora(_actor(), LoraConfig(rank=4, adapter=str(tmp_path / "missing")))


def test_vllm_lora_settings_are_checked(tmp_path):
    from mmrlhf.experience.builder import check_lora_settings
    from tests.trainer.trainer_helpers import toy_config

    with pytest.raises(ValueError, match="needs rollout.engine=vllm"):
        check_lora_settings(toy_config(tmp_path, model={"lora": {"rank": 4, "sync": "vllm_lora"}}))
    check_lora_settings(toy_config(tmp_path, engine="vllm", model={"lora": {"rank": 4, "sync": "vllm_lora",
                                                                          "vision": "both"}}))  # supported now
    with pytest.raises(ValueError, match="trainer.freeze_vision_tower=false"):
        check_lora_settings(toy_config(tmp_path, model={"lora": {"rank": 4}}, trainer={"freeze_vision_tower": False}))


# ---- merged weights, reference, save / reload ---------------------------------------------------------------------
def test_merged_weights_are_the_adapted_model(batch, tmp_path):
    """The full merged state loaded into a plain model scores exactly like the adapted actor (fp32), and the sync
    set holds only the adapted layers."""
    actor = _actor(rank=4)
    _perturb(actor, 0)
    adapted = _logprobs(actor, batch)
    sync_names = [n for n, _ in merged_weights(actor.model)]
    assert sorted(sync_names) == sorted(f"{n}.weight" for n, _ in lora_layers(actor.model))
    plain = _actor()
    missing, unexpected = plain.model.load_state_dict(dict(merged_weights(actor.model, only_trainable=False)),
                                                      strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # tied head: reached through the embedding
    assert (_logprobs(plain, batch) - adapted).abs().max() < 1e-5
    assert (_logprobs(_actor(), batch) - adapted).abs().max() > CAUGHT  # control: the base model differs


def test_reference_is_the_base_model(batch):
    actor = _actor(rank=4)
    _perturb(actor, 0)
    base = _logprobs(_actor(), batch)
    assert torch.equal(_logprobs(AdapterOffScorer(actor), batch), base)
    assert (_logprobs(actor, batch) - base).abs().max() > CAUGHT  # control: the adapters are on again after


def test_adapter_and_checkpoint_reload(batch, tmp_path):
    """peft's adapter reloads to identical log-probs; the checkpoint's merged model/ loads in transformers."""
    actor = _actor(rank=4)
    _perturb(actor, 1)
    adapted = _logprobs(actor, batch)
    assert save_lora_checkpoint(actor.model, tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    reloaded = _actor()
    apply_lora(reloaded, LoraConfig(rank=4, adapter=str(tmp_path / "adapter")))
    assert torch.equal(_logprobs(reloaded, batch), adapted)
    assert all(p.requires_grad == (".lora_" in n) for n, p in reloaded.named_parameters())  # trainable again
    merged = ActorVL(AutoModelForImageTextToText.from_pretrained(tmp_path / "model", dtype=torch.float32).eval())
    assert (_logprobs(merged, batch) - adapted).abs().max() < 1e-5
    assert not save_lora_checkpoint(_actor().model, tmp_path / "plain")  # no LoRA: the caller saves


# ---- a LoRA run trains ---------------------------------------------------------------------------------------------
def test_adapters_move_the_policy(batch):
    """Gradients reach the adapters through the actor's own forward: 20 Adam steps on fixed responses raise their
    mean log-prob by over a nat (measured -6.42 -> -3.80; full fine-tuning at lr 3e-4: -3.34), base untouched."""
    actor = _actor(rank=16, alpha=32)
    base = {n: p.detach().clone() for n, p in actor.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(20):
        out = actor(batch.samples, vision_extra=batch.vision_extra)
        mean_lp = (out.log_probs * out.action_mask).sum() / out.action_mask.sum()
        first = float(mean_lp) if first is None else first
        opt.zero_grad()
        (-mean_lp).backward()
        opt.step()
    assert float(mean_lp) > first + 1.0, (first, float(mean_lp))
    assert all(torch.equal(p, base[n]) for n, p in actor.named_parameters() if n in base)


@pytest.mark.parametrize("vision", ["none", "both"])
def test_lora_trainer_run_trains_adapters_only(tmp_path, vision):
    from mmrlhf.trainer.builder import build_trainer
    from tests.trainer.trainer_helpers import metrics_rows, toy_config

    config = toy_config(tmp_path / "run", model={"lora": {"rank": 4, "alpha": 8, "vision": vision}},
                        reward={"label_map": {"p": {"type": "function",
                                                    "function": "tests.trainer.trainer_helpers:parity_reward"}},
                                "default_recipe": [["p", 1.0]]},
                        algorithm={"advantage_estimator": "grpo", "kl_loss_coef": 0.01},
                        trainer={"max_steps": 2, "save_steps": 2})
    trainer = build_trainer(config)
    actor = trainer.p.policy.actor
    assert isinstance(trainer.p.source.maker.initial_model, AdapterOffScorer)  # KL: reference = adapters off
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    trainer.fit()
    changed = {n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert any(".lora_B." in n for n in changed)
    # the vision adapters train from the images (toy prompts all carry one); none exist without `vision`
    assert any(".visual." in n and ".lora_B." in n for n in changed) == (vision == "both")
    rows = metrics_rows(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert torch.isfinite(torch.tensor([row["policy/pg_loss"], row["policy/kl_loss"]])).all()
        assert row["policy/grad_norm"] > 0
    assert rows[1]["policy/kl_loss"] > 0  # after one update the actor moved away from its adapters-off reference
    ckpt = trainer.p.checkpoints.latest()
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and (ckpt / "model" / "config.json").is_file()
    resumed = build_trainer(config, resume=True)  # the resume path loads the adapter, not the merged model
    assert lora_model(resumed.p.policy.actor) is not None
    for n, p in resumed.p.policy.actor.model.named_parameters():
        assert torch.equal(p, dict(actor.model.named_parameters())[n]), n


# ---- acceptance: engine after a sync == merged model ---------------------------------------------------------------
def _engine_vs_actor(engine, actor, processor, *, names: tuple[str, ...] = ("text", "image")) -> float:
    """Generate with the engine (fp32) and score its samples with ``actor``: max |log-prob difference| over the
    samples of the cases ``names``."""
    def chat(parts):
        return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)

    ask = {"type": "text", "text": "What do you see?"}
    cases = [CheckCase("text", chat([ask])),
             CheckCase("image", chat([{"type": "image"}, ask]), images=[solid_image((0, 0, 255))])]
    cases = [c for c in cases if c.name in names]
    inputs = [processor_inputs(processor, actor.adapter, c) for c in cases]
    stops = stop_token_ids(actor.model, processor.tokenizer.convert_tokens_to_ids(processor.tokenizer.eos_token))
    requests = [GenerationRequest(prompt=c.text, prompt_token_ids=x["input_ids"][0].tolist(), images=list(c.images))
                for c, x in zip(cases, inputs)]
    result = engine.generate(requests, SamplingSettings(n=2, max_new_tokens=6, seed=5, stop_token_ids=tuple(stops)))
    prompts, responses, vision, engine_lp = [], [], [], []
    for out in result.outputs:
        x = inputs[out.request_index]
        for c in out.completions:
            prompts.append(x["input_ids"][0].tolist())
            responses.append(c.token_ids)
            vision.append({k: v for k, v in x.items() if k not in NON_PROMPT_KEYS})
            engine_lp.append(torch.tensor(c.logprobs, dtype=torch.float32))
    built = build_padded_samples(prompts, responses, pad_id=processor.tokenizer.pad_token_id, eos_id=stops,
                                 adapter=actor.adapter, vision=vision)
    scored = _logprobs(actor, built)
    return max(float((scored[i, :lp.numel()] - lp).abs().max()) for i, lp in enumerate(engine_lp))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("sync", ["merged", "vllm_lora"])
def test_engine_matches_adapted_policy_after_sync(sync):
    pytest.importorskip("vllm")
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.rollout.weight_sync import sync_weights

    path = str(tiny_model_dir("qwen2_vl"))
    processor = AutoProcessor.from_pretrained(path)
    actor = _actor(rank=8, alpha=16)
    engine = VLLMEngine(path, actor.adapter, dtype="float32", max_model_len=256, seed=0,
                        lora_rank=8 if sync == "vllm_lora" else 0)
    try:
        _perturb(actor, 2)
        metrics = sync_weights(actor.model, engine)
        synced = _engine_vs_actor(engine, actor, processor)
        _perturb(actor, 3)  # the adapters change again; the engine is NOT synced
        stale = _engine_vs_actor(engine, actor, processor)
        sync_weights(actor.model, engine)
        resynced = _engine_vs_actor(engine, actor, processor)
    finally:
        engine.close()
        del engine
        gc.collect()
    print(f"{sync}: synced {synced:.2e}, stale {stale:.2e}, re-synced {resynced:.2e}, {metrics}")
    assert synced < TOLERANCE and resynced < TOLERANCE
    assert stale > CAUGHT


def _image_step(actor: ActorVL, batch) -> None:
    """One SGD step raising the log-probs of the image prompt's response: gradients reach the adapters through the
    actor's own forward (a vision adapter gets its gradient only through the image)."""
    params = [p for p in actor.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    out = actor(batch.samples, vision_extra=batch.vision_extra)
    loss = -(out.log_probs[1] * out.action_mask[1]).sum()  # sample 1: the image prompt
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.vllm
@pytest.mark.slow  # ~20 s a family and mode: engine start, two syncs, four generations and scorings
@pytest.mark.parametrize("family, sync", [("qwen2_vl", "merged"), ("qwen2_vl", "vllm_lora"),
                                          ("qwen2_5_vl", "vllm_lora"), ("qwen3_vl", "vllm_lora")])
def test_vision_adapters_reach_the_engine(family, sync, tmp_path):
    """``model.lora.vision=both``: after an update that moved the vision adapters (only they: the language ones are
    reset), the engine's log-probs on an image prompt equal the adapted actor's (merged weights, or vLLM's tower /
    connector LoRA); an engine left unsynced, or the base model, is far off on that prompt (controls); the saved
    adapter reloads to the same log-probs (what a resume loads)."""
    pytest.importorskip("vllm")
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.rollout.weight_sync import sync_weights

    path = str(tiny_model_dir(family))
    processor = AutoProcessor.from_pretrained(path)
    actor = _actor(family, rank=8, alpha=16, vision="both")
    engine = VLLMEngine(path, actor.adapter, dtype="float32", max_model_len=256, seed=0,
                        lora_rank=8 if sync == "vllm_lora" else 0, lora_vision=True)
    try:
        _perturb(actor, 5, only="visual")  # B = 0 would give the vision A matrices no gradient
        sync_weights(actor.model, engine)
        before = _engine_vs_actor(engine, actor, processor, names=("image",))
        _image_step(actor, _image_batch(family))
        with torch.no_grad():
            for name, p in actor.model.named_parameters():
                if ".lora_B." in name and "visual" not in name:
                    p.zero_()  # only the vision adapters differ from the base now
        stale = _engine_vs_actor(engine, actor, processor, names=("image",))
        sync_weights(actor.model, engine)
        synced = _engine_vs_actor(engine, actor, processor, names=("image",))
        base = _engine_vs_actor(engine, _actor(family), processor, names=("image",))
        save_adapter(actor, tmp_path / "adapter")
        reloaded = _actor(family)
        apply_lora(reloaded, LoraConfig(rank=8, alpha=16, vision="both", adapter=str(tmp_path / "adapter")))
        after_reload = _engine_vs_actor(engine, reloaded, processor, names=("image",))
    finally:
        engine.close()
        del engine
        gc.collect()
    print(f"{family} {sync}: before {before:.2e}, stale {stale:.2e}, synced {synced:.2e}, base {base:.2e}, "
          f"reloaded {after_reload:.2e}")
    assert before < TOLERANCE and synced < TOLERANCE and after_reload < TOLERANCE
    assert stale > CAUGHT and base > CAUGHT


@pytest.mark.vllm
@pytest.mark.slow
def test_builder_starts_engine_at_the_loaded_adapter(tmp_path):
    """``model.lora.adapter``: the actor loads it and the engine (built from the base model) is synced to it before
    the first rollout."""
    pytest.importorskip("vllm")
    from mmrlhf.experience.builder import build_experience_maker
    from tests.trainer.trainer_helpers import toy_config

    trained = _actor(rank=4)
    _perturb(trained, 4)
    save_adapter(trained, tmp_path / "adapter")
    lora = {"rank": 4, "adapter": str(tmp_path / "adapter")}
    config = toy_config(tmp_path / "run", engine="vllm", model={"lora": lora}, rollout={"dtype": "float32"})
    stack = build_experience_maker(config)
    try:
        diff = _engine_vs_actor(stack.engine, stack.actor, stack.processor)
        base = _engine_vs_actor(stack.engine, _actor(), stack.processor)  # control: the base model is far off
    finally:
        stack.engine.close()
        gc.collect()
    print(f"loaded adapter: engine vs actor {diff:.2e}, engine vs base {base:.2e}")
    assert diff < TOLERANCE and base > CAUGHT
