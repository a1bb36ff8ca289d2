"""Re-batching for training: items split from experience and collated again (any order, other micro-batch sizes,
padded, packed or grouped by shared prompt) reproduce the forward the experience was scored with."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor

from mmrlhf.data.processor import MultimodalDataProcessor
from mmrlhf.experience.batching import collate, split_experience
from mmrlhf.experience.naive_maker import NaiveExperienceMaker
from mmrlhf.experience.settings import ExperienceSettings
from mmrlhf.models.actor import ActorVL
from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.types import SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir
from maker_helpers import RecordingReward, mixed_batch, reward_engine


def _experiences(family: str, packing: bool):
    path = str(tiny_model_dir(family))
    processor = AutoProcessor.from_pretrained(path)
    adapter = get_adapter(path)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    settings = ExperienceSettings(n_samples_per_prompt=2, micro_batch_size=3, packing=packing, compute_entropy=True)
    maker = NaiveExperienceMaker(actor, MultimodalDataProcessor(processor, 2048, adapter),
                                 reward_engine(RecordingReward()), processor.tokenizer, settings,
                                 SamplingSettings(max_new_tokens=6, seed=3), mode="grpo",
                                 inference_batch_size=5, logits_forward_batch_size=3)
    prompts, images, videos, refs, _ = mixed_batch()
    return actor, processor, maker.make_experience_list(prompts, images=images, videos=videos, references=refs)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("packed", [False, True])
def test_split_and_collate_reproduce_the_scored_log_probs(family, packed):
    actor, processor, exps = _experiences(family, packing=packed)
    items = [it for e in exps for it in split_experience(e)]
    assert len(items) == sum(int(e.info["response_length"].shape[0]) for e in exps) == 10
    assert any(it.vision_extra for it in items) == (family == "qwen2_5_vl")  # video extras travel per sample
    order = [7, 2, 9, 0, 5, 1, 8, 3, 6, 4]  # shuffled, other micro-batch sizes, the other layouts too
    orders = {"scattered": order, "grouped": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}  # siblings together: shared rows
    for layout, shared in ((packed, False), (not packed, False), (False, True)):
        for start in range(0, 10, 4):
            chosen = [items[i] for i in orders["grouped" if shared and start == 0 else "scattered"][start:start + 4]]
            batch = collate(chosen, packed=layout, pad_id=processor.tokenizer.pad_token_id, adapter=actor.adapter,
                            shared_prompt=shared)
            if shared and start == 0:
                assert batch.samples.num_rows == 2  # 2 prompts x 2 samples: one row each
            with torch.no_grad():
                out = actor(batch.samples, vision_extra=batch.vision_extra)
            m = batch.token["loss_mask"]
            assert torch.equal(batch.samples.response_length, torch.tensor([len(it.response_ids) for it in chosen]))
            torch.testing.assert_close(out.log_probs[m], batch.token["action_log_probs"][m], atol=2e-5, rtol=0)
            assert torch.equal(batch.info["group"], torch.stack([it.info["group"] for it in chosen]))
    # control: the same sample with other pixels (same grids) must not reproduce its log-probs
    a = items[2]
    assert a.vision
    blanked = type(a)(a.prompt_ids, a.response_ids, {**a.vision, "pixel_values": torch.zeros_like(
        a.vision["pixel_values"])}, a.vision_extra, a.token, a.info)
    batch = collate([blanked], packed=False, pad_id=processor.tokenizer.pad_token_id, adapter=actor.adapter)
    with torch.no_grad():
        out = actor(batch.samples)
    m = batch.token["loss_mask"]
    assert (out.log_probs[m] - batch.token["action_log_probs"][m]).abs().max() > 1e-3

def test_collate_refuses_mismatched_items():
    actor, processor, exps = _experiences("qwen2_vl", packing=False)
    items = split_experience(exps[0])
    del items[1].token["action_entropy"]
    with pytest.raises(ValueError, match="action_entropy"):
        collate(items[:2], packed=False, pad_id=0, adapter=actor.adapter)
    with pytest.raises(ValueError, match="at least one"):
        collate([], packed=False, pad_id=0, adapter=actor.adapter)
