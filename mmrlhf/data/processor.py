"""``MultimodalDataProcessor``: prompts (+ images / videos / references / labels) -> per-sample model inputs.

What it does, and why each step is shaped the way it is:

1. Each prompt is checked (placeholders vs items), its images / videos are loaded under the guard rails, and its
   text is rendered (chat template) ONCE. A bad prompt raises naming it, or is skipped and counted.
2. Text-only prompts go through the tokenizer in one call, prompts with vision through the HF processor in one call
   (it expands each pad token to the item's merged-patch count and returns pixel values and ``grid_thw``). If
   that call fails, the prompts are retried one at a time so the error names the prompt that caused it.
3. Every prompt's vision tensors are cut out of the batch tensors by grid products (segment sums, one split),
   and its pad-token counts are checked against ``tokens_per_grid`` from the family adapter: a mismatch is an
   error naming the prompt now, instead of "image features and image tokens do not match" deep in a forward.
4. Over-long prompts lose their oldest USER text tokens (vision blocks, chat structure and the system turn are never
   cut), or are skipped, or raise. A truncated prompt's text is rebuilt from its ids and checked to re-tokenise to
   exactly them, because engines that take text (vLLM for Qwen3-VL videos) re-run the processor on it.
5. Prompts are expanded ``n_samples_per_prompt`` times by reference: the n samples share one set of tensors.

All of it is linear in the number of prompts, items and tokens (no list membership tests, no ``sum(lists, [])``).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from mmrlhf.data.errors import DataError, SkipLog
from mmrlhf.data.prompts import PromptRenderer
from mmrlhf.data.records import as_image_list, as_video_list, check_slots, items_from_parts
from mmrlhf.data.truncation import collapse_vision_blocks, structure_mask, truncate_text_left, warn_truncated
from mmrlhf.data.types import IMAGE_KEYS, VIDEO_KEYS, LoadedVideo, MultimodalBatch, PromptRecord, VisionInputs
from mmrlhf.data.vision import VisionLoader, VisionSettings

# Turns that left truncation keeps whole (by the role written in the turn header): the task's instructions.
_KEPT_ROLES = frozenset({"system"})
# Extra text tokens left truncation may drop so that the rebuilt text re-tokenises to the kept ids (a cut inside a
# multi-byte character, or text that merges with the header, round-trips only from the next boundary on).
_MAX_EXTRA_DROPS = 8


@dataclass
class _Prompt:
    """One kept prompt while it is being processed."""

    index: int
    record_id: Any
    text: str
    images: list
    videos: list[LoadedVideo]
    reference: Any
    label: Any
    ids: list[int] = field(default_factory=list)
    mm_types: list[int] = field(default_factory=list)
    vision: VisionInputs = field(default_factory=dict)
    expected_pads: dict = field(default_factory=dict)  # pad token id -> count its grids imply
    failed: bool = False  # the HF processor rejected it (skip mode)
    position: int = -1  # its position in the input batch


class MultimodalDataProcessor:
    """Splits text-only from vision prompts, processes each kind once, and merges them back in order.

    Args:
        processor: the model's HF processor (``AutoProcessor.from_pretrained(model_dir)``); its tokenizer is used
            for text-only prompts unless ``tokenizer`` is given.
        prompt_max_len: maximum prompt length in tokens, vision tokens included (this argument, not
            ``data_config.prompt_max_len``, is used: the trainer may budget prompt and response together).
        adapter: the model family's :class:`~mmrlhf.models.adapters.FamilyAdapter` (token ids, merge size).
        data_config: a :class:`~mmrlhf.config.data.DataConfig` (placeholders, chat template, vision knobs,
            ``on_bad_input``, ``prompt_overflow``); defaults apply when None.
    """

    def __init__(self, processor: Any, prompt_max_len: int, adapter: Any, *, tokenizer: Any = None,
                 data_config: Any = None, vision_loader: Optional[VisionLoader] = None,
                 skips: Optional[SkipLog] = None) -> None:
        if data_config is None:
            from mmrlhf.config.data import DataConfig

            data_config = DataConfig(prompt_max_len=prompt_max_len)
        self.processor = processor
        self.tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", processor)
        self.prompt_max_len = prompt_max_len
        self.adapter = adapter
        self.config = data_config
        self.loader = vision_loader or VisionLoader(VisionSettings.from_config(data_config, adapter))
        self.skips = skips if skips is not None else SkipLog(data_config.on_bad_input)
        seq = self.tokenizer.convert_ids_to_tokens(
            [adapter.vision_start_token_id, adapter.image_token_id, adapter.video_token_id,
             adapter.vision_end_token_id])
        owner = processor if getattr(processor, "chat_template", None) else self.tokenizer
        self.renderer = PromptRenderer(
            owner, apply_chat_template=data_config.apply_chat_template,
            image_placeholder=data_config.image_placeholder, video_placeholder=data_config.video_placeholder,
            system_prompt=data_config.system_prompt, template_kwargs=data_config.chat_template_kwargs,
            image_sequence=seq[0] + seq[1] + seq[3], video_sequence=seq[0] + seq[2] + seq[3])
        # Tokens that belong to a vision block; left truncation never removes them.
        self._vision_ids = frozenset((adapter.image_token_id, adapter.video_token_id,
                                      adapter.vision_start_token_id, adapter.vision_end_token_id))
        # ... nor the chat structure (special tokens, role headers): see ``structure_mask``.
        self._special_ids = frozenset(self.tokenizer.all_special_ids) | frozenset(
            self.tokenizer.convert_tokens_to_ids(t) for t in self.tokenizer.get_added_vocab()
            if t.startswith("<|") and t.endswith("|>"))
        self._is_newline = functools.lru_cache(maxsize=None)(lambda t: "\n" in self.tokenizer.decode([t]))
        self._pad_ids = frozenset((adapter.image_token_id, adapter.video_token_id))
        # Videos reach the processor already sized under data.video_max_tokens (the loader applies the budget, so
        # that vLLM, given the same frames, sees the same sizes). Video processors that leave their own total-pixel
        # cap unset warn on every run and then run uncapped: say "uncapped" explicitly, which is what they (and
        # vLLM's copy of them) do anyway. A processor configured either way is left alone.
        video_processor = getattr(processor, "video_processor", None)
        self._video_call_kwargs: dict[str, Any] = {}
        if video_processor is not None and getattr(video_processor, "cap_pixels_per_frame", False) is None:
            self._video_call_kwargs["cap_pixels_per_frame"] = False

    @classmethod
    def from_config(cls, processor: Any, adapter: Any, data_config: Any, **kwargs: Any) -> "MultimodalDataProcessor":
        """Build from a :class:`~mmrlhf.config.data.DataConfig` (``prompt_max_len`` taken from it)."""
        return cls(processor, data_config.prompt_max_len, adapter, data_config=data_config, **kwargs)

    # ---- tools and tool images (multi-turn rollouts) -------------------------------------------------------------
    def set_tools(self, schemas: Optional[list[dict]]) -> None:
        """Render these function schemas into every prompt through the chat template's ``tools=`` (None: none)."""
        self.renderer.tools = list(schemas) if schemas else None

    def original_images(self, items: Sequence[Any], base_dir: Optional[str] = None) -> list[Any]:
        """A record's images at full resolution (no resize; the pixel limit still applies): what tools that crop
        or zoom work on, so a zoom shows detail the resized prompt image lost."""
        import dataclasses

        loader = VisionLoader(dataclasses.replace(self.loader.settings, image_min_pixels=None,
                                                  image_max_pixels=None))
        return [loader.load_image(item["image"] if isinstance(item, dict) and "image" in item else item, base_dir)
                for item in items]

    def process_images(self, images: Sequence[Any]) -> list[dict[str, Any]]:
        """Images returned by tools as the model sees them: each resized under the data's pixel bounds (as prompt
        images are), then run through the processor once. Per image: ``image`` (the resized PIL image, what the
        engine gets), ``pixel_values`` [rows, D], ``image_grid_thw`` [1, 3], ``tokens`` (its pad-token count).
        Raises ``ValueError`` naming the image on one that cannot be loaded or processed."""
        if not images:
            return []
        loaded = []
        for i, image in enumerate(images):
            try:
                loaded.append(self.loader.load_image(image))
            except DataError as exc:
                raise ValueError(f"tool image {i}: {exc}") from exc
        image_processor = getattr(self.processor, "image_processor", None)
        if image_processor is None:
            raise ValueError("tool images need the model's processor (it has no image_processor)")
        out = image_processor(images=loaded, return_tensors="pt")
        grid = torch.as_tensor(out["image_grid_thw"]).reshape(-1, 3)  # [images, 3]
        rows = grid.prod(dim=-1).tolist()
        pixels = out["pixel_values"].split(rows)  # per image [rows_i, D]
        tokens = self.adapter.tokens_per_grid(grid).tolist()
        return [{"image": im, "pixel_values": px, "image_grid_thw": grid[i: i + 1], "tokens": int(tokens[i])}
                for i, (im, px) in enumerate(zip(loaded, pixels))]

    # ---- entry points ---------------------------------------------------------------------------------------
    def process_records(self, records: Sequence[PromptRecord], n_samples_per_prompt: int) -> MultimodalBatch:
        """Process dataset records (see :class:`~mmrlhf.data.datasets.PromptDataset`)."""
        return self.process_multimodal_batch(
            [r.prompt for r in records], [r.images for r in records], [r.reference for r in records],
            n_samples_per_prompt=n_samples_per_prompt, all_videos=[r.videos for r in records],
            all_labels=[r.label for r in records], record_ids=[r.record_id for r in records],
            all_indices=[r.index for r in records], base_dirs=[r.base_dir for r in records])

    def process_multimodal_batch(
        self,
        all_prompts: Sequence[Any],
        all_images: Optional[Sequence[Any]] = None,
        all_references: Optional[Sequence[Any]] = None,
        images_num: Optional[Sequence[int]] = None,
        n_samples_per_prompt: int = 1,
        all_videos: Optional[Sequence[Any]] = None,
        videos_num: Optional[Sequence[int]] = None,
        all_labels: Optional[Sequence[Any]] = None,
        all_ids: Optional[Sequence[Any]] = None,
        all_indices: Optional[Sequence[int]] = None,
        base_dirs: Optional[Sequence[Optional[str]]] = None,
        record_ids: Optional[Sequence[Any]] = None,
    ) -> MultimodalBatch:
        """Process a batch of prompts; per prompt, images / videos are None, one item, or a list of items.

        ``images_num`` / ``videos_num`` (optional) are checked against the items given. ``record_ids`` (one per
        prompt, e.g. ``PromptRecord.record_id``; ``all_ids`` is its older name) and ``all_indices`` (e.g.
        ``PromptRecord.index``) name the records in every error and skip (defaults: no id / the position in this
        batch); the ids come back per sample as ``MultimodalBatch.all_record_ids``. Returns one entry per sample:
        kept prompts in input order, each repeated ``n_samples_per_prompt`` times.
        """
        n = int(n_samples_per_prompt)
        if n < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        if record_ids is not None and all_ids is not None:
            raise ValueError("give record_ids or all_ids (its older name), not both")
        all_ids = record_ids if record_ids is not None else all_ids
        size = len(all_prompts)
        columns = {"all_images": all_images, "all_references": all_references, "images_num": images_num,
                   "all_videos": all_videos, "videos_num": videos_num, "all_labels": all_labels, "all_ids": all_ids,
                   "all_indices": all_indices, "base_dirs": base_dirs}
        for name, col in columns.items():
            if col is not None and len(col) != size:
                raise ValueError(f"{name} has {len(col)} entries for {size} prompts")
        none = [None] * size
        cols = {name: none if col is None else col for name, col in columns.items()}
        # This batch's skips are collected apart (the batch reports them) and added to the running totals, also
        # when a later prompt raises.
        skips = SkipLog(self.skips.on_bad_input)
        try:
            kept, truncated = self._run(all_prompts, cols, n, skips)
        finally:
            self.skips.merge(skips)
        return self._expand(kept, n, truncated, skips.items)

    def _run(self, all_prompts: Sequence[Any], cols: dict[str, Sequence[Any]], n: int,
             skips: SkipLog) -> tuple[list[_Prompt], int]:
        prompts: list[_Prompt] = []
        for i, prompt in enumerate(all_prompts):
            index = cols["all_indices"][i]
            try:
                prompts.append(self._prepare(
                    i if index is None else index, cols["all_ids"][i], prompt, cols["all_images"][i],
                    cols["all_videos"][i], cols["images_num"][i], cols["videos_num"][i], cols["base_dirs"][i],
                    cols["all_references"][i], cols["all_labels"][i]))
                prompts[-1].position = i
            except DataError as err:
                skips.handle(err)

        text_only = [p for p in prompts if not p.images and not p.videos]
        with_vision = [p for p in prompts if p.images or p.videos]
        self._tokenize_text(text_only)
        self._process_vision(with_vision, skips)

        kept: list[_Prompt] = []
        cut: list[tuple[_Prompt, int]] = []  # the truncated prompts, each with its length before the cut
        for p in prompts:
            if p.failed:
                continue
            before = len(p.ids)
            try:
                self._check_vision_tokens(p, first_sample=len(kept) * n, n=n)
                outcome = self._fit_length(p, skips)
            except DataError as err:
                skips.handle(err)
                continue
            if outcome == "truncated":
                cut.append((p, before))
            if outcome != "skipped":
                kept.append(p)
        if cut:
            first, before = cut[0]
            warn_truncated(len(cut), self.prompt_max_len, index=first.index, record_id=first.record_id,
                           before=before, after=len(first.ids))
        return kept, len(cut)

    # ---- stage 1: per prompt --------------------------------------------------------------------------------
    def _prepare(self, index: int, record_id: Any, prompt: Any, images: Any, videos: Any, images_num: Optional[int],
                 videos_num: Optional[int], base_dir: Optional[str], reference: Any, label: Any) -> _Prompt:
        cfg = self.config
        images, videos = as_image_list(images), as_video_list(videos)
        if isinstance(prompt, list):  # chat form: parts may carry the items themselves
            images = images or items_from_parts(prompt, "image")
            videos = videos or items_from_parts(prompt, "video")
        for name, count, items in (("images_num", images_num, images), ("videos_num", videos_num, videos)):
            if count is not None and count != len(items):
                raise DataError(f"{name} says {count} but {len(items)} were given", reason="count_mismatch",
                                index=index, record_id=record_id, field=name)
        check_slots(prompt, len(images), len(videos), cfg.image_placeholder, cfg.video_placeholder,
                    index=index, record_id=record_id)
        try:
            loaded_images = [self.loader.load_image(item, base_dir) for item in images]
        except DataError as err:
            raise err.located(index=index, record_id=record_id, field="images") from err
        try:
            loaded_videos = [self.loader.load_video(item, base_dir) for item in videos]
        except DataError as err:
            raise err.located(index=index, record_id=record_id, field="videos") from err
        try:
            text = self.renderer.render(prompt)
        except ValueError as exc:
            raise DataError(str(exc), reason="bad_record", index=index, record_id=record_id, field="prompt") from exc
        return _Prompt(index, record_id, text, loaded_images, loaded_videos, reference, label)

    # ---- stage 2: one tokenizer call, one processor call -----------------------------------------------------
    def _tokenize_text(self, prompts: list[_Prompt]) -> None:
        if not prompts:
            return
        ids = self.tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
        for p, row in zip(prompts, ids):
            p.ids, p.mm_types = _as_list(row), [0] * len(row)

    def _process_vision(self, prompts: list[_Prompt], skips: SkipLog) -> None:
        """Run the processor once over ``prompts``; a prompt it fails on is named (or, skip mode, marked failed)."""
        if not prompts:
            return
        if self.processor is None or self.processor is self.tokenizer:
            raise ValueError("prompts with images or videos need the model's processor, not only its tokenizer")
        try:
            out = self.processor(**self._processor_kwargs(prompts))
        except Exception as exc:  # noqa: BLE001 - re-raised naming the prompt, or counted in skip mode
            self._blame(prompts, exc, skips)
            prompts = [p for p in prompts if not p.failed]
            if prompts:
                out = self.processor(**self._processor_kwargs(prompts))
        if prompts:
            self._unpack(prompts, out)

    def _blame(self, prompts: list[_Prompt], exc: Exception, skips: SkipLog) -> None:
        """The batch call failed: find the prompt(s) by running them one at a time (the failure path only)."""
        for p in prompts:
            try:
                self.processor(**self._processor_kwargs([p]))
            except Exception as one:  # noqa: BLE001
                skips.handle(DataError(f"the model's processor failed on this prompt: {one!r}",
                                       reason="processor_error", index=p.index, record_id=p.record_id,
                                       field="prompt"))
                p.failed = True
        if not any(p.failed for p in prompts):  # fails only as a batch: no single prompt to blame
            raise exc

    def _processor_kwargs(self, prompts: list[_Prompt]) -> dict[str, Any]:
        images = [im for p in prompts for im in p.images]
        videos = [v for p in prompts for v in p.videos]
        kwargs: dict[str, Any] = {"text": [p.text for p in prompts], "add_special_tokens": False}
        if images:
            kwargs["images"] = images
        if videos:
            from transformers.video_utils import VideoMetadata

            kwargs["videos"] = [v.frames for v in videos]
            # Frames are already sampled: the processor must not resample, and needs their true rate for the
            # temporal position ids (Qwen2.5-VL's ``second_per_grid_ts``).
            kwargs["do_sample_frames"] = False
            kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(v.frames), fps=v.fps,
                                                      frames_indices=list(range(len(v.frames)))) for v in videos]
            kwargs.update(self._video_call_kwargs)
        return kwargs

    def _unpack(self, prompts: list[_Prompt], out: Any) -> None:
        """Per prompt: its ids, token types, and (by grid products) its slice of the vision tensors."""
        ids, mm_types = out["input_ids"], out.get("mm_token_type_ids")
        for j, p in enumerate(prompts):
            p.ids = _as_list(ids[j])
            p.mm_types = _as_list(mm_types[j]) if mm_types is not None else self.adapter.mm_token_type_ids(p.ids)
        self._slice(prompts, out, IMAGE_KEYS, [len(p.images) for p in prompts])
        self._slice(prompts, out, VIDEO_KEYS, [len(p.videos) for p in prompts])

    def _slice(self, prompts: list[_Prompt], out: Any, keys: tuple[str, str], counts: list[int]) -> None:
        """Give each prompt its rows of ``out[pixel_key]`` and ``out[grid_key]`` (views), by grid products, and
        the number of pad tokens its grids imply (prefix sums over the batch: no per-prompt tensor ops)."""
        pixel_key, grid_key = keys
        if not sum(counts):
            return
        grid = torch.as_tensor(out[grid_key]).reshape(-1, 3)  # [items, 3]
        pixels = out[pixel_key]  # [sum over items of t*h*w, D]
        if grid.shape[0] != sum(counts):
            raise ValueError(f"processor returned {grid.shape[0]} {grid_key} rows for {sum(counts)} items")
        rows = grid.prod(dim=-1)
        if int(rows.sum()) != pixels.shape[0]:
            raise ValueError(f"processor returned {pixels.shape[0]} {pixel_key} rows; "
                             f"its grids imply {int(rows.sum())}")
        # Per-prompt totals by segment sums (item -> its prompt), then one split per tensor: views, in C.
        counts_t = torch.tensor(counts)  # [prompts]
        owner = torch.repeat_interleave(torch.arange(len(prompts)), counts_t)  # [items]
        rows_per_prompt = torch.zeros(len(prompts), dtype=rows.dtype).index_add_(0, owner, rows).tolist()
        pads = self.adapter.tokens_per_grid(grid)  # [items]: merged tokens per item
        pads_per_prompt = torch.zeros(len(prompts), dtype=pads.dtype).index_add_(0, owner, pads).tolist()
        pad_token = self.adapter.image_token_id if grid_key == "image_grid_thw" else self.adapter.video_token_id
        extra = out.get("second_per_grid_ts") if grid_key == "video_grid_thw" else None
        extra_parts = torch.as_tensor(extra, dtype=torch.float32).split(counts) if extra is not None else None
        pixel_parts, grid_parts = pixels.split(rows_per_prompt), grid.split(counts)
        for j, p in enumerate(prompts):
            if counts[j]:
                p.vision[pixel_key], p.vision[grid_key] = pixel_parts[j], grid_parts[j]
                p.expected_pads[pad_token] = pads_per_prompt[j]
                if extra_parts is not None:
                    p.vision["second_per_grid_ts"] = extra_parts[j]

    # ---- stage 3: checks --------------------------------------------------------------------------------------
    def _check_vision_tokens(self, p: _Prompt, first_sample: int, n: int) -> None:
        """Pad tokens in the ids must equal what the grids imply (merge size from the family adapter)."""
        for kind, token in (("image", self.adapter.image_token_id), ("video", self.adapter.video_token_id)):
            expected = p.expected_pads.get(token, 0)
            found = p.ids.count(token)
            if found != expected:
                raise DataError(
                    f"{found} {kind} pad tokens in the prompt ids but its {kind} grids imply {expected} "
                    f"(samples {first_sample}..{first_sample + n - 1} of this batch); was the prompt truncated "
                    f"through its vision tokens, or does its text contain the model's own {kind} token?",
                    reason="vision_token_mismatch", index=p.index, record_id=p.record_id, field="prompt")

    def _fit_length(self, p: _Prompt, skips: SkipLog) -> str:
        """Apply ``prompt_overflow`` to an over-long prompt: ``"ok"``, ``"truncated"`` or ``"skipped"``."""
        excess = len(p.ids) - self.prompt_max_len
        if excess <= 0:
            return "ok"
        mode = self.config.prompt_overflow
        where = dict(index=p.index, record_id=p.record_id, field="prompt")
        if mode != "truncate_left":
            err = DataError(f"prompt has {len(p.ids)} tokens, above prompt_max_len={self.prompt_max_len}",
                            reason="prompt_too_long", **where)
            if mode == "error":
                raise err
            skips.record(err)  # prompt_overflow="skip" skips whatever on_bad_input says
            return "skipped"
        protected = structure_mask(p.ids, special_ids=self._special_ids, is_newline=self._is_newline,
                                   vision_start=self.adapter.vision_start_token_id,
                                   vision_end=self.adapter.vision_end_token_id,
                                   role_of=self._role_of, keep_roles=_KEPT_ROLES)
        for extra in range(_MAX_EXTRA_DROPS + 1):
            fitted = truncate_text_left(p.ids, p.mm_types, self.prompt_max_len - extra, self._vision_ids, protected)
            if fitted is None and extra == 0:
                n_kept = sum(t in self._vision_ids or k for t, k in zip(p.ids, protected))
                raise DataError(f"prompt has {len(p.ids)} tokens, {n_kept} of them vision, chat-structure or "
                                f"system-turn tokens; it cannot fit prompt_max_len={self.prompt_max_len} without "
                                "cutting a vision block or the system turn", reason="prompt_too_long", **where)
            if fitted is None:
                break
            text = self._text_of(fitted[0])
            if text is not None:
                p.ids, p.mm_types = fitted
                p.text = text
                return "truncated"
        raise DataError("after left truncation the prompt's text does not re-tokenise to its kept ids (engines "
                        "that take text, such as vLLM for Qwen3-VL videos, would see another prompt); shorten its "
                        "text or raise prompt_max_len", reason="truncation_mismatch", **where)

    def _role_of(self, header: list[int]) -> str:
        return self.tokenizer.decode(header).strip()

    def _text_of(self, ids: list[int]) -> Optional[str]:
        """The prompt text whose processing gives exactly ``ids`` (vision blocks written unexpanded), or None.

        Decode, then check: the plain tokenisation of the text must equal ``ids`` with each vision block collapsed
        (the processor's expansion of the same items then restores the blocks token for token)."""
        collapsed = collapse_vision_blocks(ids, vision_start=self.adapter.vision_start_token_id,
                                           vision_end=self.adapter.vision_end_token_id, pad_ids=self._pad_ids)
        text = self.tokenizer.decode(collapsed, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if _as_list(again) == collapsed else None

    # ---- stage 4: expand x n, in order -----------------------------------------------------------------------
    @staticmethod
    def _expand(kept: list[_Prompt], n: int, truncated: int, skipped: list) -> MultimodalBatch:
        def rep(values: list) -> list:
            out = [None] * (len(values) * n)
            for j in range(n):  # n strided slice assignments: the copying runs in C
                out[j::n] = values
            return out

        return MultimodalBatch(
            n_samples_per_prompt=n,
            all_prompt_token_ids=rep([p.ids for p in kept]),
            all_mm_token_type_ids=rep([p.mm_types for p in kept]),
            all_prompts=rep([p.text for p in kept]),
            all_images=rep([p.images for p in kept]),
            all_videos=rep([p.videos for p in kept]),
            all_images_num=rep([len(p.images) for p in kept]),
            all_videos_num=rep([len(p.videos) for p in kept]),
            # The n copies share one dict (like their id lists): no per-sample allocations; treat as read-only.
            all_vision_inputs=rep([p.vision for p in kept]),
            all_references=rep([p.reference for p in kept]),
            all_labels=rep([p.label for p in kept]),
            all_prompt_indices=rep([p.index for p in kept]),
            all_record_ids=rep([p.record_id for p in kept]),
            all_positions=rep([p.position for p in kept]),
            skipped=list(skipped),
            truncated=truncated,
        )


def _as_list(row: Any) -> list:
    """Token ids as a plain list (tokenizers already return lists; copy only other sequences)."""
    return row if isinstance(row, list) else list(row)
