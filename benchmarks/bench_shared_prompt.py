"""Shared-prompt (grouped) vs per-sample packed forward + backward (prints a Markdown table; not a test).

One GRPO group: a prompt sampled ``--n`` times with answers of ``--min-answer``..``--max-answer`` tokens, scored
by ``ActorVL`` as the policy update does (forward, PPO-style loss, backward through the whole model, vision tower
included): in the per-sample layouts, padded and packed (every sample carries its prompt and image), in
micro-batches of ``--micro`` samples with accumulated gradients; and in the grouped layout (the prompt and its
image once, the whole group as one row, which holds fewer tokens than one 4-sample packed micro-batch). On the CPU
the packed layout pays a dense [T, T] mask (transformers' sdpa path has no variable-length kernel there), so the
speed-up is quoted against the FASTER per-sample layout. Cases:

- image-heavy: one image of ``--image-px`` square pixels (896 px = 1,024 vision tokens with 14-px patches merged
  2x2), n = 16, 32-128-token answers;
- text-only: a ~``--text-tokens``-token text prompt, same answers.

Reports per layout the tokens through the decoder, the vision-tower calls and patch rows encoded, the best time
of ``--repeats`` runs, and the grouped/packed speed-up measured side by side; plus the largest log-prob and
gradient difference between the layouts (they compute the same thing).

Run:  python benchmarks/bench_shared_prompt.py [--size tiny|small] [--n 16] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch


def _pieces(processor, adapter, *, image_px: int | None, text_tokens: int, n: int, lo: int, hi: int, seed: int):
    """(prompts, responses, vision) of one group."""
    from PIL import Image

    from mmrlhf.testing.engine_check import CheckCase, processor_inputs

    words = " ".join(["describe"] * text_tokens) if image_px is None else "How many squares are there?"
    parts = ([{"type": "image"}] if image_px else []) + [{"type": "text", "text": words}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    images = [Image.new("RGB", (image_px, image_px), (200, 30, 30))] if image_px else []
    inputs = dict(processor_inputs(processor, adapter, CheckCase("bench", text, images=images)))
    prompt = inputs["input_ids"][0].tolist()
    vision = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    g = torch.Generator().manual_seed(seed)
    vocab = processor.tokenizer.vocab_size
    banned = set(adapter.vision_special_token_ids()) | {processor.tokenizer.eos_token_id}
    responses = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        toks = [t for t in torch.randint(0, vocab, (length * 2,), generator=g).tolist() if t not in banned][:length]
        responses.append(toks)
    return [prompt] * n, responses, [vision] * n


class VisionCounter:
    """Counts the vision tower's calls and the patch rows it encodes (a forward pre-hook)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.calls = self.rows = 0
        tower.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.calls += 1
        self.rows += int(args[0].shape[0]) if args else 0

    def reset(self) -> None:
        self.calls = self.rows = 0


def _step(actor, micros, model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, a PPO-style surrogate over all response tokens, backward, per micro-batch (gradients accumulate, as
    in the trainer). Returns (log-probs [B, A] of the whole group, grads)."""
    model.zero_grad(set_to_none=True)
    outs = []
    total = sum(int(b.samples.response_length.sum()) for b in micros)  # the group's response tokens
    advantages = torch.linspace(-1, 1, sum(b.samples.batch_size for b in micros))  # [B] fixed per sample
    first = 0
    for built in micros:
        out = actor(built.samples, vision_extra=built.vision_extra, return_entropy=True)
        b = out.log_probs.shape[0]
        adv = advantages[first: first + b, None]  # [b, 1] the same per sample, whatever the split
        mask = out.action_mask.float()
        ratio = (out.log_probs - out.log_probs.detach()).exp()
        loss = -((ratio * adv * mask).sum() + 0.01 * (out.entropy * mask).sum()) / total
        loss.backward()
        outs.append(out.log_probs.detach())
        first += b
    width = max(o.shape[1] for o in outs)
    logp = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in outs])
    return logp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_case(name, actor, model, counter, pieces, repeats, pad_id, eos, adapter, micro: int) -> dict:
    from mmrlhf.experience.grouped import build_grouped_samples
    from mmrlhf.experience.samples import build_packed_samples, build_padded_samples

    prompts, responses, vision = pieces
    kw = dict(pad_id=pad_id, eos_id=eos, adapter=adapter, vision=vision)
    def split(build):  # the trainer's micro-batches of `micro` samples
        return [build(prompts[i: i + micro], responses[i: i + micro], **{**kw, "vision": vision[i: i + micro]})
                for i in range(0, len(prompts), micro)]

    layouts = {"padded": split(build_padded_samples), "packed": split(build_packed_samples),
               "grouped": [build_grouped_samples(prompts, responses, **kw)]}
    row: dict = {"case": name, "n": len(prompts), "prompt_tokens": len(prompts[0]),
                 "answer_tokens": f"{min(map(len, responses))}-{max(map(len, responses))}"}
    outs = {}
    for layout, built in layouts.items():
        times = []
        for _ in range(repeats):
            counter.reset()
            t0 = time.perf_counter()
            outs[layout] = _step(actor, built, model)
            times.append(time.perf_counter() - t0)
        row[f"{layout}_tokens"] = sum(int((b.samples.segment_ids != -1).sum()) if layout == "grouped"
                                      else int(b.samples.sequences.numel()) for b in built)
        row[f"{layout}_vision_calls"], row[f"{layout}_patch_rows"] = counter.calls, counter.rows
        row[f"{layout}_s"] = min(times)
    row["best_per_sample"] = min(("padded", "packed"), key=lambda k: row[f"{k}_s"])
    row["speedup"] = row[f"{row['best_per_sample']}_s"] / row["grouped_s"]
    row["max_logprob_diff"] = float((outs["packed"][0] - outs["grouped"][0]).abs().max())
    ga, gb = outs["packed"][1], outs["grouped"][1]
    row["max_grad_rel_diff"] = max(float((ga[k] - gb[k]).norm() / ga[k].norm().clamp_min(1e-12)) for k in ga)
    return row


def main() -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--family", default="qwen2_vl")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--image-px", type=int, default=896)
    ap.add_argument("--text-tokens", type=int, default=1000)
    ap.add_argument("--min-answer", type=int, default=32)
    ap.add_argument("--max-answer", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro", type=int, default=4,
                    help="samples per forward+backward of the per-sample layouts (trainer.micro_train_batch_size; "
                         "the grouped layout runs the whole group as one row, in less memory than 4 packed samples)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 repeat (a smoke run)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.quick:
        args.size, args.repeats = "tiny", 1

    path = tiny_model_dir(args.family, args.size, 0)
    processor = AutoProcessor.from_pretrained(path)
    # The tiny processors cap images at 64 LLM tokens; lift the cap so --image-px decides (as a real checkpoint's
    # max_pixels of ~1-12 M pixels does).
    ip = processor.image_processor
    ip.size = {"shortest_edge": ip.size["shortest_edge"], "longest_edge": max(ip.size["longest_edge"],
                                                                              args.image_px ** 2)}
    adapter = get_adapter(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    actor = ActorVL(model, adapter)
    counter = VisionCounter(adapter.vision_parts(model)[0])
    eos, pad_id = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    common = dict(n=args.n, lo=args.min_answer, hi=args.max_answer, seed=0)
    cases = {
        "image-heavy": _pieces(processor, adapter, image_px=args.image_px, text_tokens=0, **common),
        "text-only": _pieces(processor, adapter, image_px=None, text_tokens=args.text_tokens, **common),
    }
    rows = [run_case(name, actor, model, counter, pieces, args.repeats, pad_id, eos, adapter, args.micro)
            for name, pieces in cases.items()]

    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"Shared-prompt vs per-sample forward+backward: {args.family} {args.size} ({params:.0f} M params, float32, "
          f"{torch.get_num_threads()} threads); one group of n = {args.n}; per-sample layouts in micro-batches of "
          f"{args.micro}, grouped as one row; best of {args.repeats}\n")
    print("| case | prompt tok | answers | decoder tokens (padded / packed / grouped) | vision calls per step "
          "(per-sample / grouped) | patch rows encoded (per-sample / grouped) | padded s | packed s | grouped s "
          "| speed-up vs best per-sample | max log-prob diff | max grad rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['prompt_tokens']} | {r['answer_tokens']} | {r['padded_tokens']} / "
              f"{r['packed_tokens']} / {r['grouped_tokens']} | {r['packed_vision_calls']} / "
              f"{r['grouped_vision_calls']} | {r['packed_patch_rows']} / {r['grouped_patch_rows']} | "
              f"{r['padded_s']:.2f} | {r['packed_s']:.2f} | {r['grouped_s']:.2f} | **{r['speedup']:.2f}x** "
              f"(vs {r['best_per_sample']}) | {r['max_logprob_diff']:.1e} | {r['max_grad_rel_diff']:.1e} |")
    print("\nvision calls: forwards of the vision tower per forward+backward (a layout encodes all its images in one "
          "call); patch rows: the work those calls do. log-prob / gradient differences are packed vs grouped.")
    if args.json:
        from _results import table, write_json

        img = next(r for r in rows if r["case"] == "image-heavy")
        txt = next(r for r in rows if r["case"] == "text-only")
        columns = ["case", "prompt tokens", "answers", "decoder tokens padded", "packed", "grouped",
                   "vision patch rows per-sample", "grouped", "padded s", "packed s", "grouped s",
                   "speed-up vs best per-sample", "max log-prob diff", "max grad rel diff"]
        cells = [[r["case"], r["prompt_tokens"], r["answer_tokens"], r["padded_tokens"], r["packed_tokens"],
                  r["grouped_tokens"], r["packed_patch_rows"], r["grouped_patch_rows"], r["padded_s"], r["packed_s"],
                  r["grouped_s"], r["speedup"], r["max_logprob_diff"], r["max_grad_rel_diff"]] for r in rows]
        write_json(args.json, "shared_prompt",
                   f"shared prompt fwd+bwd {img['speedup']:.1f}x faster image-heavy, {txt['speedup']:.1f}x text-only "
                   f"(n = {args.n}, {args.family} {args.size})",
                   {k: v for k, v in vars(args).items() if k != "json"},
                   [table("Forward + backward of one group, per layout", columns, cells)])


if __name__ == "__main__":
    main()
