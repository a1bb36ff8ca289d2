"""Evaluation never moves training: an evaluation names its own seed, so the run's per-call seed stream (and with it
every training sample) is the same whatever ``trainer.eval_steps`` is."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmrlhf.rollout.types import SamplingSettings, mix_seed
from mmrlhf.trainer.builder import build_trainer
from mmrlhf.trainer.evaluation import EVAL_STREAM, Evaluator
from trainer_helpers import metrics_rows, stable, toy_config


class _Maker:
    """The two parts of FastExperienceMaker this reads: its seed stream and a generation call (recorded)."""

    def __init__(self) -> None:
        from mmrlhf.experience.fast_maker import FastExperienceMaker

        self.sampling, self._calls, self.seeds = SamplingSettings(seed=7), 0, []
        self._sampling_for_call = FastExperienceMaker._sampling_for_call.__get__(self)

    def generate_rollout(self, **kwargs):
        sampling = {f.name for f in dataclasses.fields(SamplingSettings)} - {"n"}
        overrides = {k: v for k, v in kwargs.items() if k in sampling}  # the rest: the records' columns
        self.seeds.append(self._sampling_for_call(overrides, kwargs["n"]).seed)
        raise _Done


class _Done(Exception):
    pass


def test_a_call_that_names_its_seed_leaves_the_stream_where_it_was():
    maker = _Maker()
    first = maker._sampling_for_call({}, 4)
    named = maker._sampling_for_call({"seed": 123, "temperature": 0.0}, 1)
    second = maker._sampling_for_call({}, 4)
    assert (first.seed, named.seed, second.seed) == (mix_seed(7, 0), 123, mix_seed(7, 1))
    assert maker._calls == 2 and dataclasses.replace(named, seed=None, temperature=1.0, n=4) == \
        dataclasses.replace(first, seed=None)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_the_evaluator_names_its_own_seed(greedy):
    from mmrlhf.data.types import PromptRecord

    maker = _Maker()
    evaluator = Evaluator(maker, [PromptRecord(prompt="x", record_id="r0", index=0)], greedy=greedy, n_samples=2, seed=7)
    for _ in range(2):
        with pytest.raises(_Done):
            evaluator.run()
    assert maker.seeds == [mix_seed(7, EVAL_STREAM)] * 2  # the same every evaluation, apart from training's
    assert maker._calls == 0
    assert mix_seed(7, EVAL_STREAM) not in {mix_seed(7, k) for k in range(1000)}


def test_an_evaluation_whose_every_prompt_was_skipped_is_one_data_error():
    """A held-out set with no usable prompt (every image missing, say) is refused naming the records, not a mean of
    nothing or a missing metric."""
    from mmrlhf.data.errors import DataError
    from mmrlhf.data.types import PromptRecord
    from mmrlhf.experience.skips import empty_rewards
    from mmrlhf.experience.rollout import Rollout, ScoredRollout

    class Empty:
        def generate_rollout(self, **kwargs):
            return ScoredRollout(Rollout.empty(), empty_rewards(), SamplingSettings(), {"samples": 0.0},
                                 skipped=["record 0 (id='r0'), field 'images': image file not found"])

    with pytest.raises(DataError, match=r"every held-out prompt was skipped \(record 0 \(id='r0'\), field 'images'"):
        Evaluator(Empty(), [PromptRecord(prompt="x", record_id="r0", index=0)]).run()


@pytest.mark.vllm
@pytest.mark.slow
def test_training_is_the_same_whatever_the_evaluation_cadence(tmp_path):
    """Two vLLM runs that differ only in ``trainer.eval_steps`` (every step, and only at the end): the same training
    metrics at every step and the same final weights, bit for bit."""
    from safetensors.torch import load_file

    pytest.importorskip("vllm")
    weights, rows = {}, {}
    for cadence in (1, 4):
        out = tmp_path / f"eval{cadence}"
        trainer = build_trainer(toy_config(out, engine="vllm", trainer={"max_steps": 4, "eval_steps": cadence}))
        with trainer.p.tracker:
            trainer.fit()
        trainer.p.source.maker.engine.close()
        weights[cadence] = load_file(str(trainer.p.checkpoints.latest() / "model" / "model.safetensors"))
        rows[cadence] = [{k: v for k, v in stable(r).items() if not k.startswith("eval/")}
                         for r in metrics_rows(out)]
        del trainer
    assert sum("eval/reward/mean" in r for r in metrics_rows(tmp_path / "eval1")) == 4
    assert len(rows[1]) == len(rows[4]) == 4
    for step, (a, b) in enumerate(zip(rows[1], rows[4]), start=1):
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    assert rows[1][0]["policy/optimizer_steps"] >= 1  # weights moved, so equal weights say something
    assert weights[1].keys() == weights[4].keys()
    for name, tensor in weights[1].items():
        assert torch.equal(tensor, weights[4][name]), name
