"""LoRA with FSDP2 (2 ranks, gloo, CPU): the adapters train as on one rank with the same global batch.

lora_fsdp_worker.py shards a LoRA actor over 2 ranks (the base and the adapters; the trainer's language blocks as
units) and each rank backpropagates its half of the mixed batch (text, images, video). Here one unsharded process
does the whole batch: the all-gathered adapter gradients must match (float32, sized by each tensor's scale), for the
language-model targets and with the vision tower's Linear layers adapted too; so must the merged weights the engine
sync sends (gathered from the shards) and the adapter and merged model the checkpoint writes. Control: ranks that
draw their adapters from different seeds hold a policy no single process has (their shards disagree)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_fsdp_common import lora_actor, lora_loss
from models_testing import built_batches

from mmrlhf.models.lora import merged_weights
from mmrlhf.testing.tolerances import assert_close_at_scale, close_at_scale

WORLD = 2
WORKER = Path(__file__).with_name("lora_fsdp_worker.py")
CASES = ("language", "tower", "unseeded")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_fsdp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(WORKER), "--out", str(out), *CASES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def _reference(bundles, case: str):
    bundle = bundles["qwen2_vl"]
    actor = lora_actor(copy.deepcopy(bundle.model), bundle.adapter, case, seed=0)
    built = built_batches(bundle)["padded"]
    (lora_loss(actor(built.samples, vision_extra=built.vision_extra)) / WORLD).backward()
    grads = {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.grad is not None}
    return actor, grads


@pytest.mark.parametrize("case", ["language", "tower"])
def test_lora_on_two_ranks_trains_as_on_one(sharded, bundles, case):
    from safetensors.torch import load_file

    got = torch.load(sharded / f"{case}.pt", weights_only=True)
    actor, want = _reference(bundles, case)
    grads = {k[len("grad."):]: v for k, v in got.items() if k.startswith("grad.")}
    assert grads.keys() == want.keys() and all(".lora_" in n for n in want)
    assert any(".visual." in n for n in want) == (case == "tower")
    for name, g in want.items():
        assert_close_at_scale(grads[name], g, msg=name)
    merged = dict(merged_weights(actor.model))
    for name, w in merged.items():
        assert_close_at_scale(got[f"merged.{name}"], w, msg=name)
    # the checkpoint: adapter (what a resume loads) and the merged model, written by rank 0 from the gathered shards
    adapter = load_file(str(sharded / case / "adapter" / "adapter_model.safetensors"))
    state = {n: p.detach() for n, p in actor.named_parameters() if ".lora_" in n}
    assert len(adapter) == len(state)
    for key, value in adapter.items():  # peft's names: "base_model.model." + the HF name, no adapter name
        name = "model." + key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(value, state[name]), key
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(str(sharded / case / "model"), dtype=torch.float32)
    saved = loaded.state_dict()
    for name, w in merged.items():  # the merged layers as the engine sync sends them
        assert torch.equal(saved[name], w), name


def test_control_ranks_with_their_own_adapters_do_not_train_as_one(sharded, bundles):
    got = torch.load(sharded / "unseeded.pt", weights_only=True)
    _, want = _reference(bundles, "unseeded")
    grads = {k[len("grad."):]: v for k, v in got.items() if k.startswith("grad.")}
    assert not all(close_at_scale(grads[n], g) for n, g in want.items())
