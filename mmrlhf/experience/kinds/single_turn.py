"""``single_turn``: one generation per sample, the engine asked once per unique prompt for ``n`` completions (so
vision inputs are encoded once per prompt); each completion cut after its first stop token is a row."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mmrlhf.experience.kinds.base import Generated, KindSetup, RolloutCall
from mmrlhf.experience.rollout import Rollout
from mmrlhf.experience.samples import cut_at_stop
from mmrlhf.rewards.types import RewardResult
from mmrlhf.rollout.types import GenerationRequest, GenerationResult


class PromptMismatchError(ValueError):
    """The engine tokenised a prompt differently from the data processor (the forward would not match it)."""


class SingleTurn:
    """One response per sample, straight from the engine."""

    multi_turn = False

    def __init__(self, setup: KindSetup | None = None) -> None:
        self.setup = setup or KindSetup()

    def generate(self, call: RolloutCall) -> Generated:
        with call.timer("generate"):
            result = call.engine.generate(requests(call.batch, call.n), call.sampling)
        rows = collect(call, result)
        return Generated(rows, len(result.outputs), result.skipped, result.num_tokens)

    def responses(self, rows: Rollout, tokenizer: Any) -> list[str]:
        """The decoded response (special tokens dropped), never prompt and response decoded together."""
        return tokenizer.batch_decode(rows.response_ids, skip_special_tokens=True)

    def after_rewards(self, rows: Rollout, result: RewardResult) -> dict[str, float]:
        return {}


def requests(batch: Any, n: int) -> list[GenerationRequest]:
    """One request per unique prompt (its first sample), with both the text and the processor's ids."""
    reqs = []
    for k in range(0, len(batch), n):
        videos = batch.all_videos[k]
        reqs.append(GenerationRequest(
            prompt=batch.all_prompts[k], prompt_token_ids=batch.all_prompt_token_ids[k],
            images=list(batch.all_images[k]), videos=[v.as_thwc().numpy() for v in videos],
            video_fps=[v.fps for v in videos], vision_inputs=batch.all_vision_inputs[k],
            mm_token_type_ids=batch.all_mm_token_type_ids[k],
            request_id=None if batch.all_record_ids[k] is None else str(batch.all_record_ids[k]),
        ))
    return reqs


def collect(call: RolloutCall, result: GenerationResult) -> Rollout:
    """Flatten the engine's outputs into per-sample rows (responses cut after their first stop token); check
    the engine saw the processor's prompt ids."""
    batch, n = call.batch, call.n
    cols: dict[str, list] = {f.name: [] for f in dataclasses.fields(Rollout)}
    for out in result.outputs:
        first = out.request_index * n
        expected = batch.all_prompt_token_ids[first]
        if call.check_prompt_ids and list(out.prompt_token_ids) != list(expected):
            pos = next((i for i, (a, b) in enumerate(zip(out.prompt_token_ids, expected)) if a != b),
                       min(len(expected), len(out.prompt_token_ids)))
            raise PromptMismatchError(
                f"{batch.describe_sample(first)}: the engine's prompt ids differ "
                f"from the data processor's at position {pos} ({len(out.prompt_token_ids)} vs {len(expected)} "
                "tokens): chat template, tokenizer or vision expansion disagree")
        for j, completion in enumerate(out.completions):
            k = first + j
            response, _ = cut_at_stop(completion.token_ids, call.eos_ids)
            logprobs = None if completion.logprobs is None else list(completion.logprobs[: len(response)])
            cols["sample_index"].append(k)
            cols["group"].append(out.request_index)
            cols["prompt_ids"].append(list(expected))
            cols["response_ids"].append(response)
            cols["engine_logprobs"].append(logprobs)
            cols["finished"].append(not completion.truncated)
            cols["vision"].append(batch.all_vision_inputs[k])
            cols["prompts"].append(batch.all_prompts[k])
            cols["labels"].append(batch.all_labels[k])
            cols["references"].append(batch.all_references[k])
            cols["images"].append(list(batch.all_images[k]))
            cols["record_ids"].append(batch.all_record_ids[k])
            if completion.routed_experts is not None:  # the engine's rows, cut to the kept prompt + response
                routed = torch.as_tensor(completion.routed_experts).to(torch.int16)
                cols["routed_experts"].append(routed[: len(expected) + len(response)])
            if completion.token_versions is not None:
                cols["token_versions"].append(list(completion.token_versions[: len(response)]))
    if cols["routed_experts"] and len(cols["routed_experts"]) != len(cols["sample_index"]):
        raise ValueError("routed experts came back for some completions only")
    if cols["token_versions"] and len(cols["token_versions"]) != len(cols["sample_index"]):
        raise ValueError("token versions came back for some completions only")
    return Rollout(**cols)
