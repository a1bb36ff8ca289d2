"""Hand-built multi-turn samples for the layout and parity tests: a shared first prompt with one image, then turns
and observations with their own images, built with the same pieces the turn loop uses (the data processor and
:class:`~mmrlhf.agents.template.ObservationRenderer`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from mmrlhf.agents.template import ObservationRenderer
from mmrlhf.agents.tools import Tool
from mmrlhf.agents.types import StepResult, ToolResult
from mmrlhf.testing.tiny_models import TOY_CALLS

ZOOM_SCHEMA = {"type": "function", "function": {"name": "image_zoom", "description": "zoom",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass
class Pieces:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    masks: list[list[int]]
    vision: list[dict[str, torch.Tensor]]


def load_tools_model(family: str):
    """(fp32 model, processor, adapter, data processor) of the tiny tool-calling model of ``family``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.data.processor import MultimodalDataProcessor
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir(family, tools=True)
    processor = AutoProcessor.from_pretrained(path)
    adapter = get_adapter(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    data = MultimodalDataProcessor(processor, 256, adapter)
    data.set_tools([ZOOM_SCHEMA])
    return model, processor, adapter, data


def colour(rgb: tuple[int, int, int], size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, rgb)


def multi_turn_pieces(processor: Any, adapter: Any, data: Any, *, samples: int = 3, seed: int = 0) -> Pieces:
    """``samples`` trajectories of one prompt (one image): call, observation (image), call, observation (two
    images, the second result text only), answer; each trajectory has its own observation images and sizes."""
    tok = processor.tokenizer
    renderer = ObservationRenderer(tok, adapter)
    batch = data.process_multimodal_batch(["<image>What color is the square?"], [[colour((200, 30, 30), (56, 56))]],
                                          [None], n_samples_per_prompt=samples)
    call = [tok.convert_tokens_to_ids(t) for t in ("<tool_call>", TOY_CALLS[0], "</tool_call>")]
    g = torch.Generator().manual_seed(seed)
    words = [tok.convert_tokens_to_ids(w) for w in ("red", "green", "blue", "yellow", "the", "square")]
    prompts, responses, masks, vision = [], [], [], []
    for k in range(samples):
        prompt = list(batch.all_prompt_token_ids[k])
        images_1 = [colour((30 * k, 200, 40), (56, 56))]
        images_2 = [colour((40, 40, 220 - 20 * k), (84, 56)), colour((250, 250, 20 * k), (56, 112))]
        enc_1, enc_2 = data.process_images(images_1), data.process_images(images_2)
        obs_1 = renderer.tokens([ToolResult(text="zoomed", images=images_1)], [e["tokens"] for e in enc_1],
                                close_turn=True)
        obs_2 = renderer.tokens([ToolResult(text="", images=images_2), ToolResult(text="done")],
                                [e["tokens"] for e in enc_2], close_turn=True)
        answer = [words[int(i)] for i in torch.randint(len(words), (2 + k,), generator=g)] + [tok.eos_token_id]
        turn_1 = ([words[k % len(words)]] if k % 2 else []) + call  # uneven: some turns write a word before their call
        pieces = [(turn_1, 1), (obs_1, 0), (call, 1), (obs_2, 0), (answer, 1)]
        responses.append([t for p, _ in pieces for t in p])
        masks.append([m for p, m in pieces for _ in p])
        v = dict(batch.all_vision_inputs[k])
        enc = enc_1 + enc_2
        v["pixel_values"] = torch.cat([v["pixel_values"]] + [e["pixel_values"] for e in enc])
        v["image_grid_thw"] = torch.cat([v["image_grid_thw"]] + [e["image_grid_thw"] for e in enc])
        prompts.append(prompt)
        vision.append(v)
    return Pieces(prompts, responses, masks, vision)


def reference_log_probs(model: Any, adapter: Any, prompt: list[int], response: list[int], mask: list[int],
                        vision: dict[str, torch.Tensor]) -> torch.Tensor:
    """[policy tokens] log-probs of one trajectory alone: the HF model's full-logits forward on the whole sequence
    (positions by the family's rule over prompt AND observations), vision special tokens excluded."""
    ids = torch.tensor([prompt + response])  # [1, S]
    types = adapter.mm_token_type_ids(ids)  # [1, S]
    positions = adapter.rope_index(ids, types, image_grid_thw=vision.get("image_grid_thw"))  # [3, 1, S]
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                   position_ids=positions, pixel_values=vision["pixel_values"],
                   image_grid_thw=vision["image_grid_thw"]).logits.float()  # [1, S, V]
    step = logits[0, len(prompt) - 1: -1]  # [A, V]
    step[:, list(adapter.vision_special_token_ids())] = float("-inf")
    logq = torch.log_softmax(step, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]  # [A]
    return logq[torch.tensor(mask, dtype=torch.bool)]


class Colours:
    """A test environment whose every observation is an image (and whose first one comes from reset)."""

    def __init__(self, steps: int = 2) -> None:
        self.steps, self.taken = steps, 0

    def reset(self, record):
        return ToolResult(text="start", images=[Image.new("RGB", (56, 56), (10, 200, 10))])

    def step(self, action_text):
        self.taken += 1
        if self.taken > self.steps:
            return StepResult(ToolResult(text="bye"), done=True, info={"solved": True})
        return StepResult(ToolResult(text=f"step {self.taken}", images=[Image.new("RGB", (56, 84), (0, 0, 255))]))


class Hang(Tool):
    """Blocks until released (or 5 s): a tool that never answers in time."""

    name = "hang"

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, arguments, context):
        self.release.wait(5.0)
        return "late"
