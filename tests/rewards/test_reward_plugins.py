"""The reward-function plugin API: loading, sync/async calls, extra columns, output checking."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from reward_testing import plugin

from mmrlhf.registry import RegistryError
from mmrlhf.rewards import RewardBatch, RewardError, RewardInputError, load_reward_function
from mmrlhf.rewards.plugins import WrongCountError, call_reward_function, normalize_output


def batch(responses, references=None, **extra) -> RewardBatch:
    n = len(responses)
    return RewardBatch(
        responses=list(responses), prompts=["p"] * n, labels=["L"] * n, references=references or [None] * n, extra=extra
    )


def score(fn, b, **options):
    return asyncio.run(call_reward_function(fn, b, name="fn", options=options))


def test_load_by_file_path_by_module_and_by_builtin_name():
    assert load_reward_function(plugin("echo_number"))(["2"], [""], [""], [None]) == [2.0]
    from mmrlhf.rewards.rules import think_answer_format

    assert load_reward_function("mmrlhf.rewards.rules:think_answer_format") is think_answer_format
    assert load_reward_function("format") is think_answer_format  # alias


def test_unknown_name_lists_the_builtins_and_a_missing_attribute_names_the_file():
    hint = r"unknown reward function 'math_acuracy' \(did you mean 'math_accuracy'\?\)"
    with pytest.raises(RegistryError, match=hint):
        load_reward_function("math_acuracy")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        load_reward_function(plugin("nope"))


def test_async_functions_are_awaited():
    out = score(load_reward_function(plugin("async_len")), batch(["a", "abc"]))
    assert out.scores == [1.0, 3.0]


def test_extra_columns_are_passed_by_name_and_options_must_not_clash():
    fn = load_reward_function(plugin("needs_column"))
    assert score(fn, batch(["x", "y"], difficulty=[3, 5], unused=["a", "b"])).scores == [3.0, 5.0]
    with pytest.raises(RewardError, match="same name as data column"):
        score(fn, batch(["x"], difficulty=[1]), difficulty=2)


def test_dict_outputs_give_parts_and_none_means_not_applicable():
    out = score(load_reward_function(plugin("with_parts")), batch(["<x>7", "8", "9"], ["7", None, "7"]))
    assert out.scores == [1.5, None, 0.0]
    assert out.parts == {"format": [1.0, None, 0.0], "accuracy": [1.0, None, 0.0]}
    assert out.errors == [None, None, None]


def test_normalize_rejects_wrong_counts_and_flags_bad_entries_per_sample():
    b = batch(["a", "b", "c", "d", "e", "f"])
    with pytest.raises(WrongCountError, match=r"'f' returned 5 scores for 6 samples \(sample 0 .* sample 5"):
        normalize_output([1.0] * 5, b, name="f")
    with pytest.raises(WrongCountError, match="returned a float"):
        normalize_output(1.0, b, name="f")
    out = normalize_output(
        [1, float("inf"), "0.5", {"format": 1.0}, {"overall": 1.0, "x": float("nan")}, np.float32(0.25)], b, name="f"
    )
    assert out.scores == [1.0, None, None, None, None, 0.25]
    assert out.errors[0] is None and out.errors[5] is None
    assert "sample 1" in out.errors[1] and "non-finite" in out.errors[1]
    assert "sample 2" in out.errors[2] and "str" in out.errors[2]
    assert "without an 'overall' part" in out.errors[3]
    assert "part 'x'" in out.errors[4]
    assert normalize_output([torch.tensor(2.0), True], batch(["a", "b"]), name="f").errors[1] is not None


def test_a_raising_batch_call_is_isolated_to_the_failing_sample():
    fn = load_reward_function(plugin("fails_on_bad"))
    out = score(fn, batch(["ok", "bad", "ok", "nan"]))
    assert out.scores == [1.0, None, 1.0, None]
    assert "sample 1" in out.errors[1] and "cannot score 'bad'" in out.errors[1]
    assert "sample 3" in out.errors[3] and "non-finite" in out.errors[3]
    assert out.errors[0] is None and out.errors[2] is None


def test_batch_validation_names_the_field():
    with pytest.raises(RewardInputError, match=r"RewardBatch.prompts has 1 entries but responses has 2"):
        RewardBatch(responses=["a", "b"], prompts=["p"], labels=["l", "l"], references=[None, None])
    with pytest.raises(RewardInputError, match=r"extra\['difficulty'\] has 3"):
        batch(["a", "b"], difficulty=[1, 2, 3])
    with pytest.raises(RewardInputError, match="sample 1: responses must be str"):
        RewardBatch(responses=["a", 3], prompts=["", ""], labels=["l", "l"], references=[None, None])
    with pytest.raises(RewardInputError, match="attention_mask shape"):
        RewardBatch(
            responses=["a"], prompts=[""], labels=["l"], references=[None],
            sequences=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 3),
        )


def test_select_keeps_original_indices_and_all_columns():
    b = RewardBatch(
        responses=["a", "b", "c"], prompts=["pa", "pb", "pc"], labels=["x", "y", "x"], references=["1", None, "3"],
        extra={"col": [10, 20, 30]}, sequences=torch.arange(6).view(3, 2), attention_mask=torch.ones(3, 2),
        vision=[{}, {"k": torch.ones(1)}, {}],
    )
    sub = b.select([2, 0])
    assert sub.index == [2, 0] and sub.responses == ["c", "a"] and sub.extra == {"col": [30, 10]}
    assert sub.sequences.tolist() == [[4, 5], [0, 1]] and sub.references == ["3", "1"]
    assert sub.describe(0) == "sample 2 (label 'x')"
