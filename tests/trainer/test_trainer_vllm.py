"""The trainer with the real vLLM engine (CPU): the saved policy serves in vLLM, weights sync every step (the
engine/trainer log-prob gap stays at float noise), a resume restores the data order and the state, and the toy
task learns with GRPO and with PPO."""

from __future__ import annotations

import pytest

from mmrlhf.trainer.builder import build_trainer
from trainer_helpers import metrics_rows, toy_config

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _fit(cfg, *, resume=False, record=None):
    trainer = build_trainer(cfg, resume=resume)
    if record is not None:  # log the record ids each step trains on
        real = trainer.p.source.stream.next_batch

        def next_batch(n):
            records = real(n)
            record.append([r.record_id for r in records])
            return records

        trainer.p.source.stream.next_batch = next_batch
    with trainer.p.tracker:
        trainer.fit()
    return trainer


def test_sync_keeps_engine_and_trainer_together_and_the_checkpoint_serves_in_vllm(tmp_path):
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.types import GenerationRequest, SamplingSettings
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    trainer = _fit(toy_config(tmp_path / "run", engine="vllm", trainer={"max_steps": 3, "lr": 3e-3}))
    rows = metrics_rows(tmp_path / "run")
    # every step after the first samples from a policy the trainer has updated: the gap stays at float noise
    assert all(r["engine_logprob_diff/max"] < 1e-3 for r in rows), [r["engine_logprob_diff/max"] for r in rows]
    assert rows[-1]["policy/optimizer_steps"] >= 1 and rows[-1]["sync/tensors"] > 0
    model_dir = trainer.p.checkpoints.latest() / "model"
    engine = trainer.p.source.maker.engine
    engine.close()
    del trainer
    served = VLLMEngine(str(model_dir), get_adapter(model_dir), max_model_len=128, dtype="float32")
    try:
        out = served.generate([GenerationRequest(prompt="<|im_start|>user\nName a colour.<|im_end|>\n"
                                                        "<|im_start|>assistant\n")],
                              SamplingSettings(n=2, max_new_tokens=4, seed=0))
        assert len(out.outputs[0].completions) == 2 and all(c.token_ids for c in out.outputs[0].completions)
    finally:
        served.close()


def test_vllm_resume_restores_data_order_and_state(tmp_path):
    extra = {"trainer": {"max_steps": 3, "save_steps": 2}}
    seen_full: list = []
    full = _fit(toy_config(tmp_path / "full", engine="vllm", **extra), record=seen_full)
    full_state = (full.p.source.stream.state_dict(), full.p.source.maker.state_dict(), full.state.step)
    full.p.source.maker.engine.close()
    del full
    seen_part: list = []
    part = _fit(toy_config(tmp_path / "part", engine="vllm", trainer={**extra["trainer"], "max_steps": 2}),
                record=seen_part)
    part.p.source.maker.engine.close()
    del part
    resumed = _fit(toy_config(tmp_path / "part", engine="vllm", **extra), resume=True, record=seen_part)
    assert seen_part == seen_full  # the prompts of every step, in order: the stream continued, not restarted
    assert (resumed.p.source.stream.state_dict(), resumed.p.source.maker.state_dict(), resumed.state.step) == full_state
    assert [r["step"] for r in metrics_rows(tmp_path / "part")] == [1, 2, 3]
    resumed.p.source.maker.engine.close()


def _recipe(out, *overrides):
    from mmrlhf.config import load_config
    from mmrlhf.testing.tiny_models import tiny_model_dir

    return load_config("examples/grpo_toy_shapes_cpu.yaml", [
        f"model.pretrain={tiny_model_dir('qwen2_vl')}", f"trainer.output_dir={out}", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "trainer.report_steps=0", "trainer.save_steps=1000", *overrides])


def _reward_gain(rows, first=10, last=10):
    mean = lambda rs: sum(r["reward/mean"] for r in rs) / len(rs)  # noqa: E731
    return mean(rows[:first]), mean(rows[-last:])


def test_grpo_learns_the_toy_task(tmp_path):
    """The quick start's recipe, shortened: measured on 3 seeds, the greedy evaluation on fresh prompts reached
    1.0 by step 120 (0.5 / 0.91 / 1.0 at step 100) and the sampled reward rose from ~0.01 to 0.54-0.71 over
    steps 111-120. Seed 0 (this run; evaluations do not move training, so its 120 steps are the README run's):
    0.75 at step 100, 1.0 at 120, reward 0.006 over steps 1-10 and 0.49 over 111-120 (2026-11-28). Thresholds
    keep a wide margin."""
    _fit(_recipe(tmp_path / "grpo", "trainer.max_steps=120", "trainer.eval_steps=60"))
    rows = metrics_rows(tmp_path / "grpo")
    start, end = _reward_gain(rows)
    assert start < 0.05 and end > 0.3, (start, end)
    assert rows[-1]["eval/reward/mean"] >= 0.75, rows[-1]["eval/reward/mean"]
    assert max(r["groups/with_variance_frac"] for r in rows[-20:]) > 0.5  # no collapse onto one answer


def test_ppo_with_a_critic_learns_the_toy_task(tmp_path):
    """PPO: a critic (CriticVL, clipped value loss, its own optimiser) and GAE advantages, whitened per step, on the
    toy recipe's answer-words variant (``mmrlhf.testing.toy_recipe``). Measured over 40 steps (2026-11-29): the
    sampled reward rose from 0.03 at step 1 (0.13 over steps 1-5) to 0.68 over steps 16-20 and 0.87 at step 40.
    (As shipped, over 200 steps: 0.004 over steps 1-10, 0.11 at step 80, 0.98 at the end; the greedy evaluation
    1.0 at step 120.) This shorter run asserts the rise with margin."""
    from mmrlhf.testing.toy_recipe import ANSWER_WORDS_ONLY

    _fit(_recipe(tmp_path / "ppo", "trainer.max_steps=20", "trainer.eval_steps=0", "algorithm.advantage_estimator=gae",
                 "algorithm.advantage_whitening=batch", "trainer.critic_lr=3e-4", *ANSWER_WORDS_ONLY))
    rows = metrics_rows(tmp_path / "ppo")
    start, end = _reward_gain(rows, first=5, last=5)
    assert rows[0]["reward/mean"] < 0.15 and end > 0.4 and end > 3 * start, (start, end)
    assert all(r["critic/optimizer_steps"] >= 1 for r in rows)
    assert rows[-1]["critic/vf_loss"] < rows[0]["critic/vf_loss"] or rows[-1]["critic/vf_mean"] != 0
