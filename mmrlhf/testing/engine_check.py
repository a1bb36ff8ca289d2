"""End-to-end engine check: generate through vLLM with images and video, then re-score the sampled tokens with a
float32 transformers forward and compare log-probs. Used by ``mmrlhf smoke`` and by the test suite.

The comparison is the proof that the engine, the processor and the model agree on the prompt layout (vision pad
expansion, M-RoPE positions, chat template): any mismatch shows up as log-probs that differ by far more than the
bf16-vs-fp32 noise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmrlhf.models.adapters import get_adapter
from mmrlhf.rollout.vllm_setup import forbid_tokens_bias, make_llm, one_collection_at_shutdown
from mmrlhf.testing.tolerances import DEFAULT_TOLERANCE  # noqa: F401 - re-exported for callers


@dataclass
class CheckCase:
    """One prompt of the check: its chat text and its vision inputs."""

    name: str
    text: str
    images: list[Image.Image] = field(default_factory=list)
    videos: list[np.ndarray] = field(default_factory=list)  # each [T, H, W, 3] uint8


@dataclass
class CaseResult:
    name: str
    response_ids: list[list[int]]  # per sample
    engine_logprobs: list[torch.Tensor]  # per sample [A]
    hf_logprobs: list[torch.Tensor]  # per sample [A]

    @property
    def max_abs_diff(self) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(self.engine_logprobs, self.hf_logprobs))

    @property
    def mean_abs_diff(self) -> float:
        diffs = torch.cat([(a - b).abs() for a, b in zip(self.engine_logprobs, self.hf_logprobs)])
        return float(diffs.mean())


def solid_image(rgb: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> Image.Image:
    return Image.new("RGB", size, rgb)


def moving_square_video(frames: int = 4, size: int = 56) -> np.ndarray:
    """[T, H, W, 3] uint8: a white square moving left to right on black."""
    video = np.zeros((frames, size, size, 3), dtype=np.uint8)
    side = size // 4
    for t in range(frames):
        x = (t * (size - side)) // max(frames - 1, 1)
        video[t, size // 2 - side // 2 : size // 2 + side // 2, x : x + side] = 255
    return video


def default_cases(processor: Any) -> list[CheckCase]:
    """Text-only, one image, two images (different sizes) and one video."""

    def chat(parts: list[dict]) -> str:
        return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)

    red, blue = solid_image((255, 0, 0)), solid_image((0, 0, 255), (84, 56))
    return [
        CheckCase("text", chat([{"type": "text", "text": "Describe the picture in one sentence."}])),
        CheckCase("one_image", chat([{"type": "image"}, {"type": "text", "text": "What color is the square?"}]),
                  images=[red]),
        CheckCase("two_images", chat([{"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": "Which image is red?"}]), images=[red, blue]),
        CheckCase("video", chat([{"type": "video"}, {"type": "text", "text": "What happens in the video?"}]),
                  videos=[moving_square_video()]),
    ]


VIDEO_FPS = 2.0

def processor_inputs(processor: Any, adapter: Any, case: CheckCase) -> Any:
    """The HF processor's output for one case (prompt ids, pixel values, grids, mm_token_type_ids)."""
    kwargs: dict[str, Any] = {"text": [case.text], "return_tensors": "pt"}
    if case.images:
        kwargs["images"] = case.images
    if case.videos:
        kwargs["videos"] = case.videos
        kwargs.update(adapter.processor_video_kwargs(case.videos, VIDEO_FPS))
    return processor(**kwargs)


def hf_response_logprobs(model: Any, processor: Any, case: CheckCase, responses: list[list[int]], *,
                         temperature: float = 1.0, forbidden: list[int] | tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Transformers log-probs of each response's tokens given the case's prompt. Returns B tensors [A_i].

    With ``forbidden`` and ``temperature`` this is the distribution the engines sample from (and report): those
    tokens removed, logits divided by the temperature (no top-k / top-p: callers that check engines use neither).
    Without them, the plain policy the trainer scores.
    """
    inputs = processor_inputs(processor, get_adapter(model.config), case)
    prompt_ids = inputs.pop("input_ids")  # [1, P]
    inputs.pop("attention_mask")
    mm_types = inputs.pop("mm_token_type_ids", None)  # [1, P]
    out = []
    for resp in responses:
        resp_t = torch.tensor([resp], dtype=prompt_ids.dtype)  # [1, A]
        ids = torch.cat([prompt_ids, resp_t], dim=1)  # [1, P + A]
        extra = dict(inputs)
        if mm_types is not None:
            extra["mm_token_type_ids"] = torch.cat([mm_types, torch.zeros_like(resp_t, dtype=mm_types.dtype)], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits.float()  # [1, P+A, V]
        p = prompt_ids.shape[1]
        step_logits = logits[0, p - 1 : -1]  # [A, V]
        if forbidden:
            step_logits[:, list(forbidden)] = float("-inf")
        logp = torch.log_softmax(step_logits / temperature, dim=-1)  # [A, V]
        out.append(logp.gather(-1, resp_t[0, :, None])[:, 0])
    return out


def actor_response_logprobs(actor: Any, request: Any, responses: list[list[int]], *, temperature: float = 1.0,
                            stop_ids: list[int] | tuple[int, ...] = (), truncation: Any = None) -> list[torch.Tensor]:
    """What the trainer computes: :class:`~mmrlhf.models.actor.ActorVL` log-probs of each response given one
    :class:`~mmrlhf.rollout.types.GenerationRequest` (its processor ids and vision tensors), in the padded layout
    the experience maker builds, under the sampler's ``truncation`` (None: the full distribution). Returns one
    tensor [A_i] per response."""
    from mmrlhf.experience.samples import build_padded_samples

    k = len(responses)
    built = build_padded_samples([request.prompt_token_ids] * k, responses, pad_id=0, eos_id=list(stop_ids),
                                 adapter=actor.adapter, vision=[request.vision_inputs] * k)
    with torch.no_grad():  # CPU tensors: a helper for tests and the smoke check
        out = actor(built.samples, vision_extra=built.vision_extra, temperature=temperature, truncation=truncation)
    return [out.log_probs[i, : int(out.action_mask[i].sum())].float().cpu() for i in range(k)]


def restricted_copy(model: Any, token_ids: list[int] | tuple[int, ...]) -> Any:
    """A copy of a transformers model whose output head can never produce ``token_ids`` (a -inf bias on them):
    scoring with it gives the log-probs of the distribution the engines sample from, which excludes the forbidden
    tokens. The original is untouched (its parameter names stay those of the checkpoint)."""
    import copy

    scorer = copy.deepcopy(model)
    head = scorer.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)  # [V]
    bias[list(token_ids)] = float("-inf")
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return scorer


def run_engine_check(
    model_dir: str,
    *,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str = "auto",
    cases: list[CheckCase] | None = None,
    llm: Any = None,
) -> dict[str, Any]:
    """Generate with vLLM for every case, compare against transformers. Returns a report dict:
    ``{"cases": [CaseResult...], "tokens": int, "gen_seconds": float, "engine_seconds": float}``.

    The engine reports the log-probs of the distribution it sampled from (``make_llm``: processed log-probs): the
    float32 reference is the same distribution, vision special tokens excluded, logits at ``temperature``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import SamplingParams

    processor = AutoProcessor.from_pretrained(model_dir)
    adapter = get_adapter(model_dir)
    cases = cases if cases is not None else default_cases(processor)
    t0 = time.perf_counter()
    if llm is None:
        max_images = max(len(c.images) for c in cases)
        max_videos = max(len(c.videos) for c in cases)
        llm = make_llm(model_dir, dtype=dtype, max_model_len=2048, seed=seed,
                       limit_mm_per_prompt={"image": max(max_images, 1), "video": max(max_videos, 1)})
    engine_seconds = time.perf_counter() - t0

    params = SamplingParams(
        n=samples_per_prompt, max_tokens=max_new_tokens, temperature=temperature, seed=seed, logprobs=0,
        logit_bias=forbid_tokens_bias(adapter.vision_special_token_ids()),
    )
    requests = []
    for case in cases:
        mm: dict[str, Any] = {}
        if case.images:
            mm["image"] = case.images if len(case.images) > 1 else case.images[0]
        if case.videos:
            vids = [adapter.vllm_video(v, fps=VIDEO_FPS) for v in case.videos]
            mm["video"] = vids if len(vids) > 1 else vids[0]
        requests.append({"prompt": case.text, "multi_modal_data": mm} if mm else {"prompt": case.text})
    t1 = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    gen_seconds = time.perf_counter() - t1
    # An engine built here goes now (a caller's stays theirs): vLLM keeps one set of parallel groups per process, and
    # the next engine (another family, e.g. one with experts) must build its own.
    with one_collection_at_shutdown():  # vLLM's finaliser shuts it down here (as VLLMEngine.close does)
        llm = None

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    results, tokens = [], 0
    for case, output in zip(cases, outputs):
        resp_ids = [list(o.token_ids) for o in output.outputs]
        engine_lp = [
            torch.tensor([step[tok].logprob for step, tok in zip(o.logprobs, o.token_ids)]) for o in output.outputs
        ]
        tokens += sum(len(r) for r in resp_ids)
        reference = hf_response_logprobs(model, processor, case, resp_ids, temperature=temperature or 1.0,
                                         forbidden=adapter.vision_special_token_ids())
        results.append(CaseResult(case.name, resp_ids, engine_lp, reference))
    return {"cases": results, "tokens": tokens, "gen_seconds": gen_seconds, "engine_seconds": engine_seconds}
