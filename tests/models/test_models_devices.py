"""Models on an accelerator get their inputs there, and experiences come back on the CPU (issue 24, item 1).

The models run on a simulated accelerator (:mod:`device_spy`: CPU data behind tensors reporting ``meta``, where an
operation mixing that device with CPU tensors fails as on CUDA) and a spy records the device of every tensor each
model is given: the actor's, the reference's and the critic's backbones (and the critic's value head), for the
padded, packed and shared-prompt (grouped) layouts, through ``FastExperienceMaker.experiences_from`` and through
the policy and critic updates. Before the fix the maker handed its CPU-built micro-batches straight to the models:
the spy saw ``cpu`` and the forward failed with "Expected all tensors to be on the same device". Controls: the same
steps with the models on the CPU give the same numbers, and the harness refuses a CPU input.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from device_spy import SimulatedDevice, tensor_devices
from models_testing import batch_pieces, random_value_head

from mmrlhf.algorithms.kl import FixedKLController
from mmrlhf.experience.batching import split_experience
from mmrlhf.experience.fast_maker import FastExperienceMaker
from mmrlhf.experience.rollout import Rollout, ScoredRollout, ScoringDistribution
from mmrlhf.experience.samples import cut_at_stop
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.critic import CriticVL
from mmrlhf.models.placement import module_device, to_device, to_host
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.trainer.critic_update import CriticUpdater, CriticUpdateSettings
from mmrlhf.trainer.minibatch import GuardedStepper
from mmrlhf.trainer.policy_update import PolicyUpdater, PolicyUpdateSettings, prepare_policy_targets

LAYOUTS = {"padded": {}, "packed": {"packing": True}, "grouped": {"shared_prompt": True}}
ATOL = 1e-5
KEEP_CASES = (1, 3)  # default_cases: one image, video
MICRO = 2


class Spy:
    """Records, per model name, the device types of every tensor given to the watched modules."""

    def __init__(self) -> None:
        self.devices: dict[str, set[str]] = defaultdict(set)
        self.calls: dict[str, int] = defaultdict(int)

    def watch(self, name: str, module: torch.nn.Module) -> None:
        def hook(_module, args, kwargs):
            self.devices[name] |= tensor_devices((args, kwargs))
            self.calls[name] += 1

        module.register_forward_pre_hook(hook, with_kwargs=True)


def _models(bundle, spy: Spy | None = None):
    """Fresh actor, reference and critic (each its own copy of the tiny model), watched by ``spy``."""
    actor = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=64)
    ref = ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=64)
    hidden = bundle.model.config.get_text_config().hidden_size
    critic = CriticVL(ActorVL(copy.deepcopy(bundle.model), bundle.adapter), random_value_head(hidden))
    if spy is not None:
        spy.watch("actor", actor.model.base_model)
        spy.watch("reference", ref.model.base_model)
        spy.watch("critic", critic.body.model.base_model)
        spy.watch("critic", critic.value_head)
    return actor, ref, critic


def _rollout(bundle) -> ScoredRollout:
    """The one-image and video cases of the mixed test batch, each twice, as a scored rollout in GRPO order: the two
    samples of a prompt are neighbours, so a micro-batch of two is one group and the grouped layout shares its
    prompt (two cases keep the simulated device's per-operation Python cost in bounds)."""
    prompts, responses, vision, _ = batch_pieces(bundle)
    cases = len(bundle.inputs)
    order = sorted((k for k in range(len(prompts)) if k % cases in KEEP_CASES), key=lambda k: (k % cases, k))
    n = len(order)
    prompts, responses, vision = ([x[k] for k in order] for x in (prompts, responses, vision))
    cut = [cut_at_stop(r, [bundle.eos_id]) for r in responses]
    rows = Rollout(
        sample_index=list(range(n)), group=[k % cases for k in order], prompt_ids=prompts,
        response_ids=[c[0] for c in cut], engine_logprobs=[[-1.0 - 0.01 * j for j in range(len(c[0]))] for c in cut],
        finished=[not c[1] for c in cut], vision=vision, prompts=[""] * n, labels=[None] * n, references=[None] * n,
        images=[[] for _ in range(n)], record_ids=[None] * n)
    rewards = RewardResult(rewards=torch.arange(n, dtype=torch.float32) % 3, valid=torch.ones(n, dtype=torch.bool),
                           sources={}, parts={}, metrics={})
    return ScoredRollout(rows, rewards, SamplingSettings(max_new_tokens=16, temperature=0.9))


def _maker(bundle, actor, ref, critic, layout: str) -> FastExperienceMaker:
    settings = ExperienceSettings(n_samples_per_prompt=2, micro_batch_size=MICRO, need_reference=True,
                                  kl_in_reward=True, compute_entropy=True, advantage_estimator="gae",
                                  advantage_params={"gamma": 1.0, "lam": 0.95}, **LAYOUTS[layout])
    return FastExperienceMaker(actor, None, None, None, bundle.processor.tokenizer, settings, SamplingSettings(),
                               initial_model=ref, critic=critic, kl_controller=FixedKLController(0.05))


def _update(bundle, actor, critic, items, layout: str) -> dict[str, float]:
    """One policy update and one critic update over ``items`` (SGD, so the step is the gradient itself)."""
    lay = {"packing": "packing" in LAYOUTS[layout], "shared_prompt": "shared_prompt" in LAYOUTS[layout]}
    pad = bundle.processor.tokenizer.pad_token_id

    def stepper(model, name):
        params = [p for p in model.parameters() if p.requires_grad]
        return GuardedStepper(params, torch.optim.SGD(params, lr=1e-2), None, max_grad_norm=1e9, max_consecutive=2,
                              name=name)

    ps = PolicyUpdateSettings(train_batch_size=len(items), micro_batch_size=MICRO, kl_loss_coef=0.1, entropy_coef=0.01,
                              shuffle=False, **lay)
    items, metrics = prepare_policy_targets(items, ps)
    metrics.update(PolicyUpdater(actor, stepper(actor, "policy"), ps, pad_id=pad).update(
        items, distribution=ScoringDistribution(0.9), generator=None))
    cs = CriticUpdateSettings(train_batch_size=len(items), micro_batch_size=MICRO, shuffle=False, **lay)
    metrics.update(CriticUpdater(critic, stepper(critic, "critic"), cs, pad_id=pad, adapter=bundle.adapter).update(
        items, generator=None))
    return metrics


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles["qwen2_vl"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_models_get_inputs_on_their_device_and_experiences_come_back_on_the_cpu(bundle, layout):
    rollout = _rollout(bundle)
    # Control: the same step with every model on the CPU.
    cpu_models = _models(bundle)
    with torch.no_grad():
        expected = _maker(bundle, *cpu_models, layout).experiences_from(rollout)
    cpu_metrics = _update(bundle, cpu_models[0], cpu_models[2],
                          [it for e in expected for it in split_experience(e)], layout)

    spy = Spy()
    actor, ref, critic = _models(bundle, spy)
    before = {n: p.detach().clone() for n, p in actor.named_parameters() if p.requires_grad}
    with SimulatedDevice() as sim:
        for model in (actor, ref, critic):
            sim.place(model)
        assert {module_device(m).type for m in (actor, ref, critic)} == {"meta"}
        with torch.no_grad():
            exps = _maker(bundle, actor, ref, critic, layout).experiences_from(rollout)
        scored = dict(spy.calls)
        # Experiences are plain CPU data whatever the models' device: nothing in them reports the accelerator.
        assert tensor_devices(exps) == {"cpu"}
        items = [it for e in exps for it in split_experience(e)]
        metrics = _update(bundle, actor, critic, items, layout)
        moved = [n for n, p in actor.named_parameters() if p.requires_grad and not torch.equal(p.inner, before[n])]
    assert scored == {"actor": 2, "reference": 2, "critic": 4}  # 4 samples in micro-batches of 2; backbone + head
    assert spy.calls["actor"] > scored["actor"] and spy.calls["critic"] > scored["critic"]  # the updates ran too
    assert dict(spy.devices) == {"actor": {"meta"}, "reference": {"meta"}, "critic": {"meta"}}

    for got, want in zip(exps, expected, strict=True):
        for name in ("action_log_probs", "base_action_log_probs", "values", "advantages", "returns", "kl",
                     "action_entropy"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=ATOL, msg=name)
    for key in ("policy/pg_loss", "policy/kl_loss", "policy/entropy", "critic/value_loss", "policy/grad_norm",
                "critic/grad_norm"):
        if key in cpu_metrics:
            assert metrics[key] == pytest.approx(cpu_metrics[key], rel=1e-4, abs=1e-6), key
    assert moved, "the policy update on the simulated device changed no weight"


def test_the_simulated_device_refuses_cpu_inputs(bundle):
    """Control of the harness: a CPU batch given to a model on the simulated device fails as on a GPU, while the
    same batch moved with ``to_device`` runs."""
    actor = ActorVL(copy.deepcopy(bundle.model), bundle.adapter)
    prompts, responses, vision, _ = batch_pieces(bundle)
    ids = torch.tensor([prompts[0][:8]])  # [1, 8] text tokens
    with SimulatedDevice() as sim, torch.no_grad():
        sim.place(actor)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            actor.model.base_model(input_ids=ids, use_cache=False)
        out = actor.model.base_model(input_ids=to_device(ids, module_device(actor)), use_cache=False).last_hidden_state
        assert out.device.type == "meta" and to_host(out).device.type == "cpu"


def test_to_device_leaves_the_batch_and_keeps_its_type(bundle):
    """``to_device`` returns moved copies (the maker keeps its CPU batch for the experiences) and keeps dataclass
    and NamedTuple types; tensors already in place are not copied."""
    from mmrlhf.experience.samples import build_packed_samples

    prompts, responses, vision, _ = batch_pieces(bundle)
    built = build_packed_samples(prompts, responses, pad_id=0, eos_id=bundle.eos_id, adapter=bundle.adapter,
                                 vision=vision)
    with SimulatedDevice():
        moved = to_device(built, "meta")
        assert type(moved) is type(built) and type(moved.samples) is type(built.samples)
        assert tensor_devices(moved) == {"meta"} and tensor_devices(built) == {"cpu"}
        assert moved.samples.image_num == built.samples.image_num  # plain values ride along
        again = to_device(moved, "meta")
        assert again.samples.sequences is moved.samples.sequences
        back = to_host(moved)
    assert torch.equal(back.samples.pixel_values, built.samples.pixel_values)
