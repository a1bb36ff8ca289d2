"""Helpers for the model-side tests: a mixed batch of the engine-check cases with random responses, and an
independent per-sample reference (the HF model's own full-logits forward on one unpadded sample)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmrlhf.testing.engine_check import default_cases, processor_inputs

PROMPT_ONLY_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


@dataclass
class Bundle:
    """A loaded tiny model with its processor, adapter and the default cases' processor outputs."""

    family: str
    model: Any
    processor: Any
    adapter: Any
    inputs: list[dict[str, torch.Tensor]]  # per case: the processor's full output for the prompt

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [x["input_ids"][0].tolist() for x in self.inputs]

    @property
    def vision(self) -> list[dict[str, torch.Tensor]]:
        return [{k: v for k, v in x.items() if k not in PROMPT_ONLY_KEYS} for x in self.inputs]

    @property
    def eos_id(self) -> int:
        return int(self.processor.tokenizer.eos_token_id)


def load_bundle(family: str, **model_kwargs: Any) -> Bundle:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir(family, "tiny", 0)
    processor = AutoProcessor.from_pretrained(path)
    adapter = get_adapter(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, **model_kwargs).eval()
    inputs = [dict(processor_inputs(processor, adapter, case)) for case in default_cases(processor)]
    return Bundle(family, model, processor, adapter, inputs)


def random_responses(bundle: Bundle, seed: int = 0) -> list[list[int]]:
    """Uneven responses per case (x2 samples per case): some end with EOS, one has junk after EOS, some have none.

    Tokens avoid vision specials and EOS except where planted.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = bundle.model.config.text_config.vocab_size
    banned = set(bundle.adapter.vision_special_token_ids()) | {bundle.eos_id}
    lengths = [5, 11, 1, 8, 13, 3, 9, 6]
    out = []
    for k, n in enumerate(lengths):
        toks = [t for t in torch.randint(0, vocab, (n + 8,), generator=g).tolist() if t not in banned][:n]
        if k % 3 == 0:
            toks[-1] = bundle.eos_id  # ends with EOS
        if k == 4:
            toks[6] = bundle.eos_id  # EOS in the middle: tokens after it must be dropped
        out.append(toks)
    return out


def batch_pieces(bundle: Bundle, seed: int = 0):
    """(prompt ids, responses, vision dicts, per-sample processor outputs): every case twice, interleaved."""
    n_cases = len(bundle.inputs)
    responses = random_responses(bundle, seed)
    order = [k % n_cases for k in range(len(responses))]
    prompts = [bundle.prompt_ids[c] for c in order]
    vision = [bundle.vision[c] for c in order]
    inputs = [bundle.inputs[c] for c in order]
    return prompts, responses, vision, inputs


@torch.no_grad()
def reference_log_probs(bundle: Bundle, inputs: dict[str, torch.Tensor], response: list[int],
                        excluded: Any = "vision") -> torch.Tensor:
    """[A] log-probs of ``response`` after one sample's prompt: the HF model's own full-logits forward on one
    unpadded, unpacked sample, float32. Positions are the adapter's for the sample alone (the installed
    transformers' own rule places text after a video differently from the engine; that the adapter's rule is the
    engine's is checked in test_models_engine_parity.py), so this reference checks padding, packing and the
    response bookkeeping."""
    if excluded == "vision":
        excluded = bundle.adapter.vision_special_token_ids()
    prompt = inputs["input_ids"]  # [1, P]
    resp = torch.tensor([response], dtype=prompt.dtype)  # [1, A]
    ids = torch.cat([prompt, resp], dim=1)  # [1, P + A]
    extra = {k: v for k, v in inputs.items() if k not in PROMPT_ONLY_KEYS}
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(resp)], dim=1)  # [1, P + A]
    positions = bundle.adapter.rope_index(
        ids, types, image_grid_thw=extra.get("image_grid_thw"), video_grid_thw=extra.get("video_grid_thw"),
        second_per_grid_ts=extra.get("second_per_grid_ts"),
    )  # [3, 1, P + A]
    logits = bundle.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                          position_ids=positions, **extra).logits.float()  # [1, P + A, V]
    step = logits[0, prompt.shape[1] - 1 : -1]  # [A, V]
    if excluded:  # the tokens the engines never sample (ActorVL's default: the vision special tokens)
        step[:, list(excluded)] = float("-inf")
    logq = torch.log_softmax(step, dim=-1)  # [A, V]
    return logq.gather(-1, resp[0, :, None])[:, 0]  # [A]


def built_batches(bundle: Bundle, seed: int = 0):
    """{"padded": BuiltSamples, "packed": BuiltSamples} of the mixed test batch (8 samples)."""
    from mmrlhf.experience.samples import build_packed_samples, build_padded_samples

    prompts, responses, vision, _ = batch_pieces(bundle, seed)
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id, adapter=bundle.adapter,
              vision=vision)
    return {"padded": build_padded_samples(prompts, responses, **kw),
            "packed": build_packed_samples(prompts, responses, **kw)}


def picked_batch(bundle: Bundle, rows: list[int], seed: int = 0):
    """The padded BuiltSamples of rows ``rows`` of the mixed test batch (in that order)."""
    from mmrlhf.experience.samples import build_padded_samples

    prompts, responses, vision, _ = batch_pieces(bundle, seed)
    return build_padded_samples([prompts[i] for i in rows], [responses[i] for i in rows],
                                pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id,
                                adapter=bundle.adapter, vision=[vision[i] for i in rows])


# Rows of the mixed batch (cases interleaved: text, one image, two images, video, twice) by kind: a rank whose
# micro-batch is text-only beside one whose micro-batch has images (the vision tower runs on one rank only).
TEXT_ROWS, IMAGE_ROWS = [0, 4], [1, 5]


def rank_range(batch: int, rank: int, world: int) -> range:
    """The contiguous samples rank ``rank`` of ``world`` scores (the batch divides evenly)."""
    assert batch % world == 0, (batch, world)
    per = batch // world
    return range(rank * per, (rank + 1) * per)


def sharded_batches(bundle: Bundle, rank: int, world: int) -> dict[str, tuple[Any, Any]]:
    """layout -> (SamplesVL, vision_extra) of this rank's contiguous share of the test batch."""
    from mmrlhf.models.actor import select_samples

    out = {}
    for layout, built in built_batches(bundle).items():
        rows = rank_range(built.samples.batch_size, rank, world)
        out[layout] = select_samples(built.samples, built.vision_extra, rows)
    return out


class LinearCalls:
    """Counts the forward calls of every Linear layer inside the transformer blocks of an actor (language and vision
    blocks apart): a block that is recomputed in the backward (activation checkpointing) runs them twice per step.
    Attach before any ``fully_shard`` (it finds the blocks by class name)."""

    def __init__(self, actor: Any):
        from mmrlhf.models.sharding import block_modules

        tower, _ = actor.adapter.vision_parts(actor.model)
        in_tower = {id(m) for m in tower.modules()}
        self.counts = {"language": 0, "vision": 0}
        for block in block_modules(actor.model):
            kind = "vision" if id(block) in in_tower else "language"
            for m in block.modules():
                if isinstance(m, torch.nn.Linear):
                    m.register_forward_pre_hook(lambda *_, k=kind: self.counts.__setitem__(k, self.counts[k] + 1))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def random_value_head(hidden: int, seed: int = 0) -> torch.nn.Linear:
    """A value head with small random weights drawn from its own generator (independent of the global RNG), so the
    critic's gradients reach every parameter and two processes build the same head."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.1)
        head.bias.copy_(torch.randn(head.bias.shape, generator=g) * 0.1)
    return head


def slow_decay(bundle: Bundle) -> Bundle:
    """``bundle`` with a copy of its model whose Gated DeltaNet layers forget slowly: ``A = exp(A_log)`` spread over
    0.02-0.2, a per-step decay ``exp(g)`` of about 0.97-0.75. Why: the tiny models' random initialisation gives A of
    5-10, a decay of 1e-3 to 1e-6 per token, so the recurrent state is forgotten at the next token, and a test of a
    state carried across a boundary (a shared prompt's into its responses) would barely see it (measured: responses
    started from a zero recurrent state moved log-probs by 7e-6). The convolution tail is unaffected."""
    import copy

    from mmrlhf.models.linear_attention import recurrent_layers

    model = copy.deepcopy(bundle.model)
    with torch.no_grad():
        for layer in recurrent_layers(model):
            layer.A_log.copy_(torch.linspace(0.02, 0.2, layer.A_log.numel()).log())
    return Bundle(bundle.family, model, bundle.processor, bundle.adapter, bundle.inputs)
