"""Score TEXT (+ raw images) with a local reward model, by running its own processor first.

A reward server receives prompt and response strings and PIL images, not token ids: the server's model may use a
different tokenizer than the policy. This wrapper turns each sample into ``prompt + response`` token ids and vision
inputs with the model's processor, then scores through :class:`LocalRewardModel` (same batching and device moves).

The response is data, never control: it arrives from the network (a policy's text) and is tokenised on its own with
the tokenizer's special tokens split into plain text, so a response holding ``<|im_end|>`` or a vision block can
neither forge a turn nor add an image placeholder with no image behind it (the processor used to refuse such a
sample, failing the whole request). Only the prompt, the chat template's rendering of the dataset prompt, goes
through the processor with its vision blocks. Tokenised apart, the response's ids never merge with the prompt's,
as the policy's response tokens never do.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrlhf.rewards.local_model import LocalRewardModel
from mmrlhf.rewards.types import RewardBatch, RewardInputError, SourceScores

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""Per-image / per-video processor outputs; per-token ones (``mm_token_type_ids``) are rebuilt by the model."""


class TextRewardModel:
    """``score(batch)`` for batches carrying text and images only (what ``serve-reward`` gets)."""

    def __init__(self, model: LocalRewardModel, processor: Any, *, name: str = "reward_model") -> None:
        self.model = model
        self.processor = processor
        self.name = name

    def tokenize(self, batch: RewardBatch) -> RewardBatch:
        """A copy of ``batch`` with right-padded ``sequences`` / ``attention_mask`` and per-sample ``vision``."""
        rows, vision = [], []
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        for i in range(len(batch)):
            images = (batch.images or [[]] * len(batch))[i] or None
            try:
                enc = self.processor(text=[batch.prompts[i]], images=images, return_tensors="pt")
            except Exception as exc:  # noqa: BLE001 - re-raised with the sample named
                raise RewardInputError(f"{batch.describe(i)}: the reward model's processor failed: {exc}") from exc
            response = tokenizer(batch.responses[i], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            rows.append(torch.cat([enc["input_ids"][0], torch.tensor(response, dtype=enc["input_ids"].dtype)]))
            vision.append({k: v for k, v in enc.items() if k in VISION_KEYS})
        width = max(len(r) for r in rows)
        pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        sequences = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            sequences[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return RewardBatch(
            responses=batch.responses,
            prompts=batch.prompts,
            labels=batch.labels,
            references=batch.references,
            extra=batch.extra,
            sequences=sequences,
            attention_mask=mask,
            vision=vision,
            images=batch.images,
            index=batch.index,
        )

    async def score(self, batch: RewardBatch) -> SourceScores:
        import asyncio

        if len(batch) == 0:
            return SourceScores.empty(0)
        # Tokenizing (image processing included) and the forward both run in a worker thread: the server's event
        # loop keeps answering other requests and /health meanwhile.
        return await asyncio.to_thread(lambda: self.model.score_sync(self.tokenize(batch)))


def load_text_reward_model(
    kind: str, path: str, *, dtype: str = "float32", device: str = "auto", micro_batch_size: int = 8, **options: Any
):
    """Build the ``kind`` reward model from ``path`` and the processor saved there, ready to score text.

    The model is moved to ``device`` once and stays there (a served model shares its device with nothing).
    """
    from transformers import AutoProcessor

    from mmrlhf.rewards.local_model import build_reward_model

    module = build_reward_model(kind, path=path, dtype=dtype, **options)
    processor = AutoProcessor.from_pretrained(path)
    model = LocalRewardModel(module, name=kind, device=device, offload_device=None, micro_batch_size=micro_batch_size)
    return TextRewardModel(model, processor, name=kind)
