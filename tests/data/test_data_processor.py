"""MultimodalDataProcessor: a mixed batch lands sample by sample in order, with each sample's own tensors."""

from __future__ import annotations

import pytest
import torch
from data_testing import solid_image
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrlhf.data import DataError, MultimodalDataProcessor
from mmrlhf.models.adapters import get_adapter

N = 3


def _user(parts):
    return [{"role": "user", "content": parts}]


@pytest.fixture
def mixed(media):
    """Five prompts: text, 1 image, 3 images, 1 video, image + video; with the chat messages a user would write."""
    imgs = [solid_image(seed=1), solid_image((84, 56), seed=2), solid_image((56, 112), seed=3),
            solid_image(seed=4), solid_image((70, 70), seed=5)]
    prompts = ["Count to three.", "<image>What color is the square?", "<image> then <image> and <image>: which?",
               "What happens in the video?<video>", "<image> vs <video> same colour?"]
    images = [None, imgs[0], imgs[1:4], None, [imgs[4]]]
    videos = [None, None, None, media["video"], [media["video"]]]
    # Reference chat messages, written by hand (not by the code under test).
    messages = [
        [{"role": "user", "content": "Count to three."}],
        _user([{"type": "image"}, {"type": "text", "text": "What color is the square?"}]),
        _user([{"type": "image"}, {"type": "text", "text": " then "}, {"type": "image"},
               {"type": "text", "text": " and "}, {"type": "image"}, {"type": "text", "text": ": which?"}]),
        _user([{"type": "text", "text": "What happens in the video?"}, {"type": "video"}]),
        _user([{"type": "image"}, {"type": "text", "text": " vs "}, {"type": "video"},
               {"type": "text", "text": " same colour?"}]),
    ]
    return dict(prompts=prompts, images=images, videos=videos, messages=messages,
                refs=[f"ref{i}" for i in range(5)], labels=[f"lab{i}" for i in range(5)],
                n_images=[0, 1, 3, 0, 1], n_videos=[0, 0, 0, 1, 1], image_objs=imgs)


def _alone(hf_processor, messages, images, videos):
    """The reference: the HF processor on ONE prompt, straight from its messages."""
    text = hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs = {"text": [text], "add_special_tokens": False}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["do_sample_frames"] = False
    return text, hf_processor(**kwargs)


def test_mixed_batch_sample_by_sample(make_processor, hf_processor, adapter, mixed):
    proc = make_processor()
    out = proc.process_multimodal_batch(mixed["prompts"], mixed["images"], mixed["refs"],
                                        images_num=mixed["n_images"], n_samples_per_prompt=N,
                                        all_videos=mixed["videos"], videos_num=mixed["n_videos"],
                                        all_labels=mixed["labels"])
    assert len(out) == 5 * N
    for k in range(len(out)):
        i = k // N
        assert out.all_prompt_indices[k] == i
        assert out.all_references[k] == mixed["refs"][i] and out.all_labels[k] == mixed["labels"][i]
        assert out.all_images_num[k] == mixed["n_images"][i] and out.all_videos_num[k] == mixed["n_videos"][i]
        assert len(out.all_images[k]) == mixed["n_images"][i] and len(out.all_videos[k]) == mixed["n_videos"][i]
        text, ref = _alone(hf_processor, mixed["messages"][i], out.all_images[k], out.all_videos[k])
        assert out.all_prompts[k] == text
        assert out.all_prompt_token_ids[k] == list(ref["input_ids"][0])
        assert out.all_mm_token_type_ids[k] == list(ref["mm_token_type_ids"][0])
        vision = out.all_vision_inputs[k]
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if key in ref:
                assert torch.equal(vision[key], ref[key]), (k, key)
            else:
                assert key not in vision, (k, key)
        # pad tokens == grid products / merge factor, merge factor from the model config (not from our code)
        merge = hf_processor.image_processor.merge_size ** 2
        for token, key in ((adapter.image_token_id, "image_grid_thw"), (adapter.video_token_id, "video_grid_thw")):
            want = int(ref[key].prod(-1).sum()) // merge if key in ref else 0
            assert out.all_prompt_token_ids[k].count(token) == want
    # the loaded images are the caller's pixels (RGB), in placeholder order
    assert [im.tobytes() for im in out.all_images[2 * N]] == [im.tobytes() for im in mixed["image_objs"][1:4]]
    # batch-level grids are the per-sample grids in sample order
    assert out.all_images_grid_thw.shape[0] == sum(out.all_images_num)
    assert out.all_videos_grid_thw.shape[0] == sum(out.all_videos_num)


def test_copies_share_tensors_across_samples(make_processor, mixed):
    out = make_processor().process_multimodal_batch(mixed["prompts"][:3], mixed["images"][:3],
                                                    n_samples_per_prompt=N)
    a, b = out.all_vision_inputs[N], out.all_vision_inputs[N + 1]
    assert a["pixel_values"].data_ptr() == b["pixel_values"].data_ptr()  # no copy per sample
    # ... while different prompts own different rows
    assert a["pixel_values"].data_ptr() != out.all_vision_inputs[2 * N]["pixel_values"].data_ptr()


def test_records_entry_point_matches_lists(make_processor, mixed):
    from mmrlhf.data import PromptRecord

    records = [PromptRecord(index=10 + i, prompt=p, images=[] if im is None else im if isinstance(im, list) else [im],
                            videos=[] if v is None else v if isinstance(v, list) else [v], label=mixed["labels"][i],
                            reference=mixed["refs"][i], record_id=f"r{i}")
               for i, (p, im, v) in enumerate(zip(mixed["prompts"], mixed["images"], mixed["videos"]))]
    proc = make_processor()
    a = proc.process_records(records, 2)
    b = proc.process_multimodal_batch(mixed["prompts"], mixed["images"], mixed["refs"], n_samples_per_prompt=2,
                                      all_videos=mixed["videos"], all_labels=mixed["labels"])
    assert a.all_prompt_token_ids == b.all_prompt_token_ids
    assert a.all_prompt_indices == [10 + k // 2 for k in range(10)]
    assert a.all_record_ids == [f"r{k // 2}" for k in range(10)]


def test_record_ids_name_every_error_and_skip(make_processor, hf_processor, adapter, media):
    """Callers with records (the experience maker) pass their ids: every data error and skip names them, and the
    batch hands them back per sample."""
    ids = ["q-a", "q-b", "q-c"]
    cases = [  # (processor fields, prompt 1, image 1, expected message): one per stage that can fail
        ({}, "<image>b", media["broken_png"], r"record 1 \(id='q-b'\), field 'images'.*unreadable image"),
        ({"prompt_max_len": 24, "prompt_overflow": "error"}, "word " * 40, None,
         r"record 1 \(id='q-b'\).*above prompt_max_len=24"),
        ({"prompt_max_len": 24}, "<image>b", solid_image((224, 224)), r"record 1 \(id='q-b'\).*cannot fit"),
        ({}, f"b {hf_processor.image_token}", None, r"record 1 \(id='q-b'\).*image pad tokens"),
        ({}, "<image>b <image>", solid_image(), r"record 1 \(id='q-b'\).*2 image place"),
    ]
    for fields, prompt, image, message in cases:
        with pytest.raises(DataError, match=message):
            make_processor(**fields).process_multimodal_batch(["a", prompt, "c"], [None, image, None],
                                                              record_ids=ids)
    picky = MultimodalDataProcessor(_PickyProcessor(hf_processor, 84), 1024, adapter)
    with pytest.raises(DataError, match=r"record 1 \(id='q-b'\).*processor failed"):
        picky.process_multimodal_batch(["a", "<image>b"], [None, solid_image((84, 56))], record_ids=ids[:2])

    proc = make_processor(on_bad_input="skip")
    out = proc.process_multimodal_batch(["a", "<image>b", "c"], [None, media["broken_png"], None],
                                        n_samples_per_prompt=2, record_ids=ids)
    assert out.all_record_ids == ["q-a", "q-a", "q-c", "q-c"]
    assert [(s.record_id, s.reason) for s in out.skipped] == [("q-b", "corrupt_image")]
    assert "id='q-b'" in out.skipped[0].message
    assert out.describe_sample(3) == "record 2 (id='q-c'), sample 3"
    assert proc.process_multimodal_batch(["a"], n_samples_per_prompt=2).all_record_ids == [None, None]
    with pytest.raises(ValueError, match="not both"):
        proc.process_multimodal_batch(["a"], all_ids=["x"], record_ids=["x"])


def test_counts_must_match_items(make_processor):
    with pytest.raises(DataError, match=r"record 1\b.*images_num says 2 but 1"):
        make_processor().process_multimodal_batch(["hi", "<image>x"], [None, solid_image()], images_num=[0, 2])


def test_placeholder_mismatch_names_record(make_processor):
    with pytest.raises(DataError, match=r"record 0\b.*1 image place\(s\).* for 2 image"):
        make_processor().process_multimodal_batch(["<image> one place"], [[solid_image(), solid_image(seed=1)]])


class _TruncatingProcessor:
    """Wraps the HF processor but cuts every prompt to ``keep`` ids: the seed's "truncation through vision" bug."""

    def __init__(self, inner, keep):
        self.inner, self.keep = inner, keep
        self.tokenizer, self.chat_template = inner.tokenizer, inner.chat_template

    def apply_chat_template(self, *a, **k):
        return self.inner.apply_chat_template(*a, **k)

    def __call__(self, **kwargs):
        out = self.inner(**kwargs)
        out["input_ids"] = [row[: self.keep] for row in out["input_ids"]]
        out["mm_token_type_ids"] = [row[: self.keep] for row in out["mm_token_type_ids"]]
        return out


def test_vision_token_mismatch_is_caught_naming_the_sample(hf_processor, adapter):
    proc = MultimodalDataProcessor(_TruncatingProcessor(hf_processor, keep=6), 1024, adapter)
    with pytest.raises(DataError, match=r"record 1\b.*image pad tokens .* imply 4 \(samples 2\.\.3"):
        proc.process_multimodal_batch(["text", "<image>What color?"], [None, solid_image()],
                                      n_samples_per_prompt=2)


def test_model_token_in_text_only_prompt_is_caught(make_processor, hf_processor):
    with pytest.raises(DataError, match=r"record 0\b.*1 image pad tokens .* imply 0"):
        make_processor().process_multimodal_batch([f"look {hf_processor.image_token}"])


def test_merge_size_comes_from_the_adapter(hf_processor, model_dir):
    """An adapter whose config claims another merge size disagrees with the processor: the check must fire."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config["vision_config"]["spatial_merge_size"] = 1
    wrong = get_adapter(config)
    with pytest.raises(DataError, match="image pad tokens"):
        MultimodalDataProcessor(hf_processor, 1024, wrong).process_multimodal_batch(["<image>x"], [solid_image()])


def test_text_only_batch_needs_no_vision(make_processor, hf_processor):
    out = make_processor().process_multimodal_batch(["one", "two two"], n_samples_per_prompt=2)
    want = hf_processor.tokenizer.apply_chat_template([{"role": "user", "content": "two two"}], tokenize=True,
                                                      add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert out.all_prompt_token_ids[2] == list(want)
    assert out.all_vision_inputs == [{}] * 4 and out.all_images_pixel_values is None


def test_no_chat_template_uses_model_vision_sequence(make_processor, hf_processor, adapter):
    proc = make_processor(apply_chat_template=False)
    out = proc.process_multimodal_batch(["<image>Q:"], [solid_image()])
    ids = out.all_prompt_token_ids[0]
    assert ids[0] == adapter.vision_start_token_id and ids[5] == adapter.vision_end_token_id
    assert hf_processor.tokenizer.decode(ids[6:]) == "Q:"


def test_skip_mode_keeps_order_and_reports(make_processor, media):
    proc = make_processor(on_bad_input="skip")
    out = proc.process_multimodal_batch(["a", "<image>b", "<image>c", "<video>d"],
                                        [None, media["broken_png"], media["img0"], None],
                                        ["r0", "r1", "r2", "r3"], n_samples_per_prompt=2,
                                        all_videos=[None, None, None, media["empty_mp4"]])
    assert out.all_prompt_indices == [0, 0, 2, 2]
    assert out.all_references == ["r0", "r0", "r2", "r2"]
    assert [s.index for s in out.skipped] == [1, 3]
    assert proc.skips.counts == {"corrupt_image": 1, "empty_video": 1}
    # a second batch adds to the running totals
    proc.process_multimodal_batch(["<image>e"], [media["broken_png"]])
    assert proc.skips.counts["corrupt_image"] == 2


def test_truncate_left_keeps_vision_tokens(make_processor, adapter, hf_processor):
    prompt = "<image>" + " red" * 40 + " blue"
    full = make_processor().process_multimodal_batch([prompt], [solid_image()]).all_prompt_token_ids[0]
    limit = len(full) - 10
    proc = make_processor(prompt_max_len=limit)
    out = proc.process_multimodal_batch([prompt], [solid_image()], n_samples_per_prompt=2)
    ids = out.all_prompt_token_ids[0]
    assert len(ids) == limit and out.truncated == 1
    vision = {adapter.image_token_id, adapter.vision_start_token_id, adapter.vision_end_token_id}
    assert [t for t in ids if t in vision] == [t for t in full if t in vision]
    assert ids[-5:] == full[-5:]  # the newest text survives
    assert len(out.all_mm_token_type_ids[0]) == limit
    assert out.all_mm_token_type_ids[0].count(1) == full.count(adapter.image_token_id)


def test_truncate_left_text_only(make_processor):
    proc = make_processor()
    full = proc.process_multimodal_batch(["one two three four five six"]).all_prompt_token_ids[0]
    out = make_processor(prompt_max_len=len(full) - 3).process_multimodal_batch(["one two three four five six"])
    head = len(proc.tokenizer.encode("<|im_start|>user\n"))  # the turn header survives; the oldest text goes
    assert out.all_prompt_token_ids[0] == full[:head] + full[head + 3:]


def test_too_long_error_and_skip(make_processor):
    long = "word " * 200
    with pytest.raises(DataError, match=r"record 1\b.*above prompt_max_len=32"):
        make_processor(prompt_max_len=32, prompt_overflow="error").process_multimodal_batch(["short", long])
    proc = make_processor(prompt_max_len=32, prompt_overflow="skip")
    out = proc.process_multimodal_batch(["short", long, "short too"], n_samples_per_prompt=2)
    assert out.all_prompt_indices == [0, 0, 2, 2]
    assert proc.skips.counts == {"prompt_too_long": 1} and out.skipped[0].index == 1


def test_vision_alone_over_limit(make_processor):
    big = solid_image((224, 224))  # 64 image tokens
    with pytest.raises(DataError, match="without cutting a vision block"):
        make_processor(prompt_max_len=40).process_multimodal_batch(["<image>hi"], [big])
    proc = make_processor(prompt_max_len=40, on_bad_input="skip")
    out = proc.process_multimodal_batch(["<image>hi", "ok"], [big, None])
    assert out.all_prompt_indices == [1] and proc.skips.counts == {"prompt_too_long": 1}



def test_chat_prompt_carrying_its_images(make_processor, media):
    prompt = [{"role": "user", "content": [{"type": "image", "image": media["img0"]}, {"type": "text", "text": "q"}]}]
    out = make_processor().process_multimodal_batch([prompt], n_samples_per_prompt=2)
    assert out.all_images_num == [1, 1]
    from PIL import Image

    with Image.open(media["img0"]) as im:
        assert out.all_images[0][0].tobytes() == im.convert("RGB").tobytes()


def test_skips_before_an_error_are_still_counted(make_processor, hf_processor):
    proc = make_processor(prompt_max_len=16, prompt_overflow="skip")
    with pytest.raises(DataError, match=r"record 1\b.*image pad tokens"):
        proc.process_multimodal_batch(["word " * 50, f"x {hf_processor.image_token}"])
    assert proc.skips.counts == {"prompt_too_long": 1}


class _PickyProcessor(_TruncatingProcessor):
    """Wraps the HF processor but fails on any image of one width: a processor error on one prompt."""

    def __init__(self, inner, bad_width):
        super().__init__(inner, keep=None)
        self.bad_width = bad_width

    def __call__(self, **kwargs):
        if any(im.size[0] == self.bad_width for im in kwargs.get("images", [])):
            raise ValueError("processor says no")
        return self.inner(**kwargs)


def test_processor_failure_names_the_prompt(hf_processor, adapter):
    from mmrlhf.config.data import DataConfig

    images = [solid_image(), solid_image((84, 56)), None, solid_image()]
    prompts = ["<image>a", "<image>b", "c", "<image>d"]
    proc = MultimodalDataProcessor(_PickyProcessor(hf_processor, 84), 1024, adapter)
    with pytest.raises(DataError, match=r"record 1\b.*processor failed.*processor says no"):
        proc.process_multimodal_batch(prompts, images)
    skip = MultimodalDataProcessor(_PickyProcessor(hf_processor, 84), 1024, adapter,
                                   data_config=DataConfig(on_bad_input="skip"))
    out = skip.process_multimodal_batch(prompts, images, n_samples_per_prompt=2)
    assert out.all_prompt_indices == [0, 0, 2, 2, 3, 3] and skip.skips.counts == {"processor_error": 1}
    alone = MultimodalDataProcessor(hf_processor, 1024, adapter).process_multimodal_batch(["<image>d"], [images[3]])
    assert torch.equal(out.all_vision_inputs[4]["pixel_values"], alone.all_vision_inputs[0]["pixel_values"])


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 9), max_size=40), max_len=st.integers(0, 45))
def test_truncate_text_left_properties(tokens, max_len):
    """Vision tokens (here 7, 8, 9) all survive, in order; the kept text is the NEWEST text; length fits."""
    from mmrlhf.data.truncation import truncate_text_left

    vision = frozenset({7, 8, 9})
    types = [1 if t in vision else 0 for t in tokens]
    result = truncate_text_left(tokens, types, max_len, vision)
    n_vision = sum(t in vision for t in tokens)
    if n_vision > max_len:
        assert result is None
        return
    ids, kept_types = result
    assert len(ids) == min(len(tokens), max_len) and len(kept_types) == len(ids)
    assert [t for t in ids if t in vision] == [t for t in tokens if t in vision]
    text = [t for t in tokens if t not in vision]
    kept_text = [t for t in ids if t not in vision]
    assert kept_text == text[len(text) - len(kept_text):]
    assert kept_types == [1 if t in vision else 0 for t in ids]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_left_truncation_keeps_chat_structure_and_vision_blocks(family):
    """Truncation drops the oldest user text only: the turn header, the generation prompt and every token of a
    vision block (Qwen3-VL video timestamps included) survive."""
    from PIL import Image
    from transformers import AutoProcessor

    from mmrlhf.config.data import DataConfig
    from mmrlhf.data.processor import MultimodalDataProcessor
    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir(family)
    processor, adapter = AutoProcessor.from_pretrained(path), get_adapter(path)
    frames = [Image.new("RGB", (64, 64), (30 * t, 0, 0)) for t in range(4)]
    prompt = "<video>" + " ".join(["red green blue"] * 20) + " What happens?"
    full = MultimodalDataProcessor(processor, 4096, adapter).process_multimodal_batch([prompt], None, None,
                                                                                     all_videos=[[frames]])
    ids = full.all_prompt_token_ids[0]
    limit = len(ids) - 30
    cut = MultimodalDataProcessor(processor, limit, adapter,
                                  data_config=DataConfig(prompt_max_len=limit, prompt_overflow="truncate_left"))
    out = cut.process_multimodal_batch([prompt], None, None, all_videos=[[frames]])
    short = out.all_prompt_token_ids[0]
    assert out.truncated == 1 and len(short) == limit
    tok = processor.tokenizer
    head = tok.encode("<|im_start|>user\n")
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert short[: len(head)] == head and short[-len(tail):] == tail
    start, end = adapter.vision_start_token_id, adapter.vision_end_token_id
    block = ids[ids.index(start): len(ids) - ids[::-1].index(end)]  # outermost vision block, text inside included
    assert block == short[short.index(start): len(short) - short[::-1].index(end)]
    assert tok.decode(short).endswith("What happens?<|im_end|>\n<|im_start|>assistant\n")
