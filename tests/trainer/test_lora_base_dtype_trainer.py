"""``model.lora.base_dtype: bfloat16`` through the trainer: a LoRA run with bf16 compute is the same run, metrics
and trained adapters bit for bit, with the frozen base's Linear weights held in half the memory."""

from __future__ import annotations

import torch

from trainer_helpers import metrics_rows, stable, toy_config


def _run(out, base_dtype: str):
    from safetensors.torch import load_file

    from mmrlhf.trainer.builder import build_trainer

    cfg = toy_config(out, model={"dtype": "bfloat16", "lora": {"rank": 4, "alpha": 8, "base_dtype": base_dtype}},
                     reward={"label_map": {"parity": {"type": "function",
                                                      "function": "trainer_helpers:parity_reward"}},
                             "default_recipe": [["parity", 1.0]]},
                     trainer={"max_steps": 3, "save_steps": 3})
    trainer = build_trainer(cfg)
    actor = trainer.p.policy.actor
    held = sum(p.numel() * p.element_size() for p in actor.parameters())
    dtypes = {p.dtype for p in actor.parameters() if not p.requires_grad}
    with trainer.p.tracker:
        trainer.fit()
    adapters = load_file(str(trainer.p.checkpoints.latest() / "adapter" / "adapter_model.safetensors"))
    return [stable(r) for r in metrics_rows(out)], adapters, held, dtypes


def test_a_bf16_base_trains_the_same_adapters_in_less_memory(tmp_path):
    rows32, adapters32, held32, dtypes32 = _run(tmp_path / "fp32", "float32")
    rows16, adapters16, held16, dtypes16 = _run(tmp_path / "bf16", "bfloat16")
    assert dtypes32 == {torch.float32} and dtypes16 == {torch.float32, torch.bfloat16}
    assert held16 < 0.75 * held32, (held16, held32)  # the tiny model's embeddings stay float32
    assert len(rows16) == 3 and rows16 == rows32
    assert rows16[-1]["policy/grad_norm"] > 0
    assert adapters16.keys() == adapters32.keys()
    assert all(torch.equal(adapters16[k], adapters32[k]) for k in adapters16)
    assert any(float(v.abs().max()) > 0 for k, v in adapters16.items() if "lora_B" in k)  # the adapters trained
