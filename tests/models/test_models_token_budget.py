"""Token-budget micro-batches on the tiny Qwen2-VL (issue 31, item 3): the planner's cost is the tensors the
builders lay out; a budget split of the update gives the count split's gradients in every aggregation mode (each
micro-batch loss is divided by its MINI-batch's count), for the policy and the critic, in every layout; the scoring
forwards under a budget give the count split's experiences.

Controls that must fail: with each micro-batch divided by its OWN count the split changes the gradients, and so does
``seq-mean-token-sum-norm`` without ``loss_agg_norm_len`` (each micro-batch's padded length divides its loss: why
``auto`` keeps the count split there).
"""

from __future__ import annotations

import copy

import pytest
import torch
from models_testing import batch_pieces, random_value_head

import mmrlhf.trainer.critic_update as critic_update_module
import mmrlhf.trainer.policy_update as policy_update_module
from mmrlhf.algorithms.kl import FixedKLController
from mmrlhf.experience.batching import collate, split_experience
from mmrlhf.experience.costs import forward_layout, item_costs, sample_costs
from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.rollout import Rollout, ScoredRollout, ScoringDistribution
from mmrlhf.experience.samples import cut_at_stop
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.critic import CriticVL
from mmrlhf.parallel.micro_batches import count_split, micro_batch_cost, plan_micro_batches
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale
from mmrlhf.trainer.critic_update import CriticUpdater, CriticUpdateSettings
from mmrlhf.trainer.minibatch import GuardedStepper, run_minibatches
from mmrlhf.trainer.policy_update import PolicyUpdater, PolicyUpdateSettings, prepare_policy_targets

LAYOUTS = {"padded": {}, "packed": {"packing": True}, "grouped": {"shared_prompt": True}}
MICRO = 2
AGG_MODES = [("token-mean", None), ("seq-mean-token-mean", None), ("seq-mean-token-sum", None),
             ("seq-mean-token-sum-norm", 16)]


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles["qwen2_vl"]


def _rollout(bundle) -> ScoredRollout:
    """Every engine-check case (text, one image, two images, video) twice, the two samples of a case adjacent (one
    GRPO group): prompts of very different costs, responses of uneven lengths."""
    prompts, responses, vision, _ = batch_pieces(bundle)
    cases = len(bundle.inputs)
    order = sorted(range(len(prompts)), key=lambda k: (k % cases, k))
    n = len(order)
    prompts, responses, vision = ([x[k] for k in order] for x in (prompts, responses, vision))
    cut = [cut_at_stop(r, [bundle.eos_id]) for r in responses]
    rows = Rollout(
        sample_index=list(range(n)), group=[k % cases for k in order], prompt_ids=prompts,
        response_ids=[c[0] for c in cut], engine_logprobs=[[-1.0] * len(c[0]) for c in cut],
        finished=[not c[1] for c in cut], vision=vision, prompts=[""] * n, labels=[None] * n, references=[None] * n,
        images=[[] for _ in range(n)], record_ids=[None] * n)
    rewards = RewardResult(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.0]), sources={}, parts={},
                           valid=torch.ones(n, dtype=torch.bool), metrics={})
    return ScoredRollout(rows, rewards, SamplingSettings(max_new_tokens=16, temperature=0.9))


def _models(bundle):
    actor = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=64)
    ref = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=64)
    hidden = bundle.model.config.get_text_config().hidden_size
    critic = CriticVL(ActorVL(copy.deepcopy(bundle.model), bundle.adapter), random_value_head(hidden))
    return actor, ref, critic


def _maker(bundle, models, layout: str, micro: int = 4, tokens=None) -> FastExperienceMaker:
    actor, ref, critic = models
    settings = ExperienceSettings(n_samples_per_prompt=2, micro_batch_size=micro, need_reference=True,
                                  compute_entropy=True, advantage_estimator="gae",
                                  advantage_params={"gamma": 1.0, "lam": 0.95}, max_tokens_per_micro_batch=tokens,
                                  **LAYOUTS[layout])
    return FastExperienceMaker(actor, None, None, None, bundle.processor.tokenizer, settings, SamplingSettings(),
                               initial_model=ref, critic=critic, kl_controller=FixedKLController(0.0))


@pytest.fixture(scope="module")
def step(bundle):
    """(models, per-layout items) of one scored step (the count split's experiences)."""
    models = _models(bundle)
    with torch.no_grad():
        items = {layout: [it for e in _maker(bundle, models, layout).experiences_from(_rollout(bundle))
                          for it in split_experience(e)] for layout in LAYOUTS}
    return models, items


# ---- the cost model is the builders' layout ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_planned_cost_is_the_laid_out_tensors(bundle, step, layout):
    """Decoder positions the built batch holds (padding included) + vision patch rows, for the whole step and for
    sub-batches that split groups; two groups with the same prompt and pixels count as one row group, as the
    builder lays them out."""
    items = step[1][layout]
    lay = {"packed": "packing" in LAYOUTS[layout], "shared_prompt": "shared_prompt" in LAYOUTS[layout]}
    costs = item_costs(items, adapter=bundle.adapter, grouped=lay["shared_prompt"])
    shape = forward_layout(packing=lay["packed"], shared_prompt=lay["shared_prompt"], max_row_tokens=None)
    for subset in (list(range(8)), [0, 2, 3, 7], [5], [1, 6, 4]):
        batch = collate([items[i] for i in subset], packed=lay["packed"], pad_id=0, adapter=bundle.adapter,
                        shared_prompt=lay["shared_prompt"])
        s = batch.samples
        patches = sum(int(t.shape[0]) for t in (s.pixel_values, s.pixel_values_videos) if t is not None)
        assert micro_batch_cost(costs, subset, shape) == s.sequences.numel() + patches, subset
    # the same prompt and image under two group ids (the toy tasks ask the same question twice): one row group;
    # the same prompt ids with other pixels: two (copies, so the pixels are compared, not the storage)
    picked = [items[i] for i in (2, 3, 2, 3, 4, 0)]
    vision = [{k: v.clone() for k, v in it.vision.items()} for it in picked]
    vision[4] = {k: v.clone() for k, v in items[2].vision.items()}
    vision[4]["pixel_values"] = vision[4]["pixel_values"] + 1.0
    dup = sample_costs([it.prompt_ids for it in picked[:4]] + [items[2].prompt_ids, picked[5].prompt_ids],
                       [it.response_ids for it in picked], vision, adapter=bundle.adapter, grouped=True,
                       keys=[1, 1, 7, 7, 8, 0])
    assert [c.group for c in dup] == [0, 0, 0, 0, 1, 2]


# ---- the update: any split is the count split's step ------------------------------------------------------------
class _Record(torch.optim.Optimizer):
    """Keeps the gradients of each step (no update: every run starts from the same weights)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for g in self.param_groups for p in g["params"]])


def _gradients(model, run) -> tuple[list[torch.Tensor], dict, list[list[int]]]:
    """The gradients of the one optimiser step ``run(stepper)`` takes, its metrics, and the micro-batches it laid
    out (item indices, from the collations)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _Record(params)
    stepper = GuardedStepper(params, opt, None, max_grad_norm=1e9, max_consecutive=2, name="policy")
    metrics = run(stepper)
    assert len(opt.grads) == 1
    return opt.grads[0], metrics


def _own_count(monkeypatch, module):
    """The control: each micro-batch divided by its own count instead of its mini-batch's."""
    def run(counts, **kw):
        inner = kw["micro_loss"]
        kw["micro_loss"] = lambda micro, denom: inner(micro, sum(counts[i] for i in micro))
        return run_minibatches(counts, **kw)

    monkeypatch.setattr(module, "run_minibatches", run)


def _laid_out(monkeypatch, module, items) -> list[list[int]]:
    seen: list[list[int]] = []
    # keyed by a tensor the items share with their policy-target copies (prepare_policy_targets returns new items)
    index = {id(it.token["loss_mask"]): k for k, it in enumerate(items)}

    def spy(batch_items, **kw):
        seen.append(sorted(index[id(it.token["loss_mask"])] for it in batch_items))
        return collate(batch_items, **kw)

    monkeypatch.setattr(module, "collate", spy)
    return seen


def _policy(bundle, actor, items, layout, agg, norm_len, tokens):
    ps = PolicyUpdateSettings(train_batch_size=len(items), micro_batch_size=MICRO, kl_loss_coef=0.1,
                              entropy_coef=0.01, agg=agg, norm_len=norm_len, shuffle=False,
                              max_tokens_per_micro_batch=tokens, **LAYOUTS[layout])
    items, _ = prepare_policy_targets(items, ps)
    pad = bundle.processor.tokenizer.pad_token_id
    return lambda stepper: PolicyUpdater(actor, stepper, ps, pad_id=pad).update(
        items, distribution=ScoringDistribution(0.9), generator=None)


def _budget(bundle, items, layout) -> int:
    """The count split's peak (the budget ``auto`` would take): a different partition, never a costlier one. In the
    grouped layout a micro-batch of two samples is one group, whose peak holds no second group: half the step."""
    return _step_budget(item_costs(items, adapter=bundle.adapter, grouped=layout == "grouped"), layout)


def _shape(layout):
    return forward_layout(packing=layout == "packed", shared_prompt=layout == "grouped", max_row_tokens=None)


def _step_budget(costs, layout) -> int:
    everything = list(range(len(costs)))
    peak = max(micro_batch_cost(costs, m, _shape(layout)) for m in count_split(everything, MICRO))
    return max(peak, micro_batch_cost(costs, everything, _shape(layout)) // 2) if layout == "grouped" else peak


def _compare(bundle, monkeypatch, model, items, layout, make, module):
    """Gradients and partitions of the count split, the budget split, and (controls) both with own counts."""
    out = {}
    for name, tokens, own in (("count", None, False), ("budget", _budget(bundle, items, layout), False),
                              ("count_own", None, True), ("budget_own", _budget(bundle, items, layout), True)):
        with monkeypatch.context() as m:
            if own:
                _own_count(m, module)
            seen = _laid_out(m, module, items)
            grads, metrics = _gradients(model, make(tokens))
        out[name] = (grads, metrics, seen)
    return out


@pytest.mark.parametrize("agg,norm_len", AGG_MODES)
def test_policy_gradients_of_a_budget_split_equal_the_count_split(bundle, step, monkeypatch, agg, norm_len):
    (actor, _, _), items = step[0], step[1]["padded"]
    runs = _compare(bundle, monkeypatch, actor, items, "padded",
                    lambda tokens: _policy(bundle, actor, items, "padded", agg, norm_len, tokens), policy_update_module)
    count, budget = runs["count"], runs["budget"]
    assert count[2] == count_split(list(range(8)), MICRO)
    assert sorted(budget[2]) != sorted(count[2]) and len(budget[2]) < len(count[2])  # fewer, other forwards
    assert budget[1]["policy/micro_batches"] == len(budget[2]) and count[1]["policy/micro_batches"] == 4
    assert budget[1]["policy/micro_batch_tokens_max"] <= count[1]["policy/micro_batch_tokens_max"]
    assert any(float(g.abs().max()) > 0 for g in count[0])
    for g_budget, g_count in zip(budget[0], count[0]):
        assert_close_at_scale(g_budget, g_count)
    for key in ("policy/pg_loss", "policy/kl_loss", "policy/entropy", "policy/clip_frac"):
        if key in count[1]:
            assert budget[1][key] == pytest.approx(count[1][key], rel=1e-5, abs=1e-7), key
    # control: divided by its own count, the split changes the step
    assert not all(close_at_scale(a, b) for a, b in zip(runs["budget_own"][0], runs["count_own"][0]))


def test_norm_by_the_micro_batch_length_is_not_exact(bundle, step, monkeypatch):
    """seq-mean-token-sum-norm without loss_agg_norm_len divides by each micro-batch's padded length: the budget
    split then changes the gradient (the reason ``auto`` keeps the count split for it)."""
    (actor, _, _), items = step[0], step[1]["padded"]
    runs = _compare(bundle, monkeypatch, actor, items, "padded",
                    lambda tokens: _policy(bundle, actor, items, "padded", "seq-mean-token-sum-norm", None, tokens),
                    policy_update_module)
    assert not all(close_at_scale(a, b) for a, b in zip(runs["budget"][0], runs["count"][0]))


@pytest.mark.parametrize("layout", ["packed", "grouped"])
def test_policy_gradients_in_the_other_layouts(bundle, step, monkeypatch, layout):
    (actor, _, _), items = step[0], step[1][layout]
    runs = _compare(bundle, monkeypatch, actor, items, layout,
                    lambda tokens: _policy(bundle, actor, items, layout, "token-mean", None, tokens),
                    policy_update_module)
    assert sorted(runs["budget"][2]) != sorted(runs["count"][2])
    for g_budget, g_count in zip(runs["budget"][0], runs["count"][0]):
        assert_close_at_scale(g_budget, g_count)
    assert not all(close_at_scale(a, b) for a, b in zip(runs["budget_own"][0], runs["count_own"][0]))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_critic_gradients_of_a_budget_split_equal_the_count_split(bundle, step, monkeypatch, agg):
    (_, _, critic), items = step[0], step[1]["padded"]
    pad = bundle.processor.tokenizer.pad_token_id

    def make(tokens):
        cs = CriticUpdateSettings(train_batch_size=len(items), micro_batch_size=MICRO, agg=agg, shuffle=False,
                                  max_tokens_per_micro_batch=tokens)
        return lambda stepper: CriticUpdater(critic, stepper, cs, pad_id=pad, adapter=bundle.adapter).update(
            items, generator=None)

    runs = _compare(bundle, monkeypatch, critic, items, "padded", make, critic_update_module)
    assert sorted(runs["budget"][2]) != sorted(runs["count"][2])
    assert runs["budget"][1]["critic/micro_batches"] < runs["count"][1]["critic/micro_batches"]
    for g_budget, g_count in zip(runs["budget"][0], runs["count"][0]):
        assert_close_at_scale(g_budget, g_count)
    assert runs["budget"][1]["critic/vf_loss"] == pytest.approx(runs["count"][1]["critic/vf_loss"], rel=1e-5)
    assert not all(close_at_scale(a, b) for a, b in zip(runs["budget_own"][0], runs["count_own"][0]))


# ---- the scoring forwards ---------------------------------------------------------------------------------------
EXPERIENCE_FIELDS = ("action_log_probs", "base_action_log_probs", "values", "returns", "advantages", "kl",
                     "action_entropy", "rollout_log_probs")
EXACT_FIELDS = ("sequences", "attention_mask", "action_mask", "pixel_values", "image_grid_thws", "video_grid_thws")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scoring_under_a_budget_gives_the_count_split_experiences(bundle, step, layout):
    models = step[0]
    rollout = _rollout(bundle)
    calls = []
    hook = models[0].model.base_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad():
            want = _maker(bundle, models, layout, micro=MICRO).experiences_from(rollout)
            forwards_count, calls[:] = len(calls), []
            costs = sample_costs(rollout.rows.prompt_ids, rollout.rows.response_ids, rollout.rows.vision,
                                 adapter=bundle.adapter, grouped=layout == "grouped", keys=rollout.rows.group)
            budget = _step_budget(costs, layout)
            got = _maker(bundle, models, layout, micro=MICRO, tokens=budget).experiences_from(rollout)
    finally:
        hook.remove()
    plan = plan_micro_batches(costs, [list(range(8))], _shape(layout), samples=MICRO, tokens=budget)
    assert len(calls) == plan.forwards < forwards_count == 4  # fewer forwards, in another grouping of the rows
    assert [sorted(m) for m in plan.micro_batches[0]] != count_split(list(range(8)), MICRO)
    info = got[0].info["batch"]
    assert info["scoring/micro_batches"] == plan.forwards and info["scoring/micro_batch_tokens_max"] <= budget
    assert len(got) == len(want) == 4  # the experiences keep the chunks of micro_batch_size, in sample order
    for g, w in zip(got, want):
        for name in EXACT_FIELDS:
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        for name in EXPERIENCE_FIELDS:
            a, b = getattr(g, name), getattr(w, name)
            if b is None:
                assert a is None, name
            else:
                assert a.shape == b.shape, name
                assert_close_at_scale(a, b, msg=name)


def test_ray_rescoring_under_a_budget_scores_every_item_in_order_with_agreed_forwards(bundle, step):
    """The Ray trainer ranks' re-scoring (``PolicyUpdater.score``): under a budget every item gets the count
    split's log-probs, in item order; two ranks holding 6 and 2 items run as many forwards each."""
    import threading
    from mmrlhf.parallel.world import single
    from mmrlhf.testing.lockstep import run_ranks

    actor, items = step[0][0], step[1]["padded"]
    policy = PolicyUpdater(actor, None, PolicyUpdateSettings(), pad_id=bundle.processor.tokenizer.pad_token_id)

    def score(tokens, world, part):
        return policy.score(part, ScoringDistribution(0.9), world, micro_batch_size=MICRO, max_tokens=tokens)

    want, _ = score(None, single(), items)
    for tokens in ("auto", _budget(bundle, items, "padded")):
        got, outside = score(tokens, single(), items)
        assert len(got) == len(items) and not any(bool(o.any()) for o in outside)
        for g, w, it in zip(got, want, items):
            assert g.shape == (len(it.response_ids),)
            assert_close_at_scale(g, w)
    calls: list[str] = []
    hook = actor.model.base_model.register_forward_pre_hook(lambda *a: calls.append(threading.current_thread().name))
    try:
        parts = [items[:6], items[6:]]
        ranked = run_ranks(lambda w: score(_budget(bundle, items, "padded"), w, parts[w.rank])[0], 2)
    finally:
        hook.remove()
    assert calls.count("rank-0") == calls.count("rank-1") > 1  # the short rank pads its forwards
    for got, part, offset in zip(ranked, parts, (0, 6)):
        for k, g in enumerate(got):
            assert_close_at_scale(g, want[offset + k])
