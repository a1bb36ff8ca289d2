"""Padded / packed sample builders: masks, stop handling, lengths, vision concatenation order."""

from __future__ import annotations

import pytest
import torch
from models_testing import batch_pieces

from mmrlhf.experience.samples import build_packed_samples, build_padded_samples, cut_at_stop, mm_token_type_ids
from mmrlhf.models.adapters import get_adapter

FAMILY = "qwen2_5_vl"  # its video carries an extra per-video input (second_per_grid_ts)


@pytest.fixture(scope="module")
def pieces(bundles):
    bundle = bundles[FAMILY]
    prompts, responses, vision, inputs = batch_pieces(bundle)
    kw = dict(pad_id=bundle.processor.tokenizer.pad_token_id, eos_id=bundle.eos_id, adapter=bundle.adapter,
              vision=vision)
    return bundle, prompts, responses, vision, inputs, kw


def _expected_cut(responses, eos):
    out = []
    for r in responses:
        out.append(r[: r.index(eos) + 1] if eos in r else r)
    return out


def test_cut_at_stop():
    assert cut_at_stop([5, 2, 7, 2], {2}) == ([5, 2], False)
    assert cut_at_stop([5, 7], {2, 3}) == ([5, 7], True)
    assert cut_at_stop([3], [2, 3]) == ([3], False)


def test_padded_layout(pieces):
    bundle, prompts, responses, vision, inputs, kw = pieces
    built = build_padded_samples(prompts, responses, **kw)
    s, eos, pad = built.samples, bundle.eos_id, kw["pad_id"]
    cut = _expected_cut(responses, eos)
    b, p_max, a_max = len(prompts), max(map(len, prompts)), max(map(len, cut))
    assert s.sequences.shape == (b, p_max + a_max) and s.attention_mask.shape == s.sequences.shape
    assert s.action_mask.shape == (b, a_max) and s.num_actions == a_max and not s.packed
    assert built.truncated.tolist() == [eos not in r for r in responses]
    assert any(built.truncated) and not all(built.truncated)
    for i, (p, r) in enumerate(zip(prompts, cut)):
        row, mask = s.sequences[i].tolist(), s.attention_mask[i].tolist()
        assert row[p_max - len(p) : p_max] == p and row[p_max : p_max + len(r)] == r  # left pad / right pad
        assert set(row[: p_max - len(p)] + row[p_max + len(r) :]) <= {pad}
        assert mask == [0] * (p_max - len(p)) + [1] * (len(p) + len(r)) + [0] * (a_max - len(r))
        assert s.action_mask[i].tolist() == [True] * len(r) + [False] * (a_max - len(r))
        assert int(s.response_length[i]) == len(r) and int(s.total_length[i]) == len(p) + len(r)
    # junk after a mid-response EOS is not scored (and not in the sequence)
    mid = next(i for i, r in enumerate(responses) if eos in r[:-1])
    assert int(s.response_length[mid]) == responses[mid].index(eos) + 1 < len(responses[mid])


def test_packed_layout_encodes_the_same_samples(pieces):
    bundle, prompts, responses, vision, inputs, kw = pieces
    padded = build_padded_samples(prompts, responses, **kw)
    built = build_packed_samples(prompts, responses, **kw)
    s = built.samples
    cut = _expected_cut(responses, bundle.eos_id)
    assert s.packed and s.action_mask is None and s.sequences.shape[0] == 1
    assert s.sequences[0].tolist() == [t for p, r in zip(prompts, cut) for t in p + r]
    assert s.packed_seq_lens.tolist() == [len(p) + len(r) for p, r in zip(prompts, cut)]
    assert s.num_actions.tolist() == [len(r) for r in cut] == s.response_length.tolist()
    assert s.attention_mask[0].tolist() == [i + 1 for i, n in enumerate(s.packed_seq_lens.tolist()) for _ in range(n)]
    assert torch.equal(built.truncated, padded.truncated)
    # the same tokens as the padded rows with padding removed; token types likewise
    pad_rows = [row[m.bool()] for row, m in zip(padded.samples.sequences, padded.samples.attention_mask)]
    assert torch.equal(torch.cat(pad_rows), s.sequences[0])
    pad_types = [t[m.bool()] for t, m in zip(padded.samples.mm_token_type_ids, padded.samples.attention_mask)]
    assert torch.equal(torch.cat(pad_types), s.mm_token_type_ids[0])


@pytest.mark.parametrize("builder", [build_padded_samples, build_packed_samples])
def test_vision_concat_order_and_counts(pieces, builder):
    bundle, prompts, responses, vision, inputs, kw = pieces
    built = builder(prompts, responses, **kw)
    s = built.samples
    assert s.image_num == [0 if "image_grid_thw" not in v else len(v["image_grid_thw"]) for v in vision]
    assert s.video_num == [0 if "video_grid_thw" not in v else len(v["video_grid_thw"]) for v in vision]
    assert sum(s.image_num) >= 3 and sum(s.video_num) >= 2  # the batch really mixes modalities
    for i, v in enumerate(vision):
        got = s.vision_inputs(i)
        want = {k: x for k, x in v.items() if k != "second_per_grid_ts"}
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (i, k)
    want_ts = torch.cat([v["second_per_grid_ts"] for v in vision if "second_per_grid_ts" in v])
    assert torch.equal(built.vision_extra["second_per_grid_ts"], want_ts)


def test_token_types_match_processor(pieces):
    bundle, prompts, responses, vision, inputs, kw = pieces
    for x in inputs:
        assert torch.equal(mm_token_type_ids(x["input_ids"], bundle.adapter), x["mm_token_type_ids"])
    s = build_padded_samples(prompts, responses, **kw).samples
    assert set(s.mm_token_type_ids.unique().tolist()) == {0, 1, 2}
    assert (s.mm_token_type_ids[s.attention_mask == 0] == 0).all()


def test_pad_count_mismatch_is_rejected(pieces):
    bundle, prompts, responses, vision, inputs, kw = pieces
    i = next(k for k, v in enumerate(vision) if "image_grid_thw" in v)
    bad = [p[:] for p in prompts]
    bad[i].remove(bundle.adapter.image_token_id)  # one pad token short of what the grid expands to
    with pytest.raises(ValueError, match="image pad tokens"):
        build_packed_samples(bad, responses, **kw)
    with pytest.raises(ValueError, match="vision dicts"):
        build_padded_samples(prompts, responses, **{**kw, "vision": vision[:-1]})


def test_text_only_batch_without_vision(pieces):
    bundle, *_ = pieces
    adapter = get_adapter(bundle.model.config)
    built = build_packed_samples([[7, 8], [9]], [[10, 2], [11, 12]], pad_id=0, eos_id=2, adapter=adapter)
    s = built.samples
    assert s.image_num == [0, 0] and s.video_num == [0, 0] and s.pixel_values is None
    assert built.truncated.tolist() == [False, True] and built.vision_extra == {}
    padded = build_padded_samples([[7, 8], [9]], [[10, 2], [11, 12]], pad_id=0, eos_id=[2, 12], adapter=adapter)
    assert padded.truncated.tolist() == [False, False]
