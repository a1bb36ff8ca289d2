"""The vLLM engine as a stream (mmrlhf.rollout.vllm_stream), on the tiny Qwen2-VL (float32, CPU): requests sent one
at a time while others run come back as a ``generate`` call gives them (tokens, log-probs, the prompt it saw); a
prompt that does not fit is skipped naming its record, or raised under ``prompt_too_long=error``; a stream closed
with requests running leaves the engine clean for the next ``generate``."""

from __future__ import annotations

import pytest

from mmrlhf.rollout.streaming import BatchedStream, open_stream
from mmrlhf.rollout.types import GenerationRequest, PromptTooLongError, SamplingSettings
from mmrlhf.testing.tiny_models import tiny_model_dir
from mmrlhf.testing.tolerances import FP32_TOLERANCE

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~20 s: an engine, a dozen requests
pytest.importorskip("vllm")


def _requests(tok, count: int) -> list[GenerationRequest]:
    words = ["red", "green", "blue", "what color is the square", "how many circles"]
    return [GenerationRequest(prompt="", prompt_token_ids=tok(words[i % len(words)] * (1 + i % 3),
                                                              add_special_tokens=False)["input_ids"],
                              request_id=f"r{i}", seed=1000 + 7 * i) for i in range(count)]


def test_streamed_requests_come_back_as_a_generate_call_gives_them():
    from transformers import AutoTokenizer

    from mmrlhf.models.adapters import get_adapter
    from mmrlhf.rollout.vllm_engine import VLLMEngine

    path = tiny_model_dir("qwen2_vl")
    tok = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(str(path), get_adapter(path), max_model_len=64, dtype="float32")
    settings = SamplingSettings(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    requests = _requests(tok, 6)
    try:
        whole = engine.generate(requests, settings)
        stream = open_stream(engine)
        assert stream.continuous and not isinstance(stream, BatchedStream)
        got, steps = {}, 0
        stream.submit(0, requests[0], settings)
        while stream.busy or len(got) < len(requests):
            if steps < len(requests) - 1:  # the others join one engine step apart, while the first ones run
                stream.submit(steps + 1, requests[steps + 1], settings)
            for f in stream.step():
                got[f.key] = f
            steps += 1
        assert steps > len(requests)
        for out in whole.outputs:
            mine = got[out.request_index].output
            assert mine.prompt_token_ids == out.prompt_token_ids
            for a, b in zip(out.completions, mine.completions, strict=True):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < FP32_TOLERANCE
        # a prompt that does not fit: skipped, named by its record; nothing else is lost
        long = GenerationRequest(prompt="", prompt_token_ids=[tok.convert_tokens_to_ids("red")] * 70,
                                 request_id="too-long")
        stream.submit("long", long, settings)
        stream.submit("ok", requests[1], settings)
        done = {}
        while stream.busy:
            done.update({f.key: f for f in stream.step()})
        assert done["long"].output is None and "too-long" in done["long"].skipped
        assert done["ok"].output.completions[0].token_ids == whole.outputs[1].completions[0].token_ids
        # closed with requests running: they are dropped, and the next generate call is the engine's alone
        stream.submit("left", requests[2], settings)
        stream.step()
        stream.close()
        assert not stream.busy
        again = engine.generate(requests[:2], settings)
        assert [o.completions[0].token_ids for o in again.outputs] == [
            o.completions[0].token_ids for o in whole.outputs[:2]]
        engine.prompt_too_long = "error"
        with pytest.raises(PromptTooLongError, match="too-long"):
            open_stream(engine).submit("long", long, settings)
    finally:
        engine.close()
