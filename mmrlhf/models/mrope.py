"""The M-RoPE placement rule, as the rollout engine applies it: 3-D (t, h, w) positions of one token sequence.

Why this module exists: the trainer must score exactly the sequence the engine sampled from, positions included.
transformers 5.19's ``get_rope_index`` continues the text after a vision item at ``start + max(h, w) / merge``;
vLLM (and the original Qwen2-VL / Qwen2.5-VL rule) continues it one past the LARGEST position the item used. The two
agree for images, but not for a video whose temporal positions run past its spatial extent (Qwen2.5-VL scales time
by ``second_per_grid_ts * tokens_per_second``; Qwen2-VL has more temporal patches than rows): every text token after
such a video was shifted, which moved fp32 log-probs by ~5e-3. So the rule is owned here, and the family adapters
(:meth:`~mmrlhf.models.adapters.FamilyAdapter.rope_units`) only say how each vision item is laid out.

The rule, for one unpadded sequence:

- text tokens take consecutive positions, equal on all three axes, starting one past the largest position so far
  (0 at the start);
- a vision unit (``t x h x w`` merged tokens, in the token order t-major, then h, then w) placed at base ``s`` gives
  its tokens ``(s + floor(i_t * time_scale), s + i_h, s + i_w)``; ``s`` is one past the largest position so far;
- vision units are consumed in order, modality by modality: runs of image tokens take the next image units, runs of
  video tokens the next video units (a run may hold several adjacent units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ``mm_token_type_ids`` values (transformers' ``ProcessorMixin.create_mm_token_type_ids``).
TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass(frozen=True)
class VisionUnit:
    """One block of vision tokens placed as a whole: ``t x h x w`` LLM tokens (after spatial merging)."""

    t: int
    h: int
    w: int
    time_scale: float = 1.0  # temporal index i becomes floor(i * time_scale)

    @property
    def num_tokens(self) -> int:
        return self.t * self.h * self.w


def _unit_positions(unit: VisionUnit, base: int) -> torch.Tensor:
    """[3, t*h*w] positions of one unit placed at ``base`` (CPU, long)."""
    # float64 then truncation: the engine multiplies integer indices by a Python float and casts to int64.
    tt = (torch.arange(unit.t, dtype=torch.float64) * unit.time_scale).long()  # [t]
    grid = torch.meshgrid(tt, torch.arange(unit.h), torch.arange(unit.w), indexing="ij")  # 3 x [t, h, w]
    return torch.stack(grid).reshape(3, -1) + base  # [3, t*h*w]


class _Queues:
    """The vision units still to place, per modality, consumed in order across the rows of a batch."""

    names = {IMAGE: "image", VIDEO: "video"}

    def __init__(self, image_units: list[VisionUnit], video_units: list[VisionUnit]) -> None:
        self.left = {IMAGE: list(reversed(image_units)), VIDEO: list(reversed(video_units))}

    def take(self, kind: int, pos: int, run_end: int) -> VisionUnit:
        name = self.names[kind]
        if not self.left[kind]:
            raise ValueError(f"{run_end - pos} {name} tokens at position {pos} have no {name} grid left")
        unit = self.left[kind].pop()
        if pos + unit.num_tokens > run_end:
            raise ValueError(f"the next {name} grid ({unit.num_tokens} tokens) does not fit the run of "
                             f"{run_end - pos} {name} tokens at position {pos}")
        return unit

    def check_empty(self) -> None:
        for kind, left in self.left.items():
            if left:
                raise ValueError(f"{len(left)} {self.names[kind]} grid(s) left over: the sequences have fewer "
                                 f"{self.names[kind]} tokens than their grids need")


def _place(types: torch.Tensor, queues: _Queues) -> torch.Tensor:
    """[3, L] positions of one unpadded sequence of token types [L] (CPU long), taking its units from ``queues``."""
    length = types.numel()
    if length == 0:
        return torch.zeros(3, 0, dtype=torch.long)
    bounds = (torch.nonzero(types[1:] != types[:-1]).reshape(-1) + 1).tolist()
    starts, ends = [0, *bounds], [*bounds, length]
    pieces: list[torch.Tensor] = []
    next_pos = 0  # one past the largest position so far
    for kind, start, end in zip(types[starts].tolist(), starts, ends):
        if kind == TEXT:
            pieces.append(torch.arange(next_pos, next_pos + end - start).expand(3, -1))  # [3, n]
            next_pos += end - start
            continue
        if kind not in _Queues.names:
            raise ValueError(f"token type {kind} at position {start}: expected 0 (text), 1 (image) or 2 (video)")
        pos = start
        while pos < end:
            unit = queues.take(kind, pos, end)
            block = _unit_positions(unit, next_pos)  # [3, t*h*w]
            pieces.append(block)
            next_pos = int(block.max()) + 1
            pos += unit.num_tokens
    return torch.cat(pieces, dim=1)  # [3, L]


def sequence_positions(
    token_types: torch.Tensor, image_units: list[VisionUnit], video_units: list[VisionUnit]
) -> torch.Tensor:
    """[3, L] long positions (CPU) of one unpadded sequence with ``token_types`` [L] (0 text, 1 image, 2 video).

    ``image_units`` / ``video_units``: the sequence's vision units in order. Raises ``ValueError`` when the units
    do not tile the vision-token runs exactly (a grid / token-count mismatch).
    """
    queues = _Queues(image_units, video_units)
    positions = _place(token_types.detach().to("cpu", torch.long).reshape(-1), queues)
    queues.check_empty()
    return positions


def batch_positions(
    token_types: torch.Tensor,
    image_units: list[VisionUnit],
    video_units: list[VisionUnit],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, B, S] long positions (on ``token_types``' device) of rows ``token_types`` [B, S].

    The units of all rows come in row order (row 0's items first), as processors concatenate them.
    ``attention_mask`` [B, S] (0 = padding) may be None; padding gets position 0 (it is never attended).
    """
    batch, seq = token_types.shape
    types = token_types.detach().to("cpu", torch.long)  # [B, S]
    keep = None if attention_mask is None else attention_mask.detach().to("cpu").bool()  # [B, S]
    queues = _Queues(image_units, video_units)
    out = torch.zeros(3, batch, seq, dtype=torch.long)  # [3, B, S]
    for b in range(batch):
        try:
            if keep is None:
                out[:, b] = _place(types[b], queues)
            else:
                out[:, b, keep[b]] = _place(types[b][keep[b]], queues)
        except ValueError as exc:
            raise ValueError(f"M-RoPE positions of row {b}: {exc}") from exc
    queues.check_empty()
    return out.to(token_types.device)
