"""Left truncation: the system turn survives, and a truncated prompt's text is the text of its truncated ids."""

from __future__ import annotations

import pytest
from data_testing import solid_image
from PIL import Image

from mmrlhf.config.data import DataConfig
from mmrlhf.data import DataError, MultimodalDataProcessor

SYSTEM = "Answer with one colour word."


def _messages(system, parts):
    return [{"role": "system", "content": system}, {"role": "user", "content": parts}]


@pytest.mark.parametrize("form", ["config", "messages"])
def test_truncate_left_keeps_the_system_turn(make_processor, hf_processor, adapter, form):
    """The user's oldest text goes; the system turn (config ``system_prompt`` or a system message) stays whole."""
    text = " red green" * 30 + " What colour?"
    if form == "config":
        prompt, fields = "<image>" + text, {"system_prompt": SYSTEM}
    else:
        prompt, fields = _messages(SYSTEM, [{"type": "image"}, {"type": "text", "text": text}]), {}
    full = make_processor(**fields).process_multimodal_batch([prompt], [solid_image()]).all_prompt_token_ids[0]
    limit = len(full) - 20
    out = make_processor(prompt_max_len=limit, **fields).process_multimodal_batch([prompt], [solid_image()])
    ids = out.all_prompt_token_ids[0]
    tok = hf_processor.tokenizer
    head = tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert out.truncated == 1 and len(ids) == limit
    assert ids[: len(head)] == head
    end = full.index(adapter.vision_end_token_id)
    assert ids == full[: end + 1] + full[end + 1 + 20:]  # exactly the 20 oldest user-text tokens went


def test_a_truncated_prompt_is_counted_and_warned_a_short_one_is_not(make_processor, caplog):
    """The zoom toy's ``prompt_max_len: 64`` cuts a longer question: the batch counts it and one warning names how
    many were cut and the first one's record and lengths."""
    long_prompt, short_prompt = "<image>" + " red green" * 40 + " What colour?", "<image>What colour?"
    processor = make_processor(prompt_max_len=64)
    with caplog.at_level("WARNING", logger="mmrlhf.data"):
        out = processor.process_multimodal_batch([short_prompt], [[solid_image()]], record_ids=["short"])
    assert out.truncated == 0 and not caplog.records
    with caplog.at_level("WARNING", logger="mmrlhf.data"):
        out = processor.process_multimodal_batch([short_prompt, long_prompt, long_prompt],
                                                 [[solid_image()]] * 3, record_ids=["short", "q-long", "q-long-2"])
    assert out.truncated == 2 and len(out.all_prompt_token_ids[1]) == 64
    (record,) = caplog.records
    before = len(make_processor().process_multimodal_batch([long_prompt], [[solid_image()]]).all_prompt_token_ids[0])
    assert record.levelname == "WARNING"
    assert (f"left-truncated 2 prompt(s) of this batch to prompt_max_len=64 (data.prompt_overflow=truncate_left), "
            f"first record 1 (id='q-long'): {before} -> 64 tokens") in record.getMessage()


def test_system_turn_too_long_is_refused_not_cut(make_processor):
    prompt = _messages("red " * 80, "What colour?")
    with pytest.raises(DataError, match=r"record 0\b.*system-turn tokens.*prompt_max_len=48") as info:
        make_processor(prompt_max_len=48).process_multimodal_batch([prompt])
    assert info.value.reason == "prompt_too_long"


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoProcessor

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.testing.tiny_models import tiny_model_dir

    path = tiny_model_dir("qwen3_vl")
    return AutoProcessor.from_pretrained(path), get_adapter(path)


def _frames():
    return [Image.new("RGB", (64, 64), (30 * t, 90, 0)) for t in range(4)]


def _as_vllm_would(processor, adapter, text, videos, images):
    """The ids vLLM gets when it is handed the prompt TEXT: the model's processor on text + items + metadata."""
    kwargs = {"text": [text], "add_special_tokens": False}
    if videos:
        kwargs.update(videos=[v.frames for v in videos], do_sample_frames=False,
                      video_metadata=[adapter.video_metadata(len(v.frames), v.fps) for v in videos])
    if images:
        kwargs["images"] = list(images)
    return list(processor(**kwargs)["input_ids"][0])


@pytest.mark.parametrize("words,cut", [("red green blue", 30), ("红绿蓝", 30)])
def test_truncated_qwen3_video_prompt_text_gives_the_truncated_ids(qwen3, words, cut):
    """Qwen3-VL video prompts go to vLLM as text (the family's expansion interleaves timestamp text with the
    pads): the text must re-process to exactly the truncated ids, also when the cut falls inside a multi-byte
    character (the byte-level tokens of one CJK character)."""
    processor, adapter = qwen3
    prompt = "<image> and <video>" + " ".join([words] * 20) + " What happens?"
    image = solid_image((64, 64), seed=3)
    full = MultimodalDataProcessor(processor, 4096, adapter).process_multimodal_batch(
        [prompt], [image], all_videos=[[_frames()]])
    limit = len(full.all_prompt_token_ids[0]) - cut
    proc = MultimodalDataProcessor(processor, limit, adapter, data_config=DataConfig(prompt_max_len=limit))
    out = proc.process_multimodal_batch([prompt], [image], all_videos=[[_frames()]], n_samples_per_prompt=2)
    ids = out.all_prompt_token_ids[0]
    assert out.truncated == 1 and limit - 8 <= len(ids) <= limit
    if words.isascii():
        assert len(ids) == limit  # whole-word tokens: the first cut already round-trips
    else:
        assert len(ids) < limit  # the cut fell inside a character: one more byte token had to go
    assert adapter.engine_prompt_ids(ids) is None  # this prompt really is sent as text
    again = _as_vllm_would(processor, adapter, out.all_prompts[0], out.all_videos[0], out.all_images[0])
    assert again == ids
    assert out.all_prompts[1] == out.all_prompts[0]
    assert out.all_prompts[0].endswith("What happens?<|im_end|>\n<|im_start|>assistant\n")
    # control: the untruncated text (what all_prompts held before) gives the untruncated ids
    assert _as_vllm_would(processor, adapter, full.all_prompts[0], out.all_videos[0], out.all_images[0]) != ids


class _LossyTokenizer:
    """The real tokenizer, except that decoded text gains a trailing space: a text that never re-tokenises."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._inner.decode(*args, **kwargs) + " "


def test_untruncatable_text_is_refused_by_name(qwen3):
    """Where no rebuilt text gives the truncated ids, the prompt is refused naming the record (error mode) or
    skipped and counted while the rest of the batch goes on (skip mode)."""
    processor, adapter = qwen3
    long = "<video>" + " ".join(["red green blue"] * 20) + " What happens?"
    lossy = _LossyTokenizer(processor.tokenizer)
    cfg = DataConfig(prompt_max_len=60)
    with pytest.raises(DataError, match=r"record 1 \(id='long-one'\).*does not re-tokenise") as info:
        MultimodalDataProcessor(processor, 60, adapter, tokenizer=lossy, data_config=cfg).process_multimodal_batch(
            ["short", long], all_videos=[None, [_frames()]], record_ids=["short-one", "long-one"])
    assert info.value.reason == "truncation_mismatch"
    skip = MultimodalDataProcessor(processor, 60, adapter, tokenizer=lossy,
                                   data_config=cfg.model_copy(update={"on_bad_input": "skip"}))
    out = skip.process_multimodal_batch(["short", long, "<video>fine"], all_videos=[None, [_frames()], [_frames()]],
                                        record_ids=["a", "b", "c"], n_samples_per_prompt=2)
    assert out.all_record_ids == ["a", "a", "c", "c"]
    assert [(s.record_id, s.reason) for s in out.skipped] == [("b", "truncation_mismatch")]
    assert skip.skips.counts == {"truncation_mismatch": 1}
