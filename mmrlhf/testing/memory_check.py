"""Measuring what the memory plan (:mod:`mmrlhf.models.memory`) estimates: the bytes autograd saves in a forward
(any device, the CPU included), and an update's peak on a device whose allocator keeps a peak statistic.

Used by ``tests/models/test_memory_activations.py`` (saved bytes on the CPU) and by the doctor's ``memory_plan``
row (the peak of two update steps of the toy run's policy against the plan's ``update`` / ``step`` phases).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mmrlhf.models.batch import SamplesVL
from mmrlhf.testing.saved_tensors import saved_tensor_bytes

# The doctor's row passes when the measured peak is within this fraction of the plan's.
PEAK_TOLERANCE = 0.2


def text_batch(vocab: int, rows: int, row_tokens: int, response: int, *, pad: int = 0, seed: int = 0) -> SamplesVL:
    """A padded text-only micro-batch of ``rows`` x ``row_tokens`` random tokens, the last ``response`` of each row
    scored; ``pad`` > 0 left-pads the first row by that many tokens (so the forward builds an attention mask)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(8, max(vocab - 16, 9), (rows, row_tokens), generator=g)
    mask = torch.ones(rows, row_tokens, dtype=torch.long)
    mask[0, :pad] = 0
    return SamplesVL(sequences=seq, attention_mask=mask, action_mask=torch.ones(rows, response, dtype=torch.bool),
                     num_actions=response, packed_seq_lens=None, response_length=torch.full((rows,), response),
                     total_length=mask.sum(1), mm_token_type_ids=torch.zeros(rows, row_tokens, dtype=torch.long))


def packed_batch(vocab: int, lengths: list[int], responses: list[int], *, seed: int = 0) -> SamplesVL:
    """A packed micro-batch (one row, no padding) of samples of ``lengths`` tokens, the last ``responses`` scored."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    seq = torch.randint(8, max(vocab - 16, 9), (1, total), generator=g)
    index = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    return SamplesVL(sequences=seq, attention_mask=index, action_mask=None, num_actions=torch.tensor(responses),
                     packed_seq_lens=torch.tensor(lengths), response_length=torch.tensor(responses),
                     total_length=torch.tensor(lengths), mm_token_type_ids=torch.zeros(1, total, dtype=torch.long))


def image_batch(adapter: Any, vocab: int, rows: int, row_tokens: int, response: int, grid: tuple[int, int, int],
                *, seed: int = 0) -> tuple[SamplesVL, int]:
    """A padded micro-batch whose every row starts with one image of ``grid`` (t, h, w) patches; returns the batch
    and its patch count. The image's pad tokens sit right after a vision-start token, as the processor puts them."""
    batch = text_batch(vocab, rows, row_tokens, response, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    specials = torch.tensor(sorted(adapter.vision_special_token_ids()))
    seq = batch.sequences
    seq[torch.isin(seq, specials)] = 8
    t, h, w = grid
    tokens = t * h * w // adapter.merge_factor
    seq[:, 1] = adapter.vision_start_token_id
    seq[:, 2:2 + tokens] = adapter.image_token_id
    seq[:, 2 + tokens] = adapter.vision_end_token_id
    batch.mm_token_type_ids[:, 2:2 + tokens] = 1
    dim = 3 * adapter.temporal_patch_size * adapter.patch_size**2
    patches = rows * t * h * w
    batch.pixel_values = torch.randn(patches, dim, generator=g)
    batch.image_grid_thws = torch.tensor([list(grid)] * rows)
    batch.image_num, batch.video_num = [1] * rows, [0] * rows
    return batch, patches


def saved_bytes(model: torch.nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes of the tensors autograd saves for the backward while ``forward()`` runs, each storage once, the
    model's own parameters excluded (they exist anyway; cast copies of them are counted)."""
    return saved_tensor_bytes(forward, exclude=model.parameters())[1]


def memory_statistic(device: torch.device) -> tuple[Callable[[], None], Callable[[], int]] | None:
    """(reset the peak, read the peak in bytes) of ``device``'s allocator, through ``torch.accelerator`` or the
    device's own module (``torch.cuda``, ``torch.xpu``, ...); None where there is no such statistic (the CPU)."""
    if device.type == "cpu":
        return None
    for module in (getattr(torch, "accelerator", None), getattr(torch, device.type, None)):
        reset = getattr(module, "reset_peak_memory_stats", None)
        peak = getattr(module, "max_memory_allocated", None)
        if reset is not None and peak is not None:
            sync = getattr(module, "synchronize", lambda *a: None)
            args = () if device.index is None else (device.index,)  # None: the current device

            def do_reset(reset=reset, sync=sync) -> None:
                sync(*args)
                reset(*args)

            def do_peak(peak=peak, sync=sync) -> int:
                sync(*args)
                return int(peak(*args))

            return do_reset, do_peak
    return None


def compare_peak(predicted: int, measured: int, tolerance: float = PEAK_TOLERANCE) -> tuple[str, float]:
    """(``pass`` | ``fail``, measured / predicted): the plan passes when the measured peak lies within
    ``tolerance`` of its prediction."""
    ratio = measured / max(predicted, 1)
    return ("pass" if abs(ratio - 1.0) <= tolerance else "fail"), ratio


def measure_update_peak(config: Any, stat: tuple[Callable[[], None], Callable[[], int]], *, rows: int,
                        row_tokens: int, response: int, steps: int = 2) -> int:
    """The allocator's peak over ``steps`` updates of ``config``'s policy built as the trainer builds it (its
    precision, freezing, LoRA), each one forward and backward of a padded ``rows x row_tokens`` micro-batch and
    an AdamW step: from the first byte of the model on (the second step has the moments resident)."""
    from mmrlhf.devices import resolve_device
    from mmrlhf.experience.builder import build_policy
    from mmrlhf.trainer.optim import build_optimizer, freeze_vision

    t = config.trainer
    reset, peak = stat
    device = resolve_device(t.device)
    reset()

    def freeze(actor: Any) -> None:
        freeze_vision(actor.model, actor.adapter, tower=t.freeze_vision_tower, merger=t.freeze_merger)

    actor, _ = build_policy(config, None, device=device, before_adapters=freeze)
    actor.eval()
    optimizer = build_optimizer(actor.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=t.adam_betas,
                                eps=t.adam_eps)
    vocab = actor.model.config.get_text_config().vocab_size
    for step in range(steps):
        batch = text_batch(vocab, rows, row_tokens, response, pad=1, seed=step)
        actor(batch).log_probs.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result = peak()
    del actor, optimizer
    return result
