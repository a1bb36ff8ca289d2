"""Per-family adapters: everything that differs between Qwen-VL generations lives here, nowhere else.

The rest of the framework asks an adapter for token ids, the spatial merge size, how many pad tokens a vision grid
expands to, which tokens generation must never sample, and how to hand a video to vLLM. Nothing outside this
module tests a model name or hard-codes a merge factor (the classic ``// 4`` bug assumes ``spatial_merge_size=2``).

Adapters are registered by family name in :data:`ADAPTERS` and selected from the model config's ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import torch

from mmrlhf.models.mrope import IMAGE, TEXT, VIDEO, VisionUnit, batch_positions
from mmrlhf.registry import Registry

ADAPTERS: Registry[type["FamilyAdapter"]] = Registry("model family")


@dataclass(frozen=True)
class FamilyAdapter:
    """Facts about one loaded model, read from its HF config (``config.json``)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    temporal_patch_size: int
    patch_size: int
    # Temporal positions per second of video (Qwen2.5-VL's ``vision_config.tokens_per_second``); 1 where the config
    # has none, as the engine assumes.
    tokens_per_second: float = 1.0

    family: ClassVar[str] = "base"
    model_types: ClassVar[tuple[str, ...]] = ()
    # vLLM needs video metadata (fps, frame indices) for some families; see ``vllm_video``.
    vllm_video_needs_metadata: ClassVar[bool] = False
    # How the family writes bounding boxes (tools that crop read it from ToolContext.box_space): "relative1000"
    # (0-1000 of the image: Qwen2-VL, Qwen3-VL) or "absolute" (pixels of the image as the model saw it, after the
    # processor's resize: Qwen2.5-VL).
    box_space: ClassVar[str] = "relative1000"
    # Decoder layers that carry a recurrent state (Gated DeltaNet linear attention) besides attention: packed rows
    # must restart that state at every sequence boundary, and a shared prompt hands its state to each response.
    recurrent_layers: ClassVar[bool] = False
    # Decoder MLPs that route tokens to experts (routing replay, load-balancing loss, expert metrics apply).
    routed_experts: ClassVar[bool] = False
    # Whether a prompt with videos can go to the engine as token ids (one pad per video, which vLLM expands as the
    # processor did). False where the expansion interleaves frame-timestamp text with the pads (Qwen3-VL and the
    # families built on it): such prompts go as text, which a multi-turn rollout (token ids in, token ids out)
    # cannot do. Read from the class alone, so the refusal comes before any model loads (mmrlhf.trainer.preflight).
    video_token_prompts: ClassVar[bool] = True

    @classmethod
    def from_hf_config(cls, config: Any) -> "FamilyAdapter":
        vision = _get(config, "vision_config")
        return cls(
            image_token_id=int(_get(config, "image_token_id")),
            video_token_id=int(_get(config, "video_token_id")),
            vision_start_token_id=int(_get(config, "vision_start_token_id")),
            vision_end_token_id=int(_get(config, "vision_end_token_id")),
            spatial_merge_size=int(_get(vision, "spatial_merge_size")),
            temporal_patch_size=int(_get(vision, "temporal_patch_size")),
            patch_size=int(_get(vision, "patch_size")),
            tokens_per_second=float(_get(vision, "tokens_per_second", default=1.0)),
        )

    # ---- vision token bookkeeping -------------------------------------------------------------------------
    @property
    def merge_factor(self) -> int:
        """Patches merged into one LLM token (``spatial_merge_size ** 2``)."""
        return self.spatial_merge_size**2

    def tokens_per_grid(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Pad tokens each vision item expands to. ``grid_thw``: [N, 3] (t, h, w patches) -> [N]."""
        grid = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
        return grid.prod(dim=-1) // self.merge_factor

    def engine_prompt_ids(self, ids: Sequence[int]) -> list[int] | None:
        """The processor's prompt ids (vision pads expanded) in the form vLLM expands itself: one pad token per
        image / video. Sending ids instead of text lets the engine see exactly the processor's (possibly
        left-truncated) prompt. None where the family's expansion is not a plain run of pads (a video of a family
        without :attr:`video_token_prompts`: the caller then sends the prompt text)."""
        if not self.video_token_prompts and self.video_token_id in ids:
            return None
        return self.collapse_vision_pads(ids)

    def collapse_vision_pads(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with every run of image / video pad tokens reduced to one pad (the chat template's form)."""
        pads = (self.image_token_id, self.video_token_id)
        out: list[int] = []
        for tok in ids:
            if tok in pads and out and out[-1] == tok:
                continue
            out.append(int(tok))
        return out

    def mm_token_type_ids(self, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor | list[int]:
        """Modality of every token (same shape as ``input_ids``): image pad 1, video pad 2, anything else 0, the
        values transformers' processors return. The one place they are rebuilt from ids (responses and padding are
        appended after processing, and reward models receive ids only); a list gives a list."""
        if not isinstance(input_ids, torch.Tensor):
            return [IMAGE if t == self.image_token_id else VIDEO if t == self.video_token_id else TEXT
                    for t in input_ids]
        types = torch.full_like(input_ids, TEXT, dtype=torch.long)  # [..., S]
        types[input_ids == self.image_token_id] = IMAGE
        types[input_ids == self.video_token_id] = VIDEO
        return types

    def vision_special_token_ids(self) -> list[int]:
        """Tokens a response must never contain: sampling one breaks the next forward (feature/token mismatch)."""
        return [self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id]

    # ---- video metadata quirks ----------------------------------------------------------------------------
    # Some families need the video's fps and frame indices: vLLM to compute temporal positions (Qwen2.5-VL,
    # Qwen3-VL), the HF processor for Qwen2.5-VL's ``second_per_grid_ts`` (else it assumes its default fps and the
    # trainer's temporal positions differ from the engine's) and for Qwen3-VL's frame timestamps in the prompt.
    processor_needs_video_metadata: ClassVar[bool] = False

    @staticmethod
    def video_metadata(num_frames: int, fps: float, frame_indices: Sequence[int] | None = None) -> dict[str, Any]:
        return {
            "fps": float(fps),
            "total_num_frames": int(num_frames),
            "frames_indices": list(frame_indices) if frame_indices is not None else list(range(num_frames)),
            "duration": num_frames / float(fps),
        }

    def vllm_video(self, frames: Any, fps: float, frame_indices: Sequence[int] | None = None) -> Any:
        """The object vLLM's ``multi_modal_data["video"]`` takes for one video of ``frames`` ([T, H, W, 3])."""
        if not self.vllm_video_needs_metadata:
            return frames
        meta = self.video_metadata(len(frames), fps, frame_indices)
        meta.update(video_backend="decord", do_sample_frames=False)
        return frames, meta

    # ---- M-RoPE position ids (the engine's rule, see mmrlhf.models.mrope) ------------------------------------
    # Per-video processor outputs the family's positions read besides the grids (one value per video).
    rope_video_keys: ClassVar[tuple[str, ...]] = ()

    def rope_units(
        self,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        **rope_extra: torch.Tensor,
    ) -> tuple[list[VisionUnit], list[VisionUnit]]:
        """How one sequence's vision items are placed: (image units, video units), in order.

        ``*_grid_thw`` [N, 3] are patch grids; units count merged LLM tokens. An image is one ``1 x h x w`` unit; a
        video one ``t x h x w`` unit whose temporal index is scaled by ``tokens_per_second`` times its
        ``second_per_grid_ts`` where the family reads that key (:attr:`rope_video_keys`), else by
        ``tokens_per_second`` alone (1 unless the config sets it), as the engine does.
        """
        m = self.spatial_merge_size
        images = [VisionUnit(int(t), int(h) // m, int(w) // m) for t, h, w in _grid_rows(image_grid_thw)]
        grids = _grid_rows(video_grid_thw)
        seconds = rope_extra.get("second_per_grid_ts") if "second_per_grid_ts" in self.rope_video_keys else None
        seconds = [1.0] * len(grids) if seconds is None else torch.as_tensor(seconds).reshape(-1).tolist()
        if len(seconds) != len(grids):
            raise ValueError(f"second_per_grid_ts has {len(seconds)} values for {len(grids)} videos")
        videos = [VisionUnit(int(t), int(h) // m, int(w) // m, float(sec) * self.tokens_per_second)
                  for (t, h, w), sec in zip(grids, seconds)]
        return images, videos

    def rope_index(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **rope_extra: torch.Tensor,
    ) -> torch.Tensor:
        """3-D (t, h, w) position ids [3, B, S] (long, on ``input_ids``' device) of rows ``input_ids`` [B, S].

        The rule is the rollout engine's (:mod:`mmrlhf.models.mrope`), not the installed transformers' own
        ``get_rope_index``, which places text after a video differently. ``mm_token_type_ids`` [B, S] (0 text,
        1 image, 2 video); grids are the vision items of all rows in order; ``attention_mask`` [B, S] (0 = padding,
        position 0 there) may be None; ``rope_extra`` holds the per-video keys of :attr:`rope_video_keys` (one
        value per video of all rows; others are ignored).
        """
        if mm_token_type_ids.shape != input_ids.shape:
            raise ValueError(f"mm_token_type_ids {tuple(mm_token_type_ids.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}")
        extra = {k: v for k, v in rope_extra.items() if k in self.rope_video_keys and v is not None}
        images, videos = self.rope_units(image_grid_thw, video_grid_thw, **extra)
        return batch_positions(mm_token_type_ids, images, videos, attention_mask).to(input_ids.device)  # [3, B, S]

    # ---- trainable parts ----------------------------------------------------------------------------------
    # Attribute of the base model holding the vision tower, and the tower's attributes that project vision
    # features into the language model (trained by default even when the tower is frozen).
    vision_attr: ClassVar[str] = "visual"
    merger_attrs: ClassVar[tuple[str, ...]] = ("merger",)

    def vision_parts(self, model: Any) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
        """(the vision tower, its merger modules) of a ``...ForConditionalGeneration`` model or its base model.
        The mergers are submodules of the tower: freezing "the tower but not the merger" means the tower's other
        parameters."""
        base = model if hasattr(model, self.vision_attr) else model.base_model
        tower = getattr(base, self.vision_attr, None)
        if tower is None:
            raise ValueError(f"{type(model).__name__} has no vision tower at .{self.vision_attr} ({self.family})")
        mergers = []
        for attr in self.merger_attrs:
            part = getattr(tower, attr, None)
            if part is None:
                raise ValueError(f"{self.family} vision tower has no .{attr}")
            mergers.append(part)
        return tower, mergers

    # ---- weight names the rollout engine loads --------------------------------------------------------------
    def engine_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs of the trainer's module (transformers' in-memory names and layouts) in the form
        the family's checkpoints store them, which is the form the engine's loader reads (a weight sync sends what
        a fresh engine would load from disk). Identity unless the family stores a weight differently."""
        for name, tensor in named:
            yield from self.engine_weight(name, tensor)

    def engine_weight(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor)]

    def processor_video_kwargs(self, videos: Sequence[Any], fps: float) -> dict[str, Any]:
        """Extra keyword arguments for the HF processor call that carries ``videos`` (already-sampled frames)."""
        if not videos or not self.processor_needs_video_metadata:
            return {}
        return {"video_metadata": [self.video_metadata(len(v), fps) for v in videos]}


def _grid_rows(grid_thw: torch.Tensor | None) -> list[list[int]]:
    """[N, 3] grid (or None) -> N (t, h, w) lists."""
    return [] if grid_thw is None else torch.as_tensor(grid_thw).reshape(-1, 3).tolist()


def _get(obj: Any, key: str, default: Any = None) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
    value = default if value is None else value
    if value is None:
        raise ValueError(f"model config has no {key!r}: not a Qwen-VL style vision-language model?")
    return value


@ADAPTERS.register("qwen2_vl")
@dataclass(frozen=True)
class Qwen2VLAdapter(FamilyAdapter):
    family = "qwen2_vl"
    model_types = ("qwen2_vl",)


@ADAPTERS.register("qwen2_5_vl")
@dataclass(frozen=True)
class Qwen25VLAdapter(FamilyAdapter):
    family = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    vllm_video_needs_metadata = True
    processor_needs_video_metadata = True  # its second_per_grid_ts comes from the video's fps
    box_space = "absolute"  # Qwen2.5-VL grounds boxes in the resized image's pixels
    rope_video_keys = ("second_per_grid_ts",)  # seconds per temporal patch: scales video time positions


@ADAPTERS.register("qwen3_vl")
@dataclass(frozen=True)
class Qwen3VLAdapter(FamilyAdapter):
    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    vllm_video_needs_metadata = True
    processor_needs_video_metadata = True
    merger_attrs = ("merger", "deepstack_merger_list")  # deepstack features enter the decoder through their own
    video_token_prompts = False  # a video's expansion interleaves frame-timestamp text with the pads

    def rope_units(
        self, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None, **rope_extra: torch.Tensor
    ) -> tuple[list[VisionUnit], list[VisionUnit]]:
        """Videos are placed frame by frame (one ``1 x h x w`` unit per temporal patch, no time scaling): the
        prompt separates frames with timestamp text, which carries the time instead."""
        images, videos = super().rope_units(image_grid_thw, video_grid_thw)
        frames = [VisionUnit(1, v.h, v.w) for v in videos for _ in range(v.t)]
        return images, frames


@ADAPTERS.register("qwen3_vl_moe")
@dataclass(frozen=True)
class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    """Qwen3-VL's vision side and prompts; the decoder's MLPs are routed experts."""

    family = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    routed_experts = True

    def engine_weight(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        # The checkpoints store the fused experts transposed: gate_up_proj [E, hidden, 2 * inter] and down_proj
        # [E, inter, hidden]; transformers holds [E, 2 * inter, hidden] / [E, hidden, inter].
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return [(name, tensor.transpose(1, 2))]
        return [(name, tensor)]


@ADAPTERS.register("qwen3_5")
@dataclass(frozen=True)
class Qwen35Adapter(Qwen3VLAdapter):
    """Qwen3.5: Qwen3-VL's processor and positions, a vision tower without deepstack mergers, and a hybrid decoder
    (Gated DeltaNet linear attention between gated full-attention layers)."""

    family = "qwen3_5"
    model_types = ("qwen3_5",)
    merger_attrs = ("merger",)
    recurrent_layers = True


@ADAPTERS.register("qwen3_5_moe")
@dataclass(frozen=True)
class Qwen35MoeAdapter(Qwen35Adapter):
    """Qwen3.5's hybrid decoder with routed experts and a gated shared expert in every layer."""

    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    routed_experts = True

    def engine_weight(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        # The checkpoints store one module per expert; transformers fuses them: gate_up_proj [E, 2 * inter, hidden]
        # (gate rows first) and down_proj [E, hidden, inter].
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            return [(name, tensor)]
        if kind == "down_proj":
            return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
        gate, up = tensor.chunk(2, dim=1)  # [E, inter, hidden] each
        return [pair for e in range(tensor.shape[0])
                for pair in ((f"{prefix}.{e}.gate_proj.weight", gate[e]), (f"{prefix}.{e}.up_proj.weight", up[e]))]


def family_of(config: Any) -> str:
    """Adapter name for an HF config (object or dict) by its ``model_type``."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    for name in ADAPTERS:
        if model_type in ADAPTERS.get(name).model_types:
            return name
    raise ValueError(
        f"no model-family adapter for model_type {model_type!r}; supported families: {', '.join(ADAPTERS)}"
    )


def adapter_class(model_dir: str | Path) -> type[FamilyAdapter] | None:
    """The adapter class of a model directory's ``config.json``, or None where no adapter claims its model type
    (or the directory has no config: a hub name, left to vLLM)."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    model_type = json.loads(path.read_text()).get("model_type")
    for name in ADAPTERS:
        if model_type in ADAPTERS.get(name).model_types:
            return ADAPTERS.get(name)
    return None


def family_class(model_dir: str | Path, family: str = "auto") -> type[FamilyAdapter] | None:
    """The adapter class of ``family`` (``model.family``), or under ``auto`` of ``model_dir``'s ``config.json`` (None:
    no config there, or a model type no adapter claims). Read from the config alone, before any model loads."""
    return adapter_class(model_dir) if family == "auto" else ADAPTERS.get(family)


def has_recurrent_layers(model_dir: str | Path, family: str = "auto") -> bool:
    """Whether the family (``family``, or ``model_dir``'s ``config.json`` under ``auto``) has recurrent decoder layers;
    False for a model no adapter knows. Read from the config alone, before any model loads (layout decisions)."""
    cls = family_class(model_dir, family)
    return bool(cls is not None and cls.recurrent_layers)


def get_adapter(config: Any, family: str = "auto") -> FamilyAdapter:
    """The adapter for ``config`` (an HF config object, its dict, or a model directory).

    ``family="auto"`` picks by ``model_type``; an explicit name must exist in :data:`ADAPTERS`.
    """
    if isinstance(config, (str, Path)):
        import json

        config = json.loads((Path(config) / "config.json").read_text())
    name = family_of(config) if family == "auto" else family
    return ADAPTERS.get(name).from_hf_config(config)
