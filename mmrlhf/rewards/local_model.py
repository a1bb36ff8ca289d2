"""Local reward models: torch modules scoring token sequences (+ per-sample vision inputs) in this process.

The interface a reward model implements is just ``module(input_ids=[b, S], attention_mask=[b, S], **vision)
-> [b]`` (or ``[b, 1]``) float scores, where ``vision`` holds the micro-batch's processor outputs concatenated
along their first dimension (Qwen-VL's ``pixel_values`` rows and ``image_grid_thw`` images follow the order of the
image tokens in the sequences, so concatenating per-sample inputs in sample order is exactly what the model expects).

Why the model is moved to its device only around scoring: during RL the accelerator is shared with rollout and
training; a reward model parked on ``offload_device`` (CPU) between calls holds no accelerator memory there.
``offload_device=None`` keeps it on its device for good (a reward server, where nothing else shares it).
Kinds are built through ``REWARD_MODELS`` (``qwen_vl_scalar``, or any ``package.module:factory``).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch
from torch import nn

from mmrlhf.devices import resolve_device
from mmrlhf.registry import Registry
from mmrlhf.rewards.types import RewardBatch, RewardError, RewardInputError, SourceScores

REWARD_MODELS: Registry[Callable[..., nn.Module]] = Registry("reward model kind")
"""Builders ``fn(path, dtype, **options) -> nn.Module`` by kind name; ``module:factory`` specs resolve too."""


def collate_vision(vision: list[dict[str, torch.Tensor]], where: list[str]) -> dict[str, torch.Tensor]:
    """Concatenate per-sample vision dicts along dim 0, in sample order (samples without images add nothing).

    A value that is not a tensor, or tensors of one key whose trailing dims differ, is an error naming the sample.
    """
    out: dict[str, list[torch.Tensor]] = {}
    for sample, desc in zip(vision, where):
        if not isinstance(sample, dict):
            raise RewardInputError(f"{desc}: vision must be a dict of tensors, got {type(sample).__name__}")
        for key, value in sample.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise RewardInputError(f"{desc}: vision[{key!r}] must be a tensor with a leading dim")
            first = out.setdefault(key, [])
            if first and first[0].shape[1:] != value.shape[1:]:
                raise RewardInputError(
                    f"{desc}: vision[{key!r}] has trailing shape {tuple(value.shape[1:])}, other samples have "
                    f"{tuple(first[0].shape[1:])}"
                )
            first.append(value)
    return {key: torch.cat(values, dim=0) for key, values in out.items()}


class LocalRewardModel:
    """A reward source wrapping a torch module; see the module docstring for the module's interface."""

    def __init__(
        self,
        module: nn.Module,
        *,
        name: str = "reward_model",
        device: str | torch.device = "auto",
        offload_device: str | torch.device | None = "cpu",
        micro_batch_size: int = 8,
    ) -> None:
        """``offload_device``: where the module waits between calls; None: it stays on ``device``."""
        self.name = name
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.offload_device = self.device if offload_device is None else torch.device(offload_device)
        self.micro_batch_size = micro_batch_size
        self.module = module.to(self.offload_device).eval()
        # One scoring call at a time: concurrent calls (a server's requests) would move the module between
        # devices under each other's feet, and some backbones keep per-forward state (Qwen-VL's rope deltas).
        self._lock = threading.Lock()

    async def score(self, batch: RewardBatch) -> SourceScores:
        import asyncio

        # A thread keeps the event loop free for remote sources while torch computes (it releases the GIL).
        return await asyncio.to_thread(self.score_sync, batch)

    @torch.no_grad()
    def score_sync(self, batch: RewardBatch) -> SourceScores:
        """[b] scores for the batch, in micro-batches; the module visits ``device`` only for this call."""
        n = len(batch)
        if n == 0:
            return SourceScores.empty(0)
        if batch.sequences is None or batch.attention_mask is None:
            raise RewardInputError(f"reward model {self.name!r} needs sequences and attention_mask in the batch")
        vision = batch.vision if batch.vision is not None else [{} for _ in range(n)]
        scores: list[float | None] = []
        errors: list[str | None] = []
        with self._lock:
            self._score_locked(batch, vision, scores, errors)
        return SourceScores(scores=scores, errors=errors)

    def _score_locked(self, batch: RewardBatch, vision: list, scores: list, errors: list) -> None:
        n = len(batch)
        moves = self.offload_device != self.device
        if moves:
            self.module.to(self.device)
        try:
            for start in range(0, n, self.micro_batch_size):
                rows = list(range(start, min(start + self.micro_batch_size, n)))
                out = self._forward(batch, vision, rows)
                for row, value in zip(rows, out.tolist()):
                    ok = math.isfinite(value)
                    scores.append(value if ok else None)
                    errors.append(None if ok else f"{self.name!r} on {batch.describe(row)}: non-finite score {value}")
        finally:
            if moves:
                self.module.to(self.offload_device)

    def _forward(self, batch: RewardBatch, vision: list[dict[str, torch.Tensor]], rows: list[int]) -> torch.Tensor:
        assert batch.sequences is not None and batch.attention_mask is not None
        pick = torch.as_tensor(rows)
        inputs = {
            "input_ids": batch.sequences[pick].to(self.device),
            "attention_mask": batch.attention_mask[pick].to(self.device),
        }
        extra = collate_vision([vision[r] for r in rows], [batch.describe(r) for r in rows])
        inputs.update({k: v.to(self.device) for k, v in extra.items()})
        out = self.module(**inputs)
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == 1:
            out = out[:, 0]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(rows),):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RewardError(
                f"reward model {self.name!r} returned {shape} for {len(rows)} samples, expected [{len(rows)}]"
            )
        return out.detach().float().cpu()


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b] position of the last attended token of each row (works for left and right padding).

    >>> last_token_index(torch.tensor([[0, 1, 1], [1, 1, 0]])).tolist()
    [2, 1]
    """
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * (positions + 1)).argmax(dim=1)


class ScalarHeadRewardModel(nn.Module):
    """A transformer backbone returning hidden states, plus a linear head read at each row's last token.

    Recent transformers need ``mm_token_type_ids`` to place vision tokens in M-RoPE; with a family ``adapter`` they
    are rebuilt here from the ids (:meth:`FamilyAdapter.mm_token_type_ids`) rather than required of every caller
    (the experience maker hands over sequences and vision inputs only).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, adapter: Any = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.score_head = nn.Linear(hidden_size, 1)
        self.adapter = adapter

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **vision: torch.Tensor) -> torch.Tensor:
        if vision and self.adapter is not None and "mm_token_type_ids" not in vision:
            vision["mm_token_type_ids"] = self.adapter.mm_token_type_ids(input_ids)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **vision).last_hidden_state
        last = last_token_index(attention_mask)
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [b, H]
        return self.score_head(picked.to(self.score_head.weight.dtype))[:, 0]


HEAD_FILE = "score_head.safetensors"


@REWARD_MODELS.register("qwen_vl_scalar")
def build_qwen_vl_scalar(path: str, dtype: str = "float32", allow_random_head: bool = False) -> nn.Module:
    """A Qwen-VL checkpoint's language+vision backbone with the scalar head from ``path/score_head.safetensors``.

    A missing head file is an error (an untrained head gives meaningless rewards) unless ``allow_random_head``,
    which tests and demos use. The backbone is loaded with ``AutoModel`` (no language-model head: a reward model
    does not need the vocabulary projection, often the largest matrix), so transformers reports ``lm_head`` as an
    unexpected key: that is intended.
    """
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModel

    if not path:
        raise RewardError("reward model kind 'qwen_vl_scalar' needs 'path' (a Qwen-VL checkpoint directory)")
    backbone = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
    from mmrlhf.models.adapters import get_adapter

    text_config = getattr(backbone.config, "text_config", backbone.config)
    model = ScalarHeadRewardModel(backbone, text_config.hidden_size, get_adapter(backbone.config))
    head_file = Path(path) / HEAD_FILE
    if head_file.is_file():
        model.score_head.load_state_dict({k.removeprefix("score_head."): v for k, v in load_file(head_file).items()})
    elif not allow_random_head:
        raise RewardError(f"{head_file} not found: train a scalar head first, or pass allow_random_head: true")
    return model.to(getattr(torch, dtype))


def build_reward_model(kind: str, path: str = "", dtype: str = "float32", **options: Any) -> nn.Module:
    """Build a reward model of ``kind`` (registered name or ``module:factory``); it must be an ``nn.Module``."""
    builder = REWARD_MODELS.get(kind)
    module = builder(path=path, dtype=dtype, **options)
    if not isinstance(module, nn.Module):
        raise RewardError(f"reward model kind {kind!r} built a {type(module).__name__}, expected a torch nn.Module")
    return module
