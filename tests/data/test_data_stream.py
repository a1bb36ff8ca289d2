"""The prompt stream: a reproducible order that resumes where it stopped, for files and for generators."""

from __future__ import annotations

import json

import pytest

from mmrlhf.config.data import DataConfig
from mmrlhf.data.datasets import PromptDataset
from mmrlhf.data.errors import DataError
from mmrlhf.data.stream import GeneratedPrompts, PromptStream, record_columns


def _dataset(tmp_path, n=7):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "reference": str(i), "id": f"r{i}"}) + "\n"
                            for i in range(n)))
    return PromptDataset(str(path), DataConfig())


def _ids(records):
    return [r.record_id for r in records]


def test_epochs_are_fresh_permutations_and_batches_cross_them(tmp_path):
    stream = PromptStream(_dataset(tmp_path), seed=3)
    first = _ids(stream.next_batch(7))
    assert sorted(first) == [f"r{i}" for i in range(7)]
    second = _ids(stream.next_batch(7))
    assert sorted(second) == sorted(first) and second != first  # a new order each epoch
    mixed = _ids(stream.next_batch(10))  # 7 of epoch 2, 3 of epoch 3
    assert sorted(mixed[:7]) == sorted(first)
    unshuffled = PromptStream(_dataset(tmp_path), shuffle=False)
    assert _ids(unshuffled.next_batch(3)) == ["r0", "r1", "r2"]


def test_resume_continues_with_the_next_unseen_prompt(tmp_path):
    full = PromptStream(_dataset(tmp_path), seed=1)
    expected = [_ids(full.next_batch(3)) for _ in range(6)]
    part = PromptStream(_dataset(tmp_path), seed=1)
    got = [_ids(part.next_batch(3)) for _ in range(2)]
    state = part.state_dict()
    resumed = PromptStream(_dataset(tmp_path), seed=1)
    resumed.load_state_dict(state)
    got += [_ids(resumed.next_batch(3)) for _ in range(4)]
    assert got == expected
    with pytest.raises(ValueError, match="seed"):
        PromptStream(_dataset(tmp_path), seed=2).load_state_dict(state)


def test_resume_over_changed_data_is_refused_or_starts_over(tmp_path, caplog):
    part = PromptStream(_dataset(tmp_path), seed=1)
    part.next_batch(3)
    state = json.loads(json.dumps(part.state_dict()))  # as the checkpoint stores it
    same = PromptStream(_dataset(tmp_path), seed=1)
    same.load_state_dict(state)  # control: the unchanged data resumes
    assert (same.epoch, same.position) == (0, 3)
    # one record more; and (same count) one record's content edited: both are named
    for n, edit, what in ((8, None, "7 -> 8 records"), (7, "q3x", "p.jsonl: p.jsonl changed")):
        ds = _dataset(tmp_path, n)
        if edit:
            path = tmp_path / "p.jsonl"
            path.write_text(path.read_text().replace('"q3"', f'"{edit}"'))
            ds = PromptDataset(str(path), DataConfig())
        with pytest.raises(ValueError, match=rf"prompt data changed since the checkpoint \(.*{what}.*"
                                             r"data.restart_stream_on_resume=true"):
            PromptStream(ds, seed=1).load_state_dict(state)
        over = PromptStream(ds, seed=1, restart_on_change=True)
        over.load_state_dict(state)
        assert (over.epoch, over.position) == (0, 0) and "starts over" in caplog.text


def _gen(index, *, split, scale=1):
    return {"prompt": f"{split} question {index * scale}", "reference": str(index), "id": f"{split}-{index}"}


def test_generated_prompts_are_endless_and_split_apart():
    train = GeneratedPrompts(_gen, DataConfig(), split="train", options={"scale": 2})
    stream = PromptStream(train, seed=0)
    batch = stream.next_batch(4)
    assert [r.prompt for r in batch] == [f"train question {2 * i}" for i in range(4)]
    assert stream.state_dict()["position"] == 4
    evals = GeneratedPrompts(_gen, DataConfig(), split="eval")
    assert evals[0].prompt == "eval question 0" and evals[0].source.endswith("[eval]")
    cols = record_columns(batch)
    assert cols["record_ids"] == ["train-0", "train-1", "train-2", "train-3"] and cols["references"][1] == "1"


def test_generator_errors_are_clear():
    bad = GeneratedPrompts(lambda index, split: ["not", "a", "row"], DataConfig())
    with pytest.raises(DataError, match="expected a dict row"):
        bad[0]
    with pytest.raises(Exception, match="nope"):
        GeneratedPrompts("mmrlhf.tasks.shapes:nope", DataConfig())
