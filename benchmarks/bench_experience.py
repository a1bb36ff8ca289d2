"""Experience-making benchmark (prints a table; not a test).

With the "small" random Qwen2-VL (~29 M parameters): P prompts with one image x n samples x T new tokens.
  1. vLLM (in-process) vs transformers ``generate`` tokens/s, measured side by side in one run (ratio reported);
  2. the share of ``FastExperienceMaker.make_experience_list`` wall time spent outside generation and the
     actor / reference forwards (target < 10%).

Run:  python benchmarks/bench_experience.py [--prompts 32] [--samples 4] [--new-tokens 128] [--dtype float32]
(``min_new_tokens = max_new_tokens`` so both engines produce exactly the same number of tokens.)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _inputs(n_prompts: int):
    from PIL import Image

    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    prompts = ["<image>What color is the square? Answer with one word."] * n_prompts
    images = [[Image.new("RGB", (56, 56), colours[i % 4])] for i in range(n_prompts)]
    return prompts, images


def main() -> None:
    import torch
    from transformers import AutoProcessor

    from mmrlhf.algorithms.kl import FixedKLController
    from mmrlhf.data.processor import MultimodalDataProcessor
    from mmrlhf.experience.fast_maker import FastExperienceMaker
    from mmrlhf.experience.settings import ExperienceSettings
    from mmrlhf.models.actor import ActorVL
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rewards.engine import RewardComputationEngine
    from mmrlhf.rewards.sources import FunctionSource
    from mmrlhf.rollout.hf_engine import HFGenerateEngine
    from mmrlhf.rollout.types import SamplingSettings
    from mmrlhf.rollout.vllm_engine import VLLMEngine
    from mmrlhf.testing.tiny_models import tiny_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="both engines' precision (CPUs without bf16 hardware emulate bfloat16: float32 is faster)")
    ap.add_argument("--json", help="also write the rows to this JSON file (see benchmarks/_results.py)")
    args = ap.parse_args()

    path = str(tiny_model_dir("qwen2_vl", args.size))
    adapter, processor = get_adapter(path), AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    prompts, images = _inputs(args.prompts)
    dp = MultimodalDataProcessor(processor, 1024, adapter)
    batch = dp.process_multimodal_batch(prompts, images, n_samples_per_prompt=args.samples)
    settings = SamplingSettings(n=args.samples, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                seed=0)

    engine = VLLMEngine(path, adapter, max_model_len=1024, dtype=args.dtype)
    maker_settings = ExperienceSettings(n_samples_per_prompt=args.samples, micro_batch_size=16,
                                        need_reference=True, kl_in_reward=True)
    actor = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    ref = ActorVL.from_pretrained(path, dtype=torch.float32).eval()
    rewards = RewardComputationEngine(
        {"len": FunctionSource(lambda responses, prompts, labels, references, **_: [float(len(r) % 3)
                                                                                     for r in responses],
                               name="len")}, {}, default_recipe=[("len", 1.0)])
    maker = FastExperienceMaker(actor, engine, dp, rewards, tok, maker_settings, settings, initial_model=ref,
                                kl_controller=FixedKLController(0.01))
    reqs = maker._requests(batch, args.samples)

    engine.generate(reqs[:2], settings)  # warm-up
    t0 = time.perf_counter()
    res_v = engine.generate(reqs, settings)
    t_vllm = time.perf_counter() - t0

    hf_model = ActorVL.from_pretrained(path, dtype=getattr(torch, args.dtype)).model.eval()
    hf = HFGenerateEngine(hf_model, adapter, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                          pad_token_id=tok.pad_token_id, max_model_len=1024, batch_size=args.prompts)
    hf.generate(reqs[:1], SamplingSettings(n=1, max_new_tokens=4, min_new_tokens=4, seed=0))  # warm-up
    t0 = time.perf_counter()
    res_h = hf.generate(reqs, settings)
    t_hf = time.perf_counter() - t0

    exps = maker.make_experience_list(prompts, images=images)
    info = exps[0].info["batch"]
    inside = sum(info.get(f"time/{k}", 0.0) for k in ("generate", "actor", "reference", "critic"))
    outside = info["time/total"] - inside

    rows = [
        ("vLLM generate", f"{res_v.num_tokens} tokens", f"{t_vllm:.2f} s", f"{res_v.num_tokens / t_vllm:.0f} tok/s"),
        (f"transformers generate ({args.dtype})", f"{res_h.num_tokens} tokens", f"{t_hf:.2f} s",
         f"{res_h.num_tokens / t_hf:.0f} tok/s"),
        ("ratio vLLM / transformers", "", "", f"{(res_v.num_tokens / t_vllm) / (res_h.num_tokens / t_hf):.2f}x"),
        ("make_experience_list total", f"{int(info['samples'])} samples", f"{info['time/total']:.2f} s", ""),
        ("  generate + actor + reference", "", f"{inside:.2f} s", f"{inside / info['time/total']:.1%}"),
        ("  everything else", "", f"{outside:.2f} s", f"{outside / info['time/total']:.1%} (target < 10%)"),
    ]
    for phase in ("prepare", "build", "reward", "advantages", "other"):
        rows.append((f"    {phase}", "", f"{info.get('time/' + phase, 0.0):.3f} s", ""))
    print(f"model: qwen2_vl {args.size}; {args.prompts} prompts x 1 image x {args.samples} samples x "
          f"{args.new_tokens} new tokens; torch threads {torch.get_num_threads()}")
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'amount':>14}  {'time':>10}  rate / share")
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>14}  {r[2]:>10}  {r[3]}")
    if args.json:
        from _results import table, write_json

        rate_v, rate_h, total = res_v.num_tokens / t_vllm, res_h.num_tokens / t_hf, info["time/total"]
        phases = [[name, seconds, 100 * seconds / total] for name, seconds in (
            ("generate + actor + reference", inside), ("everything else", outside),
            *((f"  {p}", info.get("time/" + p, 0.0)) for p in ("prepare", "build", "reward", "advantages", "other")))]
        write_json(args.json, "experience",
                   f"vLLM / transformers generate {rate_v / rate_h:.2f}x; experience making outside generation and "
                   f"forwards {100 * outside / total:.1f}% (target < 10%)",
                   {"model": f"qwen2_vl {args.size}", "prompts": args.prompts, "samples": args.samples,
                    "new_tokens": args.new_tokens, "dtype": args.dtype, "torch_threads": torch.get_num_threads()},
                   [table(f"Rollout tokens/s, same requests, {args.dtype} in both engines",
                          ["engine", "tokens", "s", "tok/s", "vs transformers"],
                          [["vLLM", res_v.num_tokens, t_vllm, rate_v, rate_v / rate_h],
                           ["transformers generate", res_h.num_tokens, t_hf, rate_h, 1.0]]),
                    table(f"make_experience_list on {int(info['samples'])} samples: where the time goes",
                          ["part", "s", "share %"], phases)])


if __name__ == "__main__":
    main()
