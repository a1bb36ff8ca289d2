"""Recipes: filtering by call counts, scatter-back order, weights, parts, failure policy, metrics."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch
from reward_testing import plugin
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrlhf.config import ConfigError, build_config
from mmrlhf.registry import import_object
from mmrlhf.rewards import FunctionSource, RewardBatch, RewardComputationEngine, RewardError, SourceScores


class Recording:
    """A source that records every sub-batch it is given and scores a response as a fixed function of it."""

    def __init__(self, name: str, score=lambda r: float(len(r))):
        self.name = name
        self.calls: list[list[int]] = []
        self.responses: list[list[str]] = []
        self._score = score

    async def score(self, batch: RewardBatch) -> SourceScores:
        self.calls.append(list(batch.index))
        self.responses.append(list(batch.responses))
        return SourceScores(scores=[self._score(r) for r in batch.responses])


def make_batch(labels, responses=None, references=None) -> RewardBatch:
    n = len(labels)
    return RewardBatch(
        responses=responses or [f"r{i}" for i in range(n)],
        prompts=[f"<think>prompt {i}</think>" for i in range(n)],
        labels=list(labels),
        references=references or [None] * n,
    )


def test_model_for_label_a_sees_exactly_the_a_samples_in_order_and_never_b():
    model_a, model_b = Recording("A"), Recording("B")
    engine = RewardComputationEngine({"ma": model_a, "mb": model_b}, {"A": [("ma", 1.0)], "B": [("mb", 1.0)]})
    labels = ["A", "B", "B", "A", "B", "A", "A"]
    engine.compute(make_batch(labels))
    assert model_a.calls == [[0, 3, 5, 6]]
    assert model_b.calls == [[1, 2, 4]]
    assert model_a.responses == [["r0", "r3", "r5", "r6"]]


def test_zero_weight_sources_are_not_run_and_unused_sources_not_called():
    used, zero, unused = Recording("u"), Recording("z"), Recording("x")
    engine = RewardComputationEngine(
        {"u": used, "z": zero, "x": unused}, {"A": [("u", 1.0), ("z", 0.0)], "B": [("x", 1.0)]}
    )
    engine.compute(make_batch(["A", "A"]))
    assert used.calls == [[0, 1]] and zero.calls == [] and unused.calls == []


def test_scatter_back_on_shuffled_mixed_labels_and_weights():
    rng = random.Random(0)
    labels = [rng.choice(["A", "B", "C"]) for _ in range(40)]
    responses = ["x" * rng.randint(1, 30) for _ in range(40)]
    sources = {
        "len": Recording("len"),
        "neg": Recording("neg", lambda r: -float(len(r))),
        "one": Recording("one", lambda r: 1.0),
    }
    recipe = {"A": [("len", 2.0)], "B": [("neg", 0.5), ("one", 3.0)], "C": [("len", 1.0), ("one", -1.0)]}
    result = RewardComputationEngine(sources, recipe).compute(make_batch(labels, responses))
    expected = {
        "A": lambda r: 2.0 * len(r),
        "B": lambda r: -0.5 * len(r) + 3.0,
        "C": lambda r: len(r) - 1.0,
    }
    assert result.rewards.tolist() == pytest.approx([expected[lab](r) for lab, r in zip(labels, responses)])
    assert result.valid.all()
    lens = result.sources["len"]
    for i, lab in enumerate(labels):
        assert math.isnan(lens[i]) == (lab == "B")


def test_parts_are_scattered_and_logged_per_source_and_part():
    engine = RewardComputationEngine(
        {"rule": FunctionSource(import_object(plugin("with_parts")), name="rule"), "len": Recording("len")},
        {"math": [("rule", 1.0)], "chat": [("len", 0.1)]},
    )
    batch = make_batch(
        ["chat", "math", "math", "chat", "math"],
        responses=["abcd", "<a>42", "41", "ab", "<b>7"],
        references=[None, "42", "42", None, None],
    )
    result = engine.compute(batch)
    fmt, acc = result.parts["rule/format"], result.parts["rule/accuracy"]
    assert fmt[1].item() == 1.0 and fmt[2].item() == 0.0 and acc[1].item() == 1.0 and acc[2].item() == 0.0
    assert torch.isnan(fmt[[0, 3, 4]]).all()  # chat rows never scored; row 4: rule does not apply
    assert result.rewards[:4].tolist() == pytest.approx([0.4, 1.5, 0.0, 0.2])
    assert not result.valid[4]  # nothing applied to it -> masked, counted
    m = result.metrics
    assert m["reward/rule/format/mean"] == pytest.approx(0.5)
    assert m["reward/rule/accuracy/mean"] == pytest.approx(0.5)
    assert m["reward/rule/mean"] == pytest.approx(0.75)
    assert m["reward/rule/not_applicable"] == 1.0
    assert m["reward/no_applicable_source"] == 1.0 and m["reward/masked"] == 1.0
    assert m["reward/len/count"] == 2.0 and m["reward/rule/count"] == 3.0
    assert m["reward/label/chat/mean"] == pytest.approx(0.3)


def test_unknown_label_is_an_error_naming_it_unless_a_default_recipe_exists():
    src = Recording("len")
    engine = RewardComputationEngine({"len": src}, {"A": [("len", 1.0)]})
    with pytest.raises(RewardError, match=r"label 'mystery'.*sample 1"):
        engine.compute(make_batch(["A", "mystery"]))
    assert src.calls == []  # validated before anything ran
    with_default = RewardComputationEngine({"len": src}, {"A": [("len", 1.0)]}, default_recipe=[("len", 10.0)])
    assert with_default.compute(make_batch(["A", "mystery"], ["ab", "abc"])).rewards.tolist() == [2.0, 30.0]


def _engine(fn_name: str, policy: str) -> RewardComputationEngine:
    cfg = build_config(
        {"reward": {"label_map": {"f": plugin(fn_name), "ok": plugin("async_len")},
                    "recipe": {"A": [["f", 1.0], ["ok", 1.0]], "B": [["ok", 1.0]]}, "on_failure": policy}}
    ).reward
    return RewardComputationEngine.from_config(cfg)


@pytest.mark.parametrize(
    "responses, bad_rows, words",
    [
        (["good", "bad", "fine"], [1], "raised ValueError: cannot score 'bad'"),
        (["good", "nan", "fine"], [1], "non-finite"),
    ],
)
def test_failure_policy_error_names_function_and_sample(responses, bad_rows, words):
    with pytest.raises(RewardError) as info:
        _engine("fails_on_bad", "error").compute(make_batch(["A", "A", "A"], responses))
    message = str(info.value)
    assert "fails_on_bad" in message and "sample 1 (label 'A')" in message and words in message


@pytest.mark.parametrize("responses", [["good", "bad", "fine", "x"], ["good", "nan", "fine", "x"]])
def test_failure_policy_mask_masks_only_the_failing_sample_and_counts_it(responses):
    result = _engine("fails_on_bad", "mask").compute(make_batch(["A", "A", "A", "B"], responses))
    assert result.valid.tolist() == [True, False, True, True]
    assert result.rewards.tolist() == [1.0 + 4, 0.0, 1.0 + 4, 1.0]
    assert result.metrics["reward/f/failures"] == 1.0 and result.metrics["reward/failed_samples"] == 1.0


def test_wrong_count_errors_or_masks_the_whole_sub_batch():
    with pytest.raises(RewardError, match=r"drops_one.*returned 1 scores for 2 samples.*sample 0.*sample 2"):
        _engine("drops_one", "error").compute(make_batch(["A", "B", "A"]))
    result = _engine("drops_one", "mask").compute(make_batch(["A", "B", "A"]))
    assert result.valid.tolist() == [False, True, False]
    assert result.metrics["reward/f/failures"] == 2.0


def test_config_validation_names_the_bad_recipe_source():
    with pytest.raises(ConfigError, match=r"recipe 'A' uses reward source 'nope'.*defined sources: f"):
        build_config({"reward": {"label_map": {"f": "format"}, "recipe": {"A": [["nope", 1]]}}})
    with pytest.raises(ConfigError, match="twice"):
        build_config({"reward": {"label_map": {"f": "format"}, "recipe": {"A": [["f", 1], ["f", 2]]}}})
    with pytest.raises(ConfigError, match="reward.on_failure"):
        build_config({"reward": {"on_failure": "ignore"}})


def test_engine_runs_inside_an_event_loop_via_acompute():
    engine = RewardComputationEngine({"len": Recording("len")}, {"A": [("len", 1.0)]})

    async def inside():
        with pytest.raises(RuntimeError, match="acompute"):
            engine.compute(make_batch(["A"]))
        return await engine.acompute(make_batch(["A"], ["abc"]))

    assert asyncio.run(inside()).rewards.tolist() == [3.0]


def test_sources_run_concurrently_not_one_after_another():
    class Slow:
        def __init__(self, name):
            self.name = name

        async def score(self, batch):
            await asyncio.sleep(0.3)
            return SourceScores(scores=[1.0] * len(batch))

    sources = {f"s{i}": Slow(f"s{i}") for i in range(5)}
    engine = RewardComputationEngine(sources, {"A": [(name, 1.0) for name in sources]})
    loop_start = asyncio.run(_timed(engine, make_batch(["A", "A"])))
    assert loop_start < 1.2  # five 0.3 s sources in parallel, not 1.5 s in series


async def _timed(engine, batch) -> float:
    start = asyncio.get_running_loop().time()
    result = await engine.acompute(batch)
    assert result.rewards.tolist() == [5.0, 5.0]
    return asyncio.get_running_loop().time() - start


@settings(max_examples=40, deadline=None)
@given(
    labels=st.lists(st.sampled_from(["A", "B", "C", "D"]), min_size=1, max_size=24),
    weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, -2.0]), min_size=6, max_size=6),
)
def test_property_combined_reward_equals_the_per_sample_weighted_sum(labels, weights):
    responses = [f"{'x' * (i % 7)}" for i in range(len(labels))]
    sources = {
        "len": Recording("len"),
        "one": Recording("one", lambda r: 1.0),
        "sq": Recording("sq", lambda r: len(r) ** 2),
    }
    recipe = {
        "A": [("len", weights[0]), ("one", weights[1])],
        "B": [("sq", weights[2])],
        "C": [("len", weights[3]), ("sq", weights[4]), ("one", weights[5])],
        "D": [("one", 1.0)],
    }
    # An all-zero recipe is refused (it would mask its label while looking configured); [] masks on purpose.
    recipe = {label: entries if any(w for _, w in entries) else [] for label, entries in recipe.items()}
    result = RewardComputationEngine(sources, recipe).compute(make_batch(labels, responses))
    value = {"len": lambda r: float(len(r)), "one": lambda r: 1.0, "sq": lambda r: float(len(r) ** 2)}
    for i, (label, response) in enumerate(zip(labels, responses)):
        terms = [(w, value[s](response)) for s, w in recipe[label] if w != 0.0]
        assert bool(result.valid[i]) == bool(terms)
        assert result.rewards[i].item() == pytest.approx(sum(w * v for w, v in terms) if terms else 0.0)
    for name, src in sources.items():
        wanted = [i for i, lab in enumerate(labels) if any(s == name and w != 0.0 for s, w in recipe[lab])]
        assert src.calls == ([wanted] if wanted else [])


class Fixed:
    """A source class answering fixed scores (whatever they are: the engine must check them itself)."""

    def __init__(self, name, scores, parts=None):
        self.name, self._scores, self._parts = name, scores, parts or {}

    async def score(self, batch):
        return SourceScores(scores=list(self._scores), parts={k: list(v) for k, v in self._parts.items()})


def test_engine_rejects_non_finite_scores_from_any_source():
    bad = Fixed("bad", [1.0, float("nan"), float("inf"), True, 2.0], parts={"p": [0.0, 0.0, 0.0, 0.0, float("-inf")]})
    sources = {"bad": bad, "one": Recording("one", lambda r: 1.0)}
    recipe = {"A": [("bad", 1.0), ("one", 1.0)]}
    result = RewardComputationEngine(sources, recipe, on_failure="mask").compute(make_batch(["A"] * 5))
    assert result.valid.tolist() == [True, False, False, False, False]
    assert torch.isfinite(result.rewards).all() and result.rewards[0].item() == 2.0
    assert result.metrics["reward/failed_samples"] == 4.0 and result.metrics["reward/bad/failures"] == 4.0
    assert result.metrics["reward/bad/not_applicable"] == 0.0  # NaN is a failure, not "does not apply"
    with pytest.raises(RewardError, match=r"'bad' on sample 1 \(label 'A'\): score nan is not a finite number"):
        RewardComputationEngine(sources, recipe).compute(make_batch(["A"] * 5))


def _chain(exc: BaseException) -> list[BaseException]:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


@pytest.mark.parametrize("where", ["label", "source", "function"])
def test_compute_raises_the_real_error_alone(where):
    class Boom:
        name = "boom"

        async def score(self, batch):
            raise ValueError("boom")

    def raising(responses, prompts, labels, references):
        raise KeyError("nope")

    sources = {"boom": Boom(), "len": Recording("len"), "fn": FunctionSource(raising, name="fn")}
    recipe = {"label": [("len", 1.0)], "source": [("boom", 1.0)], "function": [("fn", 1.0)]}
    with pytest.raises(Exception) as info:
        RewardComputationEngine(sources, {k: v for k, v in recipe.items() if k != "label"}).compute(
            make_batch([where if where != "label" else "unknown"])
        )
    chain = _chain(info.value)
    assert not any("no running event loop" in str(e) for e in chain), [repr(e) for e in chain]
    if where == "source":
        assert isinstance(info.value, ValueError) and info.value.__context__ is None


def test_a_zero_weight_source_is_not_run_and_does_not_mask_when_another_applies():
    rm, rule = Recording("rm"), Recording("rule", lambda r: 0.5)
    engine = RewardComputationEngine({"rm": rm, "rule": rule}, {"A": [("rm", 0.0), ("rule", 2.0)], "skip": []})
    result = engine.compute(make_batch(["A", "A", "skip"]))
    assert rm.calls == [] and result.valid.tolist() == [True, True, False]
    assert result.rewards[:2].tolist() == [1.0, 1.0] and result.metrics["reward/no_applicable_source"] == 1.0


def test_a_recipe_of_only_zero_weights_is_refused_naming_its_label():
    with pytest.raises(RewardError, match=r"recipe 'caption' gives every source a weight of 0"):
        RewardComputationEngine({"rm": Recording("rm")}, {"caption": [("rm", 0.0)]})
    with pytest.raises(ConfigError, match=r"recipe 'caption' gives every source a weight of 0"):
        build_config({"reward": {"label_map": {"rm": "format"}, "recipe": {"caption": [["rm", 0.0]]}}})
    with pytest.raises(ConfigError, match=r"recipe '<default_recipe>' gives every source a weight of 0"):
        build_config({"reward": {"label_map": {"rm": "format"}, "default_recipe": [["rm", 0]]}})
