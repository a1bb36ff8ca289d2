"""Routing replay on a mixture-of-experts VLM: the engine's expert choice, replayed in the trainer's forward, makes
engine and trainer log-probs agree where the trainer's own routing would not.

A float32 vLLM engine (CPU) and a float32 trainer agree to ~1e-6 on the tiny Qwen3-VL-MoE, routing included
(measured: every (token, layer) top-k set equal). Real engines differ from the trainer by more than that (bf16,
other kernels), and a router is discontinuous: a near-tie token goes to other experts, and its log-prob moves by
far more than the numeric noise. The test stands the drift in by perturbing the TRAINER's router weights (relative
noise ``DRIFT``) and shows: without replay (the control) the gap is large; with replay it shrinks to what the
perturbed gate WEIGHTS alone cause. Also: replaying the trainer's own routing is exact, gradients reach the router
under replay, and the packed and shared-prompt (grouped) layouts replay the same, on a hybrid (Gated DeltaNet) MoE
too.

One engine for the module (~15 s to build on the CPU), a few tokens per prompt.
"""

from __future__ import annotations

import gc

import pytest
import torch

from mmrlhf.algorithms.moe import routing_agreement
from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.routing import find_routers, routing
from mmrlhf.rollout.base import stop_token_ids
from mmrlhf.rollout.types import GenerationRequest, SamplingSettings
from mmrlhf.testing.engine_check import processor_inputs
from mmrlhf.testing.tiny_models import tiny_model_dir

pytestmark = [pytest.mark.vllm]
pytest.importorskip("vllm")

FAMILY = "qwen3_vl_moe"
DRIFT = 0.05  # relative noise on the trainer's router weights (enough to flip near-tie tokens' routing)
NON_PROMPT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


@pytest.fixture(scope="module")
def rollout(bundles):
    """The engine's samples: prompts, responses, vision, engine log-probs and routed experts (per sample)."""
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.testing.engine_check import default_cases

    bundle = bundles[FAMILY]
    cases = default_cases(bundle.processor)[:2]  # text and one image
    inputs = [processor_inputs(bundle.processor, bundle.adapter, case) for case in cases]
    requests = [GenerationRequest(prompt=c.text, prompt_token_ids=x["input_ids"][0].tolist(), images=list(c.images))
                for c, x in zip(cases, inputs)]
    engine = VLLMEngine(str(tiny_model_dir(FAMILY)), bundle.adapter, dtype="float32", max_model_len=512,
                        limit_mm_per_prompt={"image": 1}, seed=0, routing_replay="replay")
    try:
        result = engine.generate(requests, SamplingSettings(n=3, max_new_tokens=12, seed=3,
                                                            stop_token_ids=tuple(stop_token_ids(bundle.model,
                                                                                                bundle.eos_id))))
    finally:
        engine.close()
        del engine
        gc.collect()
    out = {"prompts": [], "responses": [], "vision": [], "logprobs": [], "routed": []}
    for o in result.outputs:
        x = inputs[o.request_index]
        for c in o.completions:
            out["prompts"].append(x["input_ids"][0].tolist())
            out["responses"].append(list(c.token_ids))
            out["vision"].append({k: v for k, v in x.items() if k not in NON_PROMPT_KEYS})
            out["logprobs"].append(torch.tensor(c.logprobs))
            out["routed"].append(c.routed_experts)
    return bundle, out


def _built(bundle, r, layout="padded", routed=True):
    build = {"padded": build_padded_samples, "packed": build_packed_samples, "grouped": build_grouped_samples}[layout]
    return build(r["prompts"], r["responses"], pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=(),
                 adapter=bundle.adapter, vision=r["vision"], routed_experts=r["routed"] if routed else None)


def _gap(out, r) -> float:
    """max |trainer - engine| log-prob over every sampled token."""
    return max(float((out.log_probs[i, : len(lp)] - lp).abs().max()) for i, lp in enumerate(r["logprobs"]))


@pytest.fixture()
def drifted(bundles):
    """The tiny model with its routers perturbed for the test's duration (restored after)."""
    model = bundles[FAMILY].model
    routers = find_routers(model)
    saved = {k: m.weight.detach().clone() for k, m in routers.items()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in routers.values():
            m.weight.add_(DRIFT * m.weight.abs().mean() * torch.randn(m.weight.shape, generator=g))
    yield model
    with torch.no_grad():
        for k, m in routers.items():
            m.weight.copy_(saved[k])


def test_engine_routing_layout_and_agreement(rollout):
    """One row per token the engine ran (prompt + response - 1), every layer routed, and the fp32 trainer routes
    every (token, layer) exactly as the engine did."""
    bundle, r = rollout
    text = bundle.model.config.text_config
    first: dict[tuple, torch.Tensor] = {}
    for p, resp, routed in zip(r["prompts"], r["responses"], r["routed"]):
        assert routed.shape == (len(p) + len(resp) - 1, text.num_hidden_layers, text.num_experts_per_tok)
        assert int(routed.min()) >= 0 and int(routed.max()) < text.num_experts
        # a group's samples route its prompt alike (what a shared-prompt row replays: the first sample's)
        prompt_rows = torch.as_tensor(routed)[: len(p)]
        assert torch.equal(first.setdefault(tuple(p), prompt_rows), prompt_rows)
    assert len(first) < len(r["prompts"])  # some prompt was sampled more than once
    built = _built(bundle, r)
    actor = ActorVL(bundle.model, bundle.adapter)
    with torch.no_grad():
        out = actor(built.samples, vision_extra=built.vision_extra, return_routing=True)
    trainer = out.routing.stacked(text.num_hidden_layers)  # [B*S, L, k]
    engine = built.samples.routed_experts.reshape(trainer.shape)
    agree = routing_agreement(engine, trainer)
    assert agree["set"] == 1.0 and agree["pairs"] > 100, agree
    assert _gap(out, r) < 1e-4


@pytest.mark.parametrize("layout", ["padded", "packed", "grouped"])
def test_replay_closes_the_drift_gap(rollout, drifted, layout):
    """Control (no replay): the drifted routers flip some tokens' experts and the log-probs move far; replay: the
    engine's experts, the drifted gate weights only, a gap ~50x smaller."""
    bundle, r = rollout
    built = _built(bundle, r, layout)
    with torch.no_grad():
        control = ActorVL(drifted, bundle.adapter)(built.samples, vision_extra=built.vision_extra,
                                                   return_routing=True)
        replay = ActorVL(drifted, bundle.adapter, routing_replay="replay")(built.samples,
                                                                           vision_extra=built.vision_extra)
    layers = drifted.config.text_config.num_hidden_layers
    trainer = control.routing.stacked(layers)
    agree = routing_agreement(built.samples.routed_experts.reshape(trainer.shape), trainer)
    gap_control, gap_replay = _gap(control, r), _gap(replay, r)
    print(f"{layout}: agreement {agree}, gap without replay {gap_control:.4g}, with replay {gap_replay:.4g}")
    assert agree["set"] < 1.0  # the drift did flip some routing (else the control proves nothing)
    assert gap_control > 0.02  # measured 0.039 (1.5% of (token, layer) sets flipped)
    assert gap_replay < gap_control / 10  # measured 7e-4


def test_replaying_own_routing_is_exact_and_trains_the_router(bundles, rollout):
    """Recording the trainer's own routing and replaying it gives bit-identical log-probs; under replay the
    router still gets gradients (its probabilities weight the chosen experts)."""
    bundle, r = rollout
    model = bundle.model
    built = _built(bundle, r, routed=False)
    actor = ActorVL(model, bundle.adapter, routing_replay="replay")
    with torch.no_grad():
        plain = actor(built.samples, vision_extra=built.vision_extra, return_routing=True)
    own = plain.routing.stacked(model.config.text_config.num_hidden_layers)  # [B*S, L, k]
    built.samples.routed_experts = own.reshape(*built.samples.sequences.shape, *own.shape[1:])
    replayed = actor(built.samples, vision_extra=built.vision_extra)
    assert torch.equal(replayed.log_probs.detach(), plain.log_probs)
    model.zero_grad()
    replayed.log_probs.sum().backward()
    for router in find_routers(model).values():
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_grouped_rows_replay_as_packed_on_a_hybrid_moe(bundles):
    """Qwen3.5-MoE (recurrent layers continue each response from its shared prompt's state): the routing its
    unperturbed routers chose on a packed batch (standing in for the engine's), replayed after a drift, scores a
    shared-prompt batch as the packed one (float32, another summation order); without replay the drift moves it."""
    bundle = bundles["qwen3_5_moe"]
    model = bundle.model
    prompts = [bundle.prompt_ids[c] for c in (0, 1, 1, 3, 3, 0)]
    vision = [bundle.vision[c] for c in (0, 1, 1, 3, 3, 0)]
    g = torch.Generator().manual_seed(2)
    vocab, banned = model.config.get_text_config().vocab_size, set(bundle.adapter.vision_special_token_ids())
    responses = [[t for t in torch.randint(0, vocab, (12,), generator=g).tolist() if t not in banned][:n]
                 for n in (6, 3, 8, 5, 2, 7)]
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=(), adapter=bundle.adapter, vision=vision)
    layers = model.config.get_text_config().num_hidden_layers
    packed = build_packed_samples(prompts, responses, **kw)
    with torch.no_grad():
        own = ActorVL(model, bundle.adapter)(packed.samples, vision_extra=packed.vision_extra, return_routing=True)
    flat = own.routing.stacked(layers).to(torch.int16)  # [T, L, k] the packed row's tokens in order
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    routed = list(torch.split(flat, lengths))  # per sample [len_i, L, k]
    packed = build_packed_samples(prompts, responses, routed_experts=routed, **kw)
    grouped = build_grouped_samples(prompts, responses, routed_experts=routed, **kw)
    assert grouped.samples.num_rows == 3 and grouped.samples.routed_experts.shape[:2] == grouped.samples.sequences.shape
    routers = find_routers(model)
    saved = {k: m.weight.detach().clone() for k, m in routers.items()}
    try:
        with torch.no_grad():
            for m in routers.values():
                m.weight.add_(4 * DRIFT * m.weight.abs().mean() * torch.randn(m.weight.shape, generator=g))
            out = {name: ActorVL(model, bundle.adapter, routing_replay=mode)(b.samples, vision_extra=b.vision_extra)
                   for name, b, mode in (("packed", packed, "replay"), ("grouped", grouped, "replay"),
                                         ("control", grouped, "none"))}
    finally:
        with torch.no_grad():
            for k, m in routers.items():
                m.weight.copy_(saved[k])
    gap = float((out["grouped"].log_probs - out["packed"].log_probs).abs().max())
    moved = float((out["control"].log_probs - out["packed"].log_probs).abs().max())
    print(f"hybrid MoE grouped vs packed under replay: {gap:.3g}; without replay: {moved:.3g}")
    assert gap < 1e-5 and moved > 1e-3


def test_replay_refuses_a_dense_model_and_restores_routers(bundles):
    """A replay tensor for a model without routers is an error; the patch is gone after the block."""
    dense = bundles["qwen3_vl"].model
    with pytest.raises(ValueError, match="without routed experts"):
        with routing(dense, replay=torch.zeros(4, 2, 2, dtype=torch.long)):
            pass
    model = bundles[FAMILY].model
    with routing(model, record=True):
        assert all("forward" in vars(m) for m in find_routers(model).values())
    assert not any("forward" in vars(m) for m in find_routers(model).values())


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_experts_and_routers_shard_with_their_decoder_layer(bundles, family):
    """FSDP2 units are the model's blocks (``_no_split_modules``): every routed-expert and router parameter lies in
    exactly one decoder-layer unit, so its [E, ...] weights are sharded and gathered with that layer."""
    from mmrlhf.models.sharding import block_modules

    model = bundles[family].model
    blocks = block_modules(model)
    owned = [{id(p) for p in b.parameters()} for b in blocks]
    moe = [p for name, p in model.named_parameters() if ".mlp.experts." in name or ".mlp.gate." in name]
    assert moe and all(p.dim() >= 2 for p in moe)
    assert all(sum(id(p) in o for o in owned) == 1 for p in moe)
