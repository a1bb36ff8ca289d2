"""transformers ``generate`` as a rollout engine: the fallback (no vLLM) and what ``NaiveExperienceMaker`` uses.

It shares the policy module with the trainer, so ``update_weights`` only has to copy tensors that differ from the
module's own (a no-op when the trainer updates the module in place). Sampling is done by
:class:`~mmrlhf.rollout.hf_sampling.SettingsSampler`: only what ``SamplingSettings`` says (never the checkpoint's
generation defaults), one random stream per sample, log-probs of the distribution actually sampled from (the
same quantity the vLLM engine reports).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any, Iterator

import torch

from mmrlhf.models.adapters import FamilyAdapter
from mmrlhf.models.placement import module_device, to_device
from mmrlhf.models.precision import autocast
from mmrlhf.rollout.base import NamedTensors, RolloutEngine, forbidden_token_ids, iter_buckets, stop_token_ids
from mmrlhf.rollout.hf_sampling import SettingsSampler
from mmrlhf.rollout.types import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    request_name,
    stream_seed,
)


class HFGenerateEngine(RolloutEngine):
    """Generation with ``model.generate`` on the prompt ids and vision tensors the data processor produced.

    Args:
        model: a transformers ``...ForConditionalGeneration`` model (the actor itself, or a copy).
        adapter: family adapter (forbidden vision tokens).
        eos_token_id / pad_token_id: the tokenizer's ids.
        tokenizer: the model's tokenizer; needed only for stop strings (transformers matches them on text).
        max_model_len: context length used for the too-long check.
        prompt_too_long: ``"skip"`` or ``"error"``.
        batch_size: prompts per ``generate`` call (bounds memory; each prompt runs as ``n`` rows).
        weight_sync_bucket_mb: bound on one weight-update bucket.
        compute_dtype: autocast dtype of ``generate`` (the actor's ``compute_dtype``: float32 master parameters
            computing in bf16 generate in bf16 too, the kernels the trainer scores with); None: the parameters' own.
    """

    def __init__(self, model: Any, adapter: FamilyAdapter, *, eos_token_id: int, pad_token_id: int,
                 tokenizer: Any = None, max_model_len: int = 4096, prompt_too_long: str = "skip",
                 batch_size: int = 8, weight_sync_bucket_mb: int = 256,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__(max_model_len, prompt_too_long)
        self.model = model
        self.adapter = adapter
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, eos_token_id)
        self.batch_size = batch_size
        self.bucket_bytes = int(weight_sync_bucket_mb) << 20
        self.compute_dtype = compute_dtype

    @property
    def device(self) -> torch.device:
        """Where ``generate`` runs: the model's device (prompts are batched on the CPU and moved there)."""
        return module_device(self.model)

    def generate(self, requests: list[GenerationRequest], settings: SamplingSettings) -> GenerationResult:
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            if req.prompt_token_ids is None:
                raise ValueError(f"{request_name(requests, i)}: the transformers engine needs prompt_token_ids "
                                 "(data processor output)")
        if settings.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer: build HFGenerateEngine(..., tokenizer=...)")
        self._check_forbidden(settings)
        skipped = self.split_too_long(requests, settings)
        keep = [i for i in range(len(requests)) if i not in skipped]
        # Unseeded calls still give every sample its own stream, from a fresh base (the torch RNG is not touched).
        base_seed = settings.seed if settings.seed is not None else secrets.randbits(62)
        outputs = []
        for start in range(0, len(keep), self.batch_size):
            chunk = keep[start : start + self.batch_size]
            outputs.extend(self._generate_chunk(requests, chunk, settings, base_seed))
        return GenerationResult(outputs=outputs, skipped=skipped, seconds=time.perf_counter() - t0)

    def _check_forbidden(self, settings: SamplingSettings) -> None:
        vocab = self.model.get_output_embeddings().weight.shape[0]
        bad = [t for t in settings.forbidden_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"forbidden_token_ids {bad} are outside the vocabulary (0..{vocab - 1})")

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
        return to_device(out, self.device)

    @torch.no_grad()
    def _generate_chunk(self, requests: list[GenerationRequest], chunk: list[int], settings: SamplingSettings,
                        base_seed: int) -> list[GenerationOutput]:
        from transformers import GenerationConfig, LogitsProcessorList

        n = settings.n
        # Row j * n + k is sample k of request chunk[j]: the prompt is repeated n times (what transformers'
        # num_return_sequences does too), so every row can draw from its own stream.
        rows = [requests[i] for i in chunk for _ in range(n)]
        inputs = self._batch_inputs(rows)
        width = inputs["input_ids"].shape[1]
        stops = sorted(set(self.stop_ids) | set(settings.stop_token_ids))
        sampler = SettingsSampler(
            settings, forbidden=forbidden_token_ids(self.adapter, settings), stop_ids=stops, prompt_width=width,
            seeds=[(int(requests[i].seed) + k if requests[i].seed is not None else stream_seed(base_seed, i, k, n))
                   for i in chunk for k in range(n)],
        )
        config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens, do_sample=False, num_beams=1, num_return_sequences=1,
            eos_token_id=stops, pad_token_id=self.pad_token_id, stop_strings=list(settings.stop) or None,
            repetition_penalty=1.0, return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with _checkpoint_defaults_hidden(self.model), autocast(self.device, self.compute_dtype):
                out = self.model.generate(**inputs, generation_config=config,
                                          logits_processor=LogitsProcessorList([sampler]),
                                          tokenizer=self.tokenizer if settings.stop else None)
        except Exception as exc:
            exc.add_note(f"while generating {', '.join(request_name(requests, i) for i in chunk)}")
            raise
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:].cpu()  # [B * n, A]
        drawn, logps = sampler.stacked(new.shape[1])  # [B * n, A], [B * n, A] | None
        results = []
        for j, i in enumerate(chunk):
            completions = []
            for k in range(n):
                row = j * n + k
                toks, finish = _cut_row(new[row].tolist(), drawn[row].tolist(), set(stops))
                if finish == "length" and settings.stop and self.tokenizer is not None:
                    # A stop string completed by the very last allowed token ends the row early too.
                    text = self.tokenizer.decode(toks)
                    finish = "stop" if any(s in text for s in settings.stop) else finish
                lp = logps[row, : len(toks)].tolist() if logps is not None else None
                completions.append(Completion(toks, lp, finish))
            results.append(GenerationOutput(i, list(requests[i].prompt_token_ids), completions))
        return results

    def update_weights(self, named_tensors: NamedTensors) -> int:
        """Copy tensors into the model (names in the model's own naming); returns the count.

        Tied parameters are reachable under every name (a tied checkpoint's ``lm_head.weight`` is the embedding):
        a trainer's ``state_dict()`` lists both names and both must be accepted.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
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


@contextlib.contextmanager
def _checkpoint_defaults_hidden(model: Any) -> Iterator[None]:
    """Hide the checkpoint's generation defaults from ``generate`` for the duration of one call.

    transformers fills every field a given ``GenerationConfig`` leaves unset from ``model.generation_config``
    (``repetition_penalty``, ``suppress_tokens``, ``sequence_bias``, ...), each of which would add a logits
    processor the actor never applies. A blank config in its place leaves nothing to merge.
    """
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _cut_row(generated: list[int], drawn: list[int], stops: set[int]) -> tuple[list[int], str]:
    """The real part of one ``generate`` row and its finish reason.

    transformers appends the sampler's draw while a row runs and the pad token once it has finished (stop token or
    stop string), so the row's real tokens are the prefix where appended and drawn tokens agree; within it, the
    response ends at its first stop token. (A draw after a stop string that happens to be the pad token would be
    kept: a 1-in-vocabulary chance per stop-string finish.) A row that ran to ``max_new_tokens`` is "length".
    """
    k = next((t for t, (a, b) in enumerate(zip(generated, drawn)) if a != b), len(generated))
    toks = generated[:k]
    end = next((t + 1 for t, tok in enumerate(toks) if tok in stops), None)
    if end is not None:
        return toks[:end], "stop"
    return toks, "stop" if k < len(generated) else "length"
