"""One rank of ``test_tensor_parallel.py``'s engine check: a tensor-parallel vLLM engine over 2 torchrun ranks.

Each rank joins the gloo group as ``mmrlhf train`` does and builds the package's engine with ``tensor_parallel_size``
from the command line (vLLM's external launcher on the CPU platform). Both ranks submit the same greedy prompts.
Then every weight of the tiny model is perturbed (the same seeded noise on both ranks, the full tensors: what each
rank's FSDP2 gather hands the engine) and loaded with ``update_weights``; the engine's shard of each layer the test
reads is returned by ``apply_model`` and saved with the full tensor it came from, beside the greedy tokens and
log-probs before and after, of both ranks. Rank 0 writes ``OUT/result.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PROMPTS = ["What color is the square? Answer with one word.", "red green blue", "the cat sat on the"]
# the layers whose shard the test compares, by the end of their engine name -> the trainer's names they come from
LAYERS = {
    "layers.0.mlp.down_proj.weight": ["model.language_model.layers.0.mlp.down_proj.weight"],  # row-parallel
    "layers.0.self_attn.o_proj.weight": ["model.language_model.layers.0.self_attn.o_proj.weight"],  # row-parallel
    "layers.0.mlp.gate_up_proj.weight": [  # merged column-parallel
        "model.language_model.layers.0.mlp.gate_proj.weight", "model.language_model.layers.0.mlp.up_proj.weight"],
}


def engine_shards(model) -> dict[str, torch.Tensor]:
    """Runs in the engine's worker: the local shard of each layer of :data:`LAYERS` (module-level: picklable)."""
    out = {}
    for name, param in model.named_parameters():
        for end in LAYERS:
            if name.endswith(end) and "visual" not in name:
                out[end] = param.detach().clone()
    return out


def greedy(engine) -> tuple[list[list[int]], list[list[float]]]:
    from mmrlhf.rollout.types import GenerationRequest, SamplingSettings

    result = engine.generate([GenerationRequest(prompt=p) for p in PROMPTS],
                             SamplingSettings(temperature=0.0, max_new_tokens=6, seed=0))
    tokens = [o.completions[0].token_ids for o in result.outputs]
    logprobs = [o.completions[0].logprobs for o in result.outputs]
    return tokens, logprobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from mmrlhf.launch.backend import launched_by_torchrun
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.parallel.world import join_from_env, leave
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    world = join_from_env("gloo") if launched_by_torchrun() else None
    engine = VLLMEngine(args.model, get_adapter(args.model), max_model_len=128, dtype="float32",
                        tensor_parallel_size=args.tp)
    before = greedy(engine)

    from transformers import AutoModelForImageTextToText

    trainer_model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    new = {}
    for name, p in trainer_model.named_parameters():  # what every rank's FSDP2 gather hands its engine: full tensors
        new[name] = (p.detach() + 0.05 * p.detach().std().clamp_min(1e-3) * torch.randn(p.shape, generator=g))
    loaded = engine.update_weights(iter(new.items()))
    after = greedy(engine)
    shards = engine.llm.apply_model(engine_shards)  # one per worker of this process (mp: all of them, in order)
    rank = world.rank if world is not None else 0
    gathered = world.gather_objects((shards, before, after)) if world is not None else [(shards, before, after)]
    if rank == 0:
        full = {name: [new[src] for src in sources] for name, sources in LAYERS.items()}
        torch.save({"shards": [s for g in gathered for s in g[0]], "before": [g[1] for g in gathered],
                    "after": [g[2] for g in gathered], "loaded": loaded, "full": full, "tp": args.tp},
                   Path(args.out) / "result.pt")
    engine.close()
    if world is not None:
        leave()


if __name__ == "__main__":
    main()
