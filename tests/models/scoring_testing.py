"""The scoring step of the sharded-scoring test (test_scoring_fsdp.py and its torchrun worker): one rollout of every
engine-check case (text, one image, two images, video; two samples each, one GRPO group per case), the models that
score it (a policy, a reference and a distillation teacher that differ from it, a critic) and the maker settings,
built the same way in one process and on every rank."""

from __future__ import annotations

import copy
from typing import Any

import torch
from models_testing import batch_pieces, random_value_head

KINDS = ("text", "image", "two_images", "video")  # the engine-check cases, in their order
MICRO = 2  # samples per scoring forward
# Rank 0 scores the image, two-image and video groups (3 forwards), rank 1 the text group (1 forward): rank 1 then
# runs 2 padding forwards, and its forwards never run the vision tower while rank 0's do.
SHARES = ((2, 3, 4, 5, 6, 7), (0, 1))
TOKEN_KEYS = ("action_log_probs", "base_action_log_probs", "teacher_topk_log_probs", "values", "kl", "advantages",
              "returns")


def scoring_rollout(bundle: Any) -> Any:
    """The step's ScoredRollout: case k's two samples adjacent (rows 2k, 2k + 1, group k)."""
    from mmrlhf.experience.rollout import Rollout, ScoredRollout
    from mmrlhf.experience.samples import cut_at_stop
    from mmrlhf.rewards.types import RewardResult
    from mmrlhf.rollout.types import SamplingSettings

    prompts, responses, vision, _ = batch_pieces(bundle)
    cases = len(bundle.inputs)
    assert cases == len(KINDS), cases
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


def _perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """A frozen copy of ``model`` with every floating weight moved by its own seeded noise (so that the reference
    and the teacher score differently from the policy, and from each other)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (float(p.abs().mean()) + 1e-3))
    return out.requires_grad_(False).eval()


def scoring_models(bundle: Any) -> dict[str, Any]:
    """policy, reference, teacher (frozen ActorVL) and critic, float32, on the CPU."""
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.critic import CriticVL

    hidden = bundle.model.config.get_text_config().hidden_size
    return {
        "actor": ActorVL(copy.deepcopy(bundle.model), bundle.adapter, chunk_size=64),
        "reference": ActorVL(_perturbed(bundle.model, 1), bundle.adapter, chunk_size=64),
        "teacher": ActorVL(_perturbed(bundle.model, 2), bundle.adapter, chunk_size=64),
        "critic": CriticVL(ActorVL(copy.deepcopy(bundle.model), bundle.adapter), random_value_head(hidden)),
    }


def lora_scoring_models(bundle: Any) -> dict[str, Any]:
    """A LoRA policy (adapters with random B: it differs from its base), its reference as a LoRA run has it (the
    policy's own module with the adapters off: sharded with the policy, nothing of its own) and a critic; no
    teacher."""
    from lora_fsdp_common import lora_actor

    from mmrlhf.models.lora import AdapterOffScorer

    models = scoring_models(bundle)
    actor = lora_actor(copy.deepcopy(bundle.model), bundle.adapter, "language", seed=0)
    return {"actor": actor, "reference": AdapterOffScorer(actor), "teacher": None, "critic": models["critic"]}


def scoring_maker(bundle: Any, models: dict[str, Any]) -> Any:
    """The experience maker over ``models``: KL in the reward (the reference's log-probs shape the rewards), GAE on
    the critic's values, the teacher's top-2 log-probs recorded (its forward runs; where there is one), no step-wide
    statistic."""
    from mmrlhf.algorithms.kl import FixedKLController
    from mmrlhf.experience.fast_maker import FastExperienceMaker
    from mmrlhf.experience.settings import ExperienceSettings
    from mmrlhf.rollout.types import SamplingSettings

    settings = ExperienceSettings(n_samples_per_prompt=2, micro_batch_size=MICRO, need_reference=True,
                                  kl_in_reward=True, distill_topk=2 if models["teacher"] is not None else 0,
                                  advantage_estimator="gae",
                                  advantage_params={"gamma": 1.0, "lam": 0.95})
    return FastExperienceMaker(models["actor"], None, None, None, bundle.processor.tokenizer, settings,
                               SamplingSettings(), initial_model=models["reference"], critic=models["critic"],
                               kl_controller=FixedKLController(0.1), teacher_model=models["teacher"])


def scored_items(maker: Any, rollout: Any, **kwargs: Any) -> dict[int, dict[str, torch.Tensor]]:
    """sample index -> its per-token results (the keys of TOKEN_KEYS it has), from one experiences_from call."""
    from mmrlhf.experience.batching import split_experience

    with torch.no_grad():
        experiences = maker.experiences_from(rollout, MICRO, **kwargs)
    items = [it for e in experiences for it in split_experience(e)]
    return {int(i): {k: it.token[k] for k in TOKEN_KEYS if k in it.token}
            for i, it in zip(rollout.rows.sample_index, items)}
