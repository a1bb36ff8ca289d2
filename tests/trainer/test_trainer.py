"""The training loop end to end on the transformers engine (fast): exact resume, checkpoints that load, failure
behaviour, dynamic sampling, and every trainer / algorithm key consumed."""

from __future__ import annotations

import signal

import pytest
import torch

from mmrlhf.trainer.builder import build_trainer
from mmrlhf.trainer.minibatch import NonFiniteError
from trainer_helpers import metrics_rows, stable, toy_config


def _fit(cfg, *, resume=False):
    trainer = build_trainer(cfg, resume=resume)
    with trainer.p.tracker:
        trainer.fit()
    return trainer


@pytest.mark.slow
def test_resume_gives_the_same_per_step_metrics_as_an_uninterrupted_run(tmp_path):
    """Steps 1-4 in one go vs steps 1-2, a new process state, and --resume to 4: equal metrics (transformers
    engine), the data stream continues where it stopped, and metrics.jsonl holds each step once."""
    extra = {"trainer": {"max_steps": 4, "save_steps": 2, "ppo_epochs": 2, "lr_scheduler": "cosine",
                         "warmup_steps": 2, "keep_last": None}}
    full = _fit(toy_config(tmp_path / "full", **extra))
    interrupted = build_trainer(toy_config(tmp_path / "part", trainer={**extra["trainer"], "save_steps": 100}))
    step = interrupted.train_step

    def ctrl_c_after_two_steps():
        out = step()
        if interrupted.state.step == 1:  # the loop increments after the call: this is the 2nd step
            signal.raise_signal(signal.SIGINT)  # what Ctrl-C does: finish the step, save, return
        return out

    interrupted.train_step = ctrl_c_after_two_steps
    with interrupted.p.tracker:
        interrupted.fit()
    assert interrupted.state.step == 2 and interrupted.p.checkpoints.latest().name == "step-00000002"
    resumed = _fit(toy_config(tmp_path / "part", **extra), resume=True)
    a, b = metrics_rows(tmp_path / "full"), metrics_rows(tmp_path / "part")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        sa, sb = stable(ra), stable(rb)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k] == pytest.approx(sb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
    assert resumed.p.source.stream.state_dict() == full.p.source.stream.state_dict()
    assert resumed.p.source.maker.state_dict() == full.p.source.maker.state_dict()
    for (n, p), (_, q) in zip(full.p.policy.actor.model.named_parameters(),
                              resumed.p.policy.actor.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)
    # control: the metrics of different steps differ, so equality above is not vacuous
    assert stable(a[2]) != stable(a[3])


def test_checkpoint_model_loads_in_transformers_and_generates(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    trainer = _fit(toy_config(tmp_path / "run", trainer={"max_steps": 2}))
    model_dir = trainer.p.checkpoints.latest() / "model"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)  # on the CPU
    for (n, p), (_, q) in zip(model.named_parameters(), trainer.p.policy.actor.model.named_parameters()):
        assert torch.equal(p, q.detach().to(p.device)), n  # the trained weights exactly (the trainer's: maybe a GPU)
    processor = AutoProcessor.from_pretrained(model_dir)
    ids = processor.tokenizer("What color is the square?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_nonfinite_losses_skip_the_update_then_stop_the_run(tmp_path):
    import trainer_helpers

    trainer_helpers.FLAKY_CALLS.clear()
    one_update = {"train_batch_size": 16}  # one optimiser step per rollout step
    trainer = _fit(toy_config(tmp_path / "flaky", algorithm={"policy_loss": "trainer_helpers:flaky_loss"},
                              trainer={"max_steps": 2, **one_update}))
    rows = metrics_rows(tmp_path / "flaky")
    assert rows[0]["policy/skipped_steps"] == 1 and rows[0]["policy/optimizer_steps"] == 0
    assert rows[1]["policy/skipped_steps"] == 0 and rows[1]["policy/skipped_steps_total"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.p.policy.actor.model.parameters())
    with pytest.raises(NonFiniteError, match="3 optimiser steps in a row"):
        _fit(toy_config(tmp_path / "broken", algorithm={"policy_loss": "trainer_helpers:nan_loss"},
                        trainer={"max_steps": 5, "max_consecutive_nonfinite": 3, **one_update}))
    assert len(metrics_rows(tmp_path / "broken")) == 2  # steps 1-2 logged, step 3 raised


def test_dynamic_sampling_refills_and_an_all_flat_step_is_logged(tmp_path):
    trainer = _fit(toy_config(tmp_path / "ds", algorithm={"dynamic_sampling": True,
                                                          "dynamic_sampling_max_extra_rounds": 2},
                              trainer={"max_steps": 2}))
    rows = metrics_rows(tmp_path / "ds")
    for r in rows:
        assert 1 <= r["dynamic_sampling/rounds"] <= 3
        assert r["dynamic_sampling/sampled_groups"] == 4 * r["dynamic_sampling/rounds"]
        if "train/samples_trained" in r:  # only kept groups (with reward variance) are trained on
            assert r["train/samples_trained"] == 4 * r["dynamic_sampling/fill_rate"] * 4
    # a reward that never varies: every step is flat, logged as such, and the run goes on
    flat = toy_config(tmp_path / "flat", algorithm={"dynamic_sampling": True, "dynamic_sampling_max_extra_rounds": 1},
                      reward={"label_map": {"one": {"type": "function", "function": "trainer_helpers:constant_reward"}},
                              "default_recipe": [["one", 1.0]]},
                      trainer={"max_steps": 2})
    trainer = _fit(flat)
    rows = metrics_rows(tmp_path / "flat")
    assert [r["train/empty_steps"] for r in rows] == [1.0, 2.0]
    assert all(r["dynamic_sampling/kept_group_frac"] == 0 and r["groups/with_variance_frac"] == 0 for r in rows)
    assert trainer.state.step == 2 and trainer.state.samples_trained == 0


@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.vllm])])
def test_dynamic_sampling_trains_on_groups_of_several_rounds(tmp_path, engine):
    """One group with reward variance per round: filling 4 groups takes 4 rounds (each with its own derived seed,
    trained on together), and a budget of 3 rounds ends with the 3 groups found."""
    reward = {"label_map": {"one": {"type": "function", "function": "trainer_helpers:one_varying_group_reward"}},
              "default_recipe": [["one", 1.0]]}
    for extra_rounds, kept in ((3, 4), (2, 3)):
        out = tmp_path / f"{engine}-{extra_rounds}"
        _fit(toy_config(out, engine=engine, reward=reward, algorithm={
            "dynamic_sampling": True, "dynamic_sampling_max_extra_rounds": extra_rounds}, trainer={"max_steps": 1}))
        (row,) = metrics_rows(out)
        assert row["dynamic_sampling/rounds"] == extra_rounds + 1
        assert row["train/samples_trained"] == 4 * kept  # groups of every round trained together
        assert row["policy/optimizer_steps"] >= 1


def test_reports_and_curves_show_the_last_rollout(tmp_path):
    import base64
    import io
    import re

    from PIL import Image

    trainer = _fit(toy_config(tmp_path / "rep", trainer={"max_steps": 2, "report_steps": 1, "report_groups": 2}))
    out = tmp_path / "rep"
    assert (out / "curves.png").stat().st_size > 0 and (out / "reports" / "step-00000001.html").exists()
    html = (out / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 2  # one image per group (the prompt's), two groups
    rollout = trainer.last_batch.rollout
    for b64 in images:
        img = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
        assert img.getpixel((img.width // 2, img.height // 2)) != (255, 255, 255)  # a coloured square, not blank
    texts = trainer.p.reporter.tokenizer.batch_decode(rollout.rows.response_ids[:8], skip_special_tokens=True)
    import html as html_lib

    assert all(html_lib.escape(t) in html for t in texts if t.strip())
    assert "step 2</h1>" in html


def test_shared_prompt_on_and_off_train_alike(tmp_path, monkeypatch):
    """The shared-prompt layout changes how the forwards are laid out, not what they compute: two steps (two PPO
    epochs each, micro-batches of whole groups) give the same per-step metrics with it on and off, and the run
    with it on really scored and trained through grouped rows."""
    import mmrlhf.experience.batching as batching
    import mmrlhf.experience.fast_maker as fast_maker

    calls = {"maker": 0, "update": 0}

    def spy(where, real):
        def wrapped(*args, **kwargs):
            calls[where] += 1
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(fast_maker, "build_grouped_samples", spy("maker", fast_maker.build_grouped_samples))
    monkeypatch.setattr(batching, "build_grouped_samples", spy("update", batching.build_grouped_samples))
    extra = {"max_steps": 2, "ppo_epochs": 2}
    sections = {"reward": {"label_map": {"parity": {"type": "function", "function": "trainer_helpers:parity_reward"}},
                           "default_recipe": [["parity", 1.0]]},
                "algorithm": {"entropy_coef": 0.01, "kl_loss_coef": 0.01}}  # the entropy and reference paths too
    _fit(toy_config(tmp_path / "off", trainer={"shared_prompt": False, **extra}, **sections))
    assert calls == {"maker": 0, "update": 0}
    _fit(toy_config(tmp_path / "on", trainer={"shared_prompt": True, **extra}, **sections))
    assert calls["maker"] >= 2 and calls["update"] >= 2 * 2 * 2  # every scoring and every update micro-batch
    a, b = metrics_rows(tmp_path / "off"), metrics_rows(tmp_path / "on")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        sa, sb = stable(ra), stable(rb)
        assert sa.keys() == sb.keys()
        for k in sa:
            if "micro_batch" in k:  # the split's costs count each layout's own tensors (grouped rows cost less)
                continue
            assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-5), (ra["step"], k)
    for row in a:  # the updates did something, so their equality is not vacuous
        assert row["policy/grad_norm"] > 1e-3 and row["groups/with_variance_frac"] > 0
    assert stable(a[0])["policy/pg_loss"] != stable(a[1])["policy/pg_loss"]


def _recording_sleep_engine(trainer):
    """The trainer's engine with generate / update_weights / sleep / wake_up recorded in order (vLLM sleep needs
    CUDA, so the engine's own sleep is replaced): wake_up is recorded with its tags, update_weights with the
    names it received."""
    engine = trainer.p.source.maker.engine
    calls: list = []
    real_generate, real_update = engine.generate, engine.update_weights
    synced: list[list[str]] = []

    def generate(*args, **kwargs):
        calls.append("generate")
        return real_generate(*args, **kwargs)

    def update_weights(named_tensors):
        pairs = list(named_tensors)
        synced.append([name for name, _ in pairs])
        calls.append("update_weights")
        return real_update(iter(pairs))

    def wake_up(tags=None):
        calls.append(("wake_up", None if tags is None else tuple(tags)))

    engine.generate, engine.update_weights = generate, update_weights
    engine.sleep, engine.wake_up = (lambda: calls.append("sleep")), wake_up
    engine.supports_sleep = True
    return engine, calls, synced


def test_a_sleeping_engine_wakes_its_weights_before_the_sync_and_its_kv_cache_after_it(tmp_path):
    """rollout.enable_sleep: sleep after generation -> forwards and updates -> wake the weights -> sync -> wake the
    KV cache -> next generation, so the trainer's memory and the engine's KV cache never peak together. An update
    that raises wakes everything; a sync that raises still wakes the KV cache."""
    trainer = build_trainer(toy_config(tmp_path / "sleep", trainer={"max_steps": 2}))
    engine, calls, _ = _recording_sleep_engine(trainer)
    metrics = trainer.train_step()
    trainer.train_step()
    step1 = calls[: calls.index("generate", calls.index("sleep"))]  # up to the next step's first generation
    tail = step1[step1.index("sleep"):]
    assert tail == ["sleep", ("wake_up", ("weights",)), "update_weights", ("wake_up", ("kv_cache",))], calls
    assert calls.count("sleep") == 2 and calls[len(step1)] == "generate"
    assert all(k in metrics for k in ("time/engine_sleep", "time/engine_wake", "time/engine_wake_kv"))

    calls.clear()
    real_update = engine.update_weights

    def broken_sync(named_tensors):
        raise RuntimeError("sync failed")

    engine.update_weights = broken_sync
    with pytest.raises(RuntimeError, match="sync failed"):
        trainer.train_step()
    assert calls[-2:] == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]  # KV cache woken after a failed sync
    engine.update_weights = real_update

    calls.clear()

    def broken_update(*args, **kwargs):
        raise RuntimeError("update failed")

    trainer.p.policy.update = broken_update
    with pytest.raises(RuntimeError, match="update failed"):
        trainer.train_step()
    assert calls[-2:] == ["sleep", ("wake_up", None)]  # woken up entirely although the update raised
    # control: an engine without sleep support is never put to sleep
    calls.clear()
    engine.supports_sleep = False
    with pytest.raises(RuntimeError, match="update failed"):
        trainer.train_step()
    assert "sleep" not in calls and not any(isinstance(c, tuple) for c in calls)


def test_sleep_that_discards_the_weights_syncs_the_whole_policy(tmp_path):
    """Sleep level 2 (sleep_discards_weights) loses the engine's weights, frozen ones included: the sync then sends
    every parameter of the policy; level 1 (control) sends only the trainable ones (the vision tower is frozen)."""
    trainer = build_trainer(toy_config(tmp_path / "level", trainer={"max_steps": 2}))
    engine, _, synced = _recording_sleep_engine(trainer)
    model = trainer.p.policy.actor.model
    every = [n for n, _ in model.named_parameters()]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) < len(every)  # the frozen vision tower makes the two differ
    engine.sleep_discards_weights = False
    trainer.train_step()
    assert synced[-1] == trainable
    engine.sleep_discards_weights = True
    trainer.train_step()
    assert synced[-1] == every


def test_a_built_trainer_collects_garbage_as_python_does(tmp_path):
    """``mmrlhf train`` defers full collections while it loads (mmrlhf.startup); the trainer, once built, puts the
    thresholds back for the steps."""
    import gc

    from mmrlhf.startup import LOADING_THRESHOLD, defer_full_collections

    before = gc.get_threshold()
    defer_full_collections()
    assert gc.get_threshold()[2] == max(before[2], LOADING_THRESHOLD)
    build_trainer(toy_config(tmp_path / "run"))
    assert gc.get_threshold() == before
