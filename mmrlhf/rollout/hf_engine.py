"""transformers ``generate`` as a rollout engine: the fallback (no vLLM) and what ``NaiveExperienceMaker`` uses.

It shares the policy module with the trainer, so ``update_weights`` only has to copy tensors that differ from the
module's own (a no-op when the trainer updates the module in place).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.rollout.base import NamedTensors, RolloutEngine, iter_buckets, stop_token_ids
from mmrlhf.rollout.types import Completion, GenerationOutput, GenerationRequest, GenerationResult, SamplingSettings


class HFGenerateEngine(RolloutEngine):
    """Generation with ``model.generate`` on the prompt ids and vision tensors the data processor produced.

    Args:
        model: a transformers ``...ForConditionalGeneration`` model (the actor itself, or a copy).
        adapter: family adapter (forbidden vision tokens).
        eos_token_id / pad_token_id: the tokenizer's ids.
        max_model_len: context length used for the too-long check.
        prompt_too_long: ``"skip"`` or ``"error"``.
        batch_size: prompts per ``generate`` call (bounds memory).
        weight_sync_bucket_mb: bound on one weight-update bucket.
    """

    def __init__(self, model: Any, adapter: FamilyAdapter, *, eos_token_id: int, pad_token_id: int,
                 max_model_len: int = 4096, prompt_too_long: str = "skip", batch_size: int = 8,
                 weight_sync_bucket_mb: int = 256) -> None:
        super().__init__(max_model_len, prompt_too_long)
        self.model = model
        self.adapter = adapter
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.stop_ids = stop_token_ids(model, eos_token_id)
        self.batch_size = batch_size
        self.bucket_bytes = int(weight_sync_bucket_mb) << 20

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, requests: list[GenerationRequest], settings: SamplingSettings) -> GenerationResult:
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            if req.prompt_token_ids is None:
                raise ValueError(f"request {i}: the transformers engine needs prompt_token_ids (data processor output)")
        skipped = self.split_too_long(requests, settings)
        keep = [i for i in range(len(requests)) if i not in skipped]
        outputs = []
        for start in range(0, len(keep), self.batch_size):
            chunk = keep[start : start + self.batch_size]
            outputs.extend(self._generate_chunk(requests, chunk, settings))
        return GenerationResult(outputs=outputs, skipped=skipped, seconds=time.perf_counter() - t0)

    def _batch_inputs(self, reqs: list[GenerationRequest]) -> dict[str, torch.Tensor]:
        """Left-pad the prompts; concatenate vision tensors in prompt order."""
        width = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)  # [B, P]
        mask = torch.zeros((len(reqs), width), dtype=torch.long)  # [B, P]
        mm = torch.zeros((len(reqs), width), dtype=torch.long)  # [B, P]
        for row, r in enumerate(reqs):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
            if r.mm_token_type_ids is not None:
                mm[row, width - n :] = torch.tensor(r.mm_token_type_ids)
        out: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm}
        keys = sorted({k for r in reqs for k in r.vision_inputs})
        for key in keys:
            out[key] = torch.cat([r.vision_inputs[key] for r in reqs if key in r.vision_inputs], dim=0)
        return {k: v.to(self.device) for k, v in out.items()}

    @torch.no_grad()
    def _generate_chunk(self, requests, chunk: list[int], settings: SamplingSettings) -> list[GenerationOutput]:
        reqs = [requests[i] for i in chunk]
        inputs = self._batch_inputs(reqs)
        width = inputs["input_ids"].shape[1]
        forbidden = list(settings.forbidden_token_ids) or self.adapter.vision_special_token_ids()
        greedy = settings.temperature == 0
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens,
            do_sample=not greedy, num_return_sequences=settings.n,
            pad_token_id=self.pad_token_id, bad_words_ids=[[t] for t in forbidden],
            return_dict_in_generate=True, output_logits=settings.logprobs,
        )
        if not greedy:
            gen_kwargs.update(temperature=settings.temperature, top_p=settings.top_p,
                              top_k=settings.top_k if settings.top_k > 0 else None)
        if settings.stop:
            gen_kwargs["stop_strings"] = list(settings.stop)
        gen_kwargs["eos_token_id"] = sorted(set(self.stop_ids) | set(settings.stop_token_ids))
        was_training = self.model.training
        self.model.eval()
        # Seeded sampling on a private copy of the RNG state: the trainer's global stream (dropout, shuffling)
        # is left exactly as it was.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                if settings.seed is not None:
                    torch.manual_seed(settings.seed + chunk[0])
                out = self.model.generate(**inputs, **gen_kwargs)
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:]  # [B * n, A]
        logps = None
        if settings.logprobs:
            # Raw logits (before temperature and bans): the policy's own log-probs, as vLLM reports them. One step
            # at a time, so only a [B * n, V] float32 slice exists at once.
            logps = torch.stack([
                torch.log_softmax(step.float(), dim=-1).gather(-1, new[:, t : t + 1]).squeeze(-1)
                for t, step in enumerate(out.logits)
            ], dim=1)  # [B * n, A]
        stops = set(self.stop_ids) | set(settings.stop_token_ids)
        results = []
        for j, i in enumerate(chunk):
            completions = []
            for k in range(settings.n):
                row = j * settings.n + k
                toks, finish = _cut_generated(new[row].tolist(), stops, self.pad_token_id)
                lp = logps[row, : len(toks)].tolist() if logps is not None else None
                completions.append(Completion(toks, lp, finish))
            results.append(GenerationOutput(i, list(requests[i].prompt_token_ids), completions))
        return results

    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Copy tensors into the model (names in the model's own naming); returns the count."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        loaded = 0
        with torch.no_grad():
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                for name, tensor in bucket:
                    if name not in params:
                        raise KeyError(f"update_weights: the model has no parameter {name!r}")
                    target = params[name]
                    if target.data_ptr() != tensor.data_ptr():
                        target.copy_(tensor.to(target.device, target.dtype))
                    loaded += 1
        return loaded


def _cut_generated(toks: list[int], stops: set[int], pad_id: int) -> tuple[list[int], str]:
    """The sampled part of one ``generate`` row and its finish reason.

    transformers fills a finished row with ``pad_id`` up to the batch's length. Trailing pads are that fill (the
    first of them is the sampled EOS when the pad id is itself a stop token); a row without fill ran to
    ``max_new_tokens``. Within the sampled part, the response ends at its first stop token.
    """
    k = len(toks)
    while k > 0 and toks[k - 1] == pad_id:
        k -= 1
    if k == len(toks):
        kept, finish = toks, "length"
    else:  # stopped early: by a stop token (kept below) or by a stop string (kept as is)
        kept, finish = toks[: k + 1] if pad_id in stops else toks[:k], "stop"
    end = next((t + 1 for t, tok in enumerate(kept) if tok in stops), None)
    return (kept[:end], "stop") if end is not None else (kept, finish)
