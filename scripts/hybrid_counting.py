"""Side-by-side GRPO runs of the toy recipe on the counting task ("How many objects are in the image?", answers 1-4):
why a tiny Qwen3.5 learns it slower than the all-attention tiny models (docs/models.md, "Counting with a tiny hybrid").

Each variant is a policy directory built from the tiny models (nothing downloaded), trained with the toy recipe as
shipped but ``data.generator_options.task=count``, evaluated every ``--eval-steps`` on the held-out split:

- ``qwen2_vl``, ``qwen3_vl``: the all-attention tiny models (two full-attention layers; Qwen3-VL has the vision
  tower Qwen3.5 uses);
- ``qwen3_5``: the tiny hybrid as built (a Gated DeltaNet layer, then a full-attention layer);
- ``qwen3_5_full``: the same checkpoint with both layers full attention (the first one's attention weights newly
  initialised, seeded): the layer ablation;
- ``qwen3_5_slow``: the tiny hybrid with its Gated DeltaNet layer forgetting slowly (``A = exp(A_log)`` over
  0.02-0.2 instead of the random initialisation's 5-10, which forgets its state at the next token);
- ``qwen3_5_small``: the ``small`` tiny Qwen3.5 (8 layers, three linear to one full, hidden 512): capacity.

    python scripts/hybrid_counting.py --variants qwen2_vl,qwen3_5,qwen3_5_full --steps 300 --out outputs/counting

Runs go two at a time, each on one OpenMP thread. Prints one table (eval reward per evaluation, per variant) and
writes it to ``OUT/counting.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIANTS = ("qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3_5_full", "qwen3_5_slow", "qwen3_5_small")


def policy_dir(variant: str, out: Path) -> str:
    """The policy checkpoint of ``variant`` (see the module docstring), built under ``out`` where it is derived."""
    from mmrlhf.testing.tiny_models import tiny_model_dir

    if variant in ("qwen2_vl", "qwen3_vl", "qwen3_5"):
        return str(tiny_model_dir(variant, "tiny", 0))
    if variant == "qwen3_5_small":
        return str(tiny_model_dir("qwen3_5", "small", 0))
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    base = Path(tiny_model_dir("qwen3_5", "tiny", 0))
    target = out / "models" / variant
    if (target / "config.json").exists():
        return str(target)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(base)
    if variant == "qwen3_5_full":
        config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
    model = AutoModelForImageTextToText.from_pretrained(base, config=config, dtype=torch.float32)
    if variant == "qwen3_5_slow":
        from mmrlhf.models.linear_attention import recurrent_layers

        with torch.no_grad():
            for layer in recurrent_layers(model):
                layer.A_log.copy_(torch.linspace(0.02, 0.2, layer.A_log.numel()).log())
    model.save_pretrained(target)
    for name in base.iterdir():  # tokenizer, processor, chat template, generation config
        if name.is_file() and not name.name.startswith(("model", "config.json")) and name.suffix != ".safetensors":
            shutil.copy(name, target / name.name)
    return str(target)


def launch(variant: str, policy: str, out: Path, steps: int, eval_steps: int, seed: int) -> subprocess.Popen:
    run_dir = out / variant
    cmd = [sys.executable, "-m", "mmrlhf", "train", str(ROOT / "examples" / "grpo_toy_shapes_cpu.yaml"),
           f"model.pretrain={policy}", f"trainer.output_dir={run_dir}", "trainer.overwrite_output_dir=true",
           "data.generator_options.task=count", f"trainer.max_steps={steps}", f"trainer.eval_steps={eval_steps}",
           "trainer.save_steps=100000", "trainer.progress_bar=false", "trainer.report_steps=0",
           f"trainer.seed={seed}", f"rollout.seed={seed}"]
    log = open(out / f"{variant}.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def evals(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["eval/reward/mean"] for r in rows if "eval/reward/mean" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="qwen2_vl,qwen3_vl,qwen3_5,qwen3_5_full,qwen3_5_slow")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--out", default="outputs/counting")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        print(f"error: unknown variants {sorted(unknown)}; valid: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    policies = {v: policy_dir(v, out) for v in variants}
    pending, running, failed = list(variants), {}, []
    while pending or running:
        while pending and len(running) < args.parallel:
            v = pending.pop(0)
            running[v] = launch(v, policies[v], out, args.steps, args.eval_steps, args.seed)
            print(f"started {v}", flush=True)
        for v, proc in list(running.items()):
            if proc.poll() is not None:
                del running[v]
                print(f"{v}: rc {proc.returncode}", flush=True)
                if proc.returncode:
                    failed.append(v)
        if running:
            time.sleep(5)
    table = {v: evals(out / v) for v in variants if v not in failed}
    steps = sorted({s for e in table.values() for s in e})
    lines = ["| variant | " + " | ".join(f"eval @ {s}" for s in steps) + " | best |",
             "|---|" + "---:|" * (len(steps) + 1)]
    for v, e in table.items():
        lines.append(f"| {v} | " + " | ".join(f"{e[s]:.2f}" if s in e else "-" for s in steps)
                     + f" | {max(e.values()):.2f} |")
    text = "\n".join(lines)
    print(text)
    (out / "counting.md").write_text(text + "\n")
    if failed:
        print(f"failed: {failed} (logs in {out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
