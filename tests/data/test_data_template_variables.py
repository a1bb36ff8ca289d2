"""``data.chat_template_kwargs`` reach the templates that read them and only those.

A processor's ``apply_chat_template`` takes a variable its template does not read for a processor argument and
logs a warning at every call: the toy recipe (which sets ``enable_thinking`` for Qwen3.5) printed 3,840 identical
lines over 200 steps on Qwen2-VL."""

from __future__ import annotations

import logging

import pytest
from data_testing import solid_image

from mmrlhf.data.prompts import PromptRenderer, template_variables
from mmrlhf.testing.tiny_models import tiny_model_dir

PROMPT = "<image>What color is the square?"


@pytest.fixture(scope="module")
def processors():
    from transformers import AutoProcessor

    return {f: AutoProcessor.from_pretrained(tiny_model_dir(f)) for f in ("qwen2_vl", "qwen3_5")}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def transformers_warnings():
    """Every record transformers logs (its loggers do not propagate to the root, so caplog does not see them)."""
    from transformers.utils import logging as hf_logging

    handler, root = _Records(), hf_logging.get_logger()
    root.addHandler(handler)
    yield handler.records
    root.removeHandler(handler)


def test_template_variables_of_the_tiny_templates(processors):
    assert "enable_thinking" in template_variables(processors["qwen3_5"].chat_template)
    assert "enable_thinking" not in template_variables(processors["qwen2_vl"].chat_template)
    assert template_variables({"default": "{{ x }}{{ messages }}"}) == {"x", "messages"}
    assert template_variables(None) is None
    assert template_variables("{% generation %}{{ y }}{% endgeneration %}") is None  # a tag this parser lacks


def test_an_unread_variable_is_left_out_without_a_warning(processors, transformers_warnings, caplog):
    renderer = PromptRenderer(processors["qwen2_vl"], template_kwargs={"enable_thinking": False})
    with caplog.at_level(logging.INFO, logger="mmrlhf.data.prompts"):
        texts = {renderer.render(PROMPT) for _ in range(3)}
    plain = processors["qwen2_vl"].apply_chat_template(renderer.to_messages(PROMPT), tokenize=False,
                                                       add_generation_prompt=True)
    assert texts == {plain}
    assert renderer.template_kwargs == {}
    assert not [r for r in transformers_warnings if r.levelno >= logging.WARNING], \
        [r.getMessage() for r in transformers_warnings]
    said = [r.getMessage() for r in caplog.records if "enable_thinking" in r.getMessage()]
    assert len(said) == 1 and caplog.records[0].levelno == logging.INFO  # once, not per prompt


def test_a_read_variable_still_changes_the_render(processors, transformers_warnings):
    thinking = PromptRenderer(processors["qwen3_5"]).render(PROMPT)
    plain = PromptRenderer(processors["qwen3_5"], template_kwargs={"enable_thinking": False}).render(PROMPT)
    assert thinking.endswith("<think>\n") and plain.endswith("<think>\n\n</think>\n\n")
    assert not [r for r in transformers_warnings if r.levelno >= logging.WARNING]


def test_the_control_passing_every_variable_warns(processors, transformers_warnings):
    """What the renderer used to do: the processor takes ``enable_thinking`` for its own argument and warns."""
    processors["qwen2_vl"].apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False)
    assert any("processor_kwargs" in r.getMessage() for r in transformers_warnings)


def test_the_processor_pipeline_renders_without_warnings(make_processor, transformers_warnings):
    proc = make_processor(chat_template_kwargs={"enable_thinking": False})
    proc.process_multimodal_batch([PROMPT] * 2, [solid_image(seed=1), solid_image(seed=2)], ["a", "b"],
                                  n_samples_per_prompt=2)
    assert not [r for r in transformers_warnings if r.levelno >= logging.WARNING]
