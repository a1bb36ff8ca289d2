"""NaiveExperienceMaker (transformers generate): GRPO and PPO modes; PPO's GAE equals a loop reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor

from mmrlhf.algorithms.kl import FixedKLController
from mmrlhf.data.processor import MultimodalDataProcessor
from mmrlhf.experience.naive_maker import NaiveExperienceMaker
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.models.critic import CriticVL
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir
from maker_helpers import RecordingReward, mixed_batch, reward_engine


@pytest.fixture(scope="module")
def parts():
    path = str(tiny_model_dir("qwen2_5_vl"))
    processor = AutoProcessor.from_pretrained(path)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    return path, get_adapter(path), processor, actor


def _gae_loop(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            nxt = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * nxt - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_ppo_mode_gae_matches_a_loop(parts):
    path, adapter, processor, actor = parts
    critic = CriticVL(ActorVL.from_pretrained(path, dtype=torch.float32))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # non-zero values so GAE depends on them
    settings = ExperienceSettings(n_samples_per_prompt=1, micro_batch_size=2)
    maker = NaiveExperienceMaker(actor, MultimodalDataProcessor(processor, 2048, adapter),
                                 reward_engine(RecordingReward()), processor.tokenizer, settings,
                                 SamplingSettings(max_new_tokens=8, seed=1), mode="ppo", critic=critic,
                                 gamma=0.9, lam=0.8, inference_batch_size=2, logits_forward_batch_size=2)
    prompts, images, videos, refs, _ = mixed_batch()
    exps = maker.make_experience_list(prompts, images=images, videos=videos, references=refs)
    assert sum(e.sequences.shape[0] for e in exps) == len(prompts)
    for e in exps:
        mask = e.action_mask
        assert e.values is not None and torch.any(e.values[mask] != 0)
        token_rewards = torch.zeros_like(e.values)
        last = mask.sum(1) - 1
        token_rewards[torch.arange(len(last)), last] = e.info["reward"]
        expected = _gae_loop(token_rewards, e.values, mask, 0.9, 0.8)
        assert torch.allclose(e.advantages, expected, atol=1e-5)
        assert torch.allclose(e.returns[mask], (expected + e.values)[mask], atol=1e-5)


def test_grpo_mode_groups_and_kl(parts):
    path, adapter, processor, actor = parts
    ref = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    settings = ExperienceSettings(n_samples_per_prompt=4, need_reference=True, kl_in_reward=True)
    maker = NaiveExperienceMaker(actor, MultimodalDataProcessor(processor, 2048, adapter),
                                 reward_engine(RecordingReward()), processor.tokenizer, settings,
                                 SamplingSettings(max_new_tokens=8, seed=2), mode="grpo", initial_model=ref,
                                 kl_controller=FixedKLController(0.1), inference_batch_size=3,
                                 logits_forward_batch_size=5)
    prompts, images, videos, refs, _ = mixed_batch()
    exps = maker.make_experience_list(prompts[:3], images=images[:3], references=refs[:3])
    assert [e.sequences.shape[0] for e in exps] == [5, 5, 2]  # 12 samples, forward batches of 5
    seq_adv = torch.cat([e.advantages.sum(1) / e.action_mask.sum(1).clamp(min=1) for e in exps])
    assert torch.allclose(seq_adv.view(3, 4).sum(1), torch.zeros(3), atol=1e-4)
    # Same weights for actor and reference: the KL is exactly zero.
    assert all(torch.allclose(e.kl, torch.zeros_like(e.kl)) for e in exps)
    with pytest.raises(ValueError, match="needs a critic"):
        NaiveExperienceMaker(actor, None, None, processor.tokenizer, settings, SamplingSettings(), mode="ppo")
    with pytest.raises(ValueError, match="unknown mode"):
        NaiveExperienceMaker(actor, None, None, processor.tokenizer, settings, SamplingSettings(), mode="dpo")
