"""What ``trainer.gradient_checkpointing`` saves and costs in one training forward + backward of ``ActorVL``
(prints a table; not a test, not in ``run_all.py``).

For checkpointing off and on, on the same model and batch: the bytes autograd keeps for the backward (counted with
saved-tensor hooks, parameters left out: :mod:`mmrlhf.testing.saved_tensors`; independent of the device), the time
of forward + backward (median of ``--repeats``, after a warm-up) and, on CUDA, the allocator's peak during the step
above what was allocated before it. The model is a random Qwen-VL of the tiny-model sizes (``small``: hidden 512,
8 layers) in eval mode with its vision tower frozen, as the trainer runs it; the batch is ``--batch`` text samples
of ``--seq`` tokens (half prompt, half response): the decoder is what checkpointing recomputes.

Usage:  python benchmarks/bench_checkpointing.py [--family qwen2_5_vl] [--size small] [--batch 4] [--seq 1024]
        [--dtype float32|bfloat16] [--device auto] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import table, write_json  # noqa: E402


def _batch(model, adapter, tokenizer, batch: int, seq: int):
    from mmrlhf.experience.samples import build_padded_samples

    g = torch.Generator().manual_seed(0)
    banned = set(adapter.vision_special_token_ids()) | {tokenizer.eos_token_id, tokenizer.pad_token_id}
    allowed = torch.tensor([t for t in range(model.config.get_text_config().vocab_size) if t not in banned])
    ids = allowed[torch.randint(0, len(allowed), (batch, seq), generator=g)].tolist()  # [B, S]
    half = seq // 2
    return build_padded_samples([r[:half] for r in ids], [r[half:] for r in ids], pad_id=tokenizer.pad_token_id,
                                eos_id=tokenizer.eos_token_id, adapter=adapter, vision=[{}] * batch)


def measure(actor, built, device: torch.device, repeats: int) -> dict:
    from mmrlhf.testing.saved_tensors import saved_tensor_bytes

    def step() -> int:
        out, kept = saved_tensor_bytes(lambda: actor(built.samples, vision_extra=built.vision_extra),
                                       exclude=actor.parameters())
        out.log_probs.sum().backward()
        actor.zero_grad(set_to_none=True)
        return kept

    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    step()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        kept = step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return {"saved_mb": kept / 2**20, "step_s": statistics.median(times), "peak_mb": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen2_5_vl")
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (autocast)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.devices import resolve_device
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.models.gradient_checkpointing import checkpoint_blocks
    from mmrlhf.testing.tiny_models import tiny_model_dir
    from mmrlhf.trainer.optim import freeze_vision

    device = resolve_device(args.device)
    path = tiny_model_dir(args.family, args.size, 0)
    adapter = get_adapter(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoProcessor.from_pretrained(path).tokenizer
    built = _batch(model, adapter, tokenizer, args.batch, args.seq)
    compute = None if args.dtype == "float32" else torch.bfloat16
    results = {}
    for mode in ("off", "on"):
        actor = ActorVL(copy.deepcopy(model), adapter, compute_dtype=compute).to(device).eval()
        freeze_vision(actor.model, adapter, tower=True, merger=False)
        if mode == "on":
            checkpoint_blocks(actor)
        results[mode] = measure(actor, built, device, args.repeats)
        del actor
    off, on = results["off"], results["on"]
    rows = [[mode, r["saved_mb"], r["peak_mb"], r["step_s"]] for mode, r in results.items()]
    cols = ["checkpointing", "saved for backward MB", "CUDA peak above start MB", "fwd+bwd s"]
    title = (f"{args.family} {args.size}, {args.batch} x {args.seq} tokens, {args.dtype} compute on {device} "
             f"(torch {torch.__version__})")
    print(title)
    for row in [cols, *rows]:
        print(" | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in row))
    headline = (f"saved tensors {on['saved_mb'] / off['saved_mb']:.2f}x, step time "
                f"{on['step_s'] / off['step_s']:.2f}x with checkpointing")
    print(headline)
    if args.json:
        write_json(args.json, "checkpointing", headline, vars(args), [table(title, cols, rows)])


if __name__ == "__main__":
    main()
