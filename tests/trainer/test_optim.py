"""Learning-rate schedules and which parameters train."""

from __future__ import annotations

import math

import pytest
import torch

from mmrlhf.trainer.optim import build_optimizer, build_scheduler, freeze_vision, lr_factor


def test_warmup_then_schedules():
    kw = dict(warmup_steps=4, total_steps=14)
    assert [lr_factor(s, schedule="constant", **kw) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(14, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(9, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_factor(14, schedule="linear", min_ratio=0.1, **kw) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, schedule="step", **kw)


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([p], lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    sched = build_scheduler(opt, schedule="linear", warmup_steps=2, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025])


def test_no_weight_decay_on_norms_and_biases():
    lin, norm = torch.nn.Linear(3, 3), torch.nn.LayerNorm(3)
    opt = build_optimizer([*lin.parameters(), *norm.parameters()], lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99),
                          eps=1e-8)
    decays = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays[id(lin.weight)] == 0.1 and decays[id(lin.bias)] == 0.0 and decays[id(norm.weight)] == 0.0
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        build_optimizer(frozen.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_freeze_vision_tower_keeps_the_merger_trainable(family):
    from transformers import AutoModelForImageTextToText

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    adapter = get_adapter(path)
    counts = freeze_vision(model, adapter, tower=True, merger=False)
    names = {n: p.requires_grad for n, p in model.named_parameters()}
    merger = [n for n in names if ".visual.merger." in n or ".visual.deepstack_merger_list." in n]
    tower = [n for n in names if ".visual." in n and n not in merger]
    assert merger and tower
    assert all(names[n] for n in merger) and not any(names[n] for n in tower)
    assert all(v for n, v in names.items() if ".visual." not in n)  # the language model trains
    if family == "qwen3_vl":
        assert any("deepstack_merger_list" in n for n in merger)
    assert counts["frozen"] == sum(p.numel() for n, p in model.named_parameters() if n in tower)
    freeze_vision(model, adapter, tower=True, merger=True)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".visual." in n)
    freeze_vision(model, adapter, tower=False, merger=False)
    assert all(p.requires_grad for p in model.parameters())
    assert not math.isnan(counts["trainable"])
