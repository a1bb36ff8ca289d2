"""``sampled`` log-probs through the trainer's paths: ActorVL scores the truncated distribution identically in the
padded, packed and shared-prompt layouts and equal to a per-sample full-vocabulary forward, per family and prompt
kind; the experience maker keeps tokens outside the old policy's kept set out of the loss and counts them; the
policy update masks tokens outside the CURRENT policy's kept set (their advantages cannot move the weights)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from models_testing import PROMPT_ONLY_KEYS

from mmrlhf.algorithms.kl import FixedKLController
from mmrlhf.experience.batching import split_experience
from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.grouped import build_grouped_samples
from mmrlhf.experience.rollout import Rollout, ScoredRollout, ScoringDistribution
from mmrlhf.experience.samples import build_packed_samples, build_padded_samples
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.truncation import Truncation, truncate_logits
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.trainer.minibatch import GuardedStepper
from mmrlhf.trainer.policy_update import PolicyUpdater, PolicyUpdateSettings, prepare_policy_targets

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
KINDS = ["text", "one_image", "two_images", "video"]
T = 0.9
TRUNC = Truncation(top_k=40, top_p=0.8)
ATOL = 1e-5  # fp32 vs fp32, other summation order


@torch.no_grad()
def _step_logits(bundle, case: int, response: list[int]) -> torch.Tensor:
    """[A, V] tempered float32 logits predicting each response token: the HF model's own forward of one unpadded
    sample (positions from the adapter's rule, vision tokens excluded as the engines exclude them)."""
    inputs = bundle.inputs[case]
    prompt = inputs["input_ids"]  # [1, P]
    resp = torch.tensor([response], dtype=prompt.dtype)  # [1, A]
    ids = torch.cat([prompt, resp], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in PROMPT_ONLY_KEYS}
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(resp)], dim=1)
    positions = bundle.adapter.rope_index(ids, types, image_grid_thw=extra.get("image_grid_thw"),
                                          video_grid_thw=extra.get("video_grid_thw"),
                                          second_per_grid_ts=extra.get("second_per_grid_ts"))
    logits = bundle.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                          position_ids=positions, **extra).logits.float()[0, prompt.shape[1] - 1: -1] / T
    logits[:, list(bundle.adapter.vision_special_token_ids())] = float("-inf")
    return logits


def _responses(bundle, per_case: int = 2, length: int = 7, seed: int = 0):
    """Per case, ``per_case`` responses drawn token by token from the TRUNCATED distribution (what the engine
    samples), with one token of the second response replaced by a token the truncation drops (as a sample of
    another policy would be). Returns (cases, responses, planted positions)."""
    g = torch.Generator().manual_seed(seed)
    cases, responses, planted = [], [], []
    for c in range(len(KINDS)):
        for j in range(per_case):
            resp: list[int] = []
            where = 3 if j == 1 else None
            for k in range(length):
                z = _step_logits(bundle, c, resp + [0])[-1]  # [V] the next token's logits
                kept = truncate_logits(z[None], TRUNC)[0]  # [V]
                if k == where:  # the least likely token the truncation drops
                    pick = torch.where(torch.isinf(kept) & ~torch.isinf(z), z, torch.full_like(z, float("inf")))
                    resp.append(int(pick.argmin()))
                else:
                    kept[bundle.eos_id] = float("-inf")  # never end early: every response is `length` long
                    resp.append(int(torch.multinomial(kept.softmax(-1), 1, generator=g)))
            cases.append(c)
            responses.append(resp)
            planted.append(where)
    return cases, responses, planted


def _built(bundle, layout, cases, responses):
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=(), adapter=bundle.adapter,
              vision=[bundle.vision[c] for c in cases])
    prompts = [bundle.prompt_ids[c] for c in cases]
    build = {"padded": build_padded_samples, "packed": build_packed_samples, "grouped": build_grouped_samples}[layout]
    return build(prompts, responses, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_scores_the_truncated_distribution(bundles, family):
    bundle = bundles[family]
    cases, responses, planted = _responses(bundle)
    actor = ActorVL(bundle.model, bundle.adapter, chunk_size=5)
    outs = {}
    for layout in ("padded", "packed", "grouped"):
        built = _built(bundle, layout, cases, responses)
        with torch.no_grad():
            outs[layout] = actor(built.samples, vision_extra=built.vision_extra, temperature=T, truncation=TRUNC,
                                 return_entropy=True)
    ref = outs["padded"]
    for layout in ("packed", "grouped"):
        assert torch.equal(outs[layout].outside, ref.outside), layout
        torch.testing.assert_close(outs[layout].log_probs, ref.log_probs, rtol=0, atol=ATOL)
        torch.testing.assert_close(outs[layout].entropy, ref.entropy, rtol=1e-5, atol=ATOL)
    worst = dict.fromkeys(KINDS, 0.0)
    for i, (c, resp, where) in enumerate(zip(cases, responses, planted)):
        logits = _step_logits(bundle, c, resp)  # [A, V]
        truncated = torch.log_softmax(truncate_logits(logits, TRUNC), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        flagged = [k == where for k in range(len(resp))]
        assert ref.outside[i, : len(resp)].tolist() == flagged, (KINDS[c], i)
        expected = torch.where(torch.tensor(flagged), full, truncated)  # outside: scored untruncated, finite
        assert bool(torch.isfinite(ref.log_probs[i]).all())
        worst[KINDS[c]] = max(worst[KINDS[c]], float((ref.log_probs[i, : len(resp)] - expected).abs().max()))
    assert max(worst.values()) < ATOL, worst  # every prompt kind
    with torch.no_grad():  # control: the untruncated scores are not these
        plain = actor(_built(bundle, "padded", cases, responses).samples, temperature=T).log_probs
    assert float((plain - ref.log_probs).abs().max()) > 0.1


def _scored_rollout(bundle, cases, responses, sampling) -> ScoredRollout:
    n = len(cases)
    rows = Rollout(
        sample_index=list(range(n)), group=cases, prompt_ids=[bundle.prompt_ids[c] for c in cases],
        response_ids=responses, engine_logprobs=[[-1.0] * len(r) for r in responses], finished=[True] * n,
        vision=[bundle.vision[c] for c in cases], prompts=[""] * n, labels=[None] * n, references=[None] * n,
        images=[[] for _ in range(n)], record_ids=[None] * n)
    rewards = RewardResult(rewards=torch.arange(n, dtype=torch.float32) % 2, valid=torch.ones(n, dtype=torch.bool),
                           sources={}, parts={}, metrics={})
    return ScoredRollout(rows, rewards, sampling)


def _maker(bundle, actor, mode: str) -> FastExperienceMaker:
    settings = ExperienceSettings(n_samples_per_prompt=2, micro_batch_size=4, need_reference=True,
                                  compute_entropy=True, logprob_mode=mode)
    ref = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=16)
    return FastExperienceMaker(actor, None, None, None, bundle.processor.tokenizer, settings, SamplingSettings(),
                               initial_model=ref, kl_controller=FixedKLController(0.0))


def _update(bundle, actor, items, truncation, *, lr: float = 1e-2) -> dict[str, float]:
    params = [p for p in actor.parameters() if p.requires_grad]
    stepper = GuardedStepper(params, torch.optim.SGD(params, lr=lr), None, max_grad_norm=1e9, max_consecutive=2,
                             name="policy")
    ps = PolicyUpdateSettings(train_batch_size=len(items), micro_batch_size=4, shuffle=False)
    items, metrics = prepare_policy_targets(items, ps)
    metrics.update(PolicyUpdater(actor, stepper, ps, pad_id=bundle.processor.tokenizer.pad_token_id).update(
        items, distribution=ScoringDistribution(T, truncation), generator=None))
    return metrics


@pytest.mark.slow  # ~25 s: 56 single-token forwards to sample, four scorings, three updates
def test_tokens_outside_the_kept_set_are_counted_and_kept_out_of_the_loss(bundles):
    bundle = bundles["qwen2_vl"]
    cases, responses, planted = _responses(bundle)
    sampling = SamplingSettings(max_new_tokens=16, temperature=T, top_k=TRUNC.top_k, top_p=TRUNC.top_p)
    assert ScoringDistribution.of(sampling, "sampled") == ScoringDistribution(T, TRUNC)
    assert ScoringDistribution.of(sampling, "full") == ScoringDistribution(T, None)
    greedy = ScoringDistribution.of(SamplingSettings(temperature=0.0, top_k=5), "sampled")
    assert greedy == ScoringDistribution(1.0, None)  # greedy: scored at 1, untruncated
    rollout = _scored_rollout(bundle, cases, responses, sampling)

    actor = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=16)
    exps = _maker(bundle, actor, "sampled").experiences_from(rollout)
    info = exps[0].info["batch"]
    tokens = sum(len(r) for r in responses)
    assert info["logprobs/outside_kept_frac"] == pytest.approx(len(KINDS) / tokens)  # the planted tokens
    assert info["logprobs/ref_outside_kept_frac"] == pytest.approx(len(KINDS) / tokens)  # same weights: same sets
    mask = torch.cat([e.action_mask for e in exps])  # [N, A] the loss mask
    for i, where in enumerate(planted):
        expected = [k != where for k in range(len(responses[i]))]
        assert mask[i, : len(responses[i])].tolist() == expected
    for e in exps:
        for t in (e.action_log_probs, e.base_action_log_probs, e.advantages, e.kl):
            assert bool(torch.isfinite(t).all())
    # control: the same samples from a maker that scores untruncated (the mode travels with the rollout)
    full = _maker(bundle, ActorVL(copy.deepcopy(bundle.model), bundle.adapter), "full").experiences_from(
        dataclasses.replace(rollout, logprob_mode="full"))
    assert "logprobs/outside_kept_frac" not in full[0].info["batch"]  # control: nothing truncated, nothing masked
    assert bool(torch.cat([e.action_mask for e in full])[:, :7].all())

    # The update masks tokens outside the CURRENT policy's kept set. Put the planted tokens back into the loss mask
    # (as if the old policy had kept them): scored under the truncation, the update must drop them again, so their
    # advantages cannot matter and a run where they are huge ends at the same weights.
    def run(scale: float, truncation):
        items = [it for e in exps for it in split_experience(e)]
        for it, where in zip(items, planted):
            it.token["advantages"] = torch.full_like(it.token["advantages"], 0.5)
            if where is not None:
                it.token["loss_mask"][where] = True
                it.token["advantages"][where] = scale
        model = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=16)
        metrics = _update(bundle, model, items, truncation)
        return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}

    m1, w1 = run(1.0, TRUNC)
    m2, w2 = run(1e4, TRUNC)
    assert m1["policy/outside_kept_frac"] == pytest.approx(len(KINDS) / tokens)
    assert m1["policy/grad_norm"] > 0 and m1["policy/clip_frac"] == 0.0  # in-set ratios are 1: a plain step
    for n in w1:
        torch.testing.assert_close(w1[n], w2[n], rtol=0, atol=0, msg=n)
    # control: scored untruncated, the planted tokens train, and their advantages move the weights
    c1, v1 = run(1.0, None)
    _, v2 = run(1e4, None)
    assert "policy/outside_kept_frac" not in c1
    assert any(not torch.equal(v1[n], v2[n]) for n in v1)
