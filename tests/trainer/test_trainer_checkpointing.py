"""``trainer.gradient_checkpointing`` from the config to the models: the builder checkpoints the policy's and the
critic's language blocks (the frozen vision tower's are left alone), and a training step then recomputes them in
its updates; off, nothing is checkpointed and nothing recomputed. The numbers are checked in
tests/models/test_models_checkpointing.py (and under FSDP2 in test_models_fsdp.py)."""

from __future__ import annotations

import pytest

from mmrlhf.models import gradient_checkpointing as gc
from mmrlhf.models.sharding import block_modules
from mmrlhf.trainer.builder import build_trainer
from trainer_helpers import metrics_rows, toy_config


def _blocks(model) -> tuple[list, list]:
    """(language blocks, vision-tower blocks) of an actor or a critic."""
    body = getattr(model, "body", model)
    tower, _ = body.adapter.vision_parts(body.model)
    in_tower = {id(m) for m in tower.modules()}
    blocks = block_modules(body.model)
    return [b for b in blocks if id(b) not in in_tower], [b for b in blocks if id(b) in in_tower]


@pytest.mark.parametrize("on", [True, False])
def test_the_builder_checkpoints_from_the_config_and_the_update_recomputes(tmp_path, monkeypatch, on):
    entered = set()  # the blocks whose forward ran inside a checkpoint
    real = gc.checkpoint
    monkeypatch.setattr(gc, "checkpoint", lambda fn, *a, **k: entered.add(id(fn.__self__)) or real(fn, *a, **k))
    reward = {"label_map": {"parity": {"type": "function", "function": "trainer_helpers:parity_reward"}},
              "default_recipe": [["parity", 1.0]]}  # varies within groups: the first step has a gradient
    cfg = toy_config(tmp_path / "run", algorithm={"advantage_estimator": "gae"}, reward=reward,
                     trainer={"gradient_checkpointing": on, "max_steps": 1})
    trainer = build_trainer(cfg)
    models = (trainer.p.policy.actor, trainer.p.critic.critic)
    for model in models:
        language, vision = _blocks(model)
        assert language and vision
        assert all(gc.is_checkpointed(b) is on for b in language)
        assert not any(gc.is_checkpointed(b) for b in vision)  # trainer.freeze_vision_tower defaults to true
    with trainer.p.tracker:
        trainer.fit()
    row = metrics_rows(tmp_path / "run")[0]
    assert row["policy/grad_norm"] > 0 and row["critic/grad_norm"] > 0
    # the updates ran every language block of both models inside the checkpoint; off, none (that the no-grad
    # forwards of generation and scoring never enter it: tests/models/test_models_checkpointing.py)
    assert entered == ({id(b) for m in models for b in _blocks(m)[0]} if on else set())
