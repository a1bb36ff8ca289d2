"""How vLLM rejects a request, told apart: a prompt too long for the context (which ``rollout.prompt_too_long``
may skip) from any other rejection (always an error naming the request). Shared by ``generate`` calls
(:mod:`mmrlhf.rollout.vllm_engine`) and streamed requests (:mod:`mmrlhf.rollout.vllm_stream`)."""

from __future__ import annotations


def validation_errors() -> tuple[type[BaseException], ...]:
    """The exception types vLLM raises for an invalid request (the class moved between versions)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMValidationError)


def is_length_error(exc: BaseException) -> bool:
    """Whether vLLM rejected a request for its length (the only rejection the skip policy covers)."""
    if getattr(exc, "parameter", None) in ("input_tokens", "prompt_tokens"):
        return True
    text = str(exc).lower()
    return "context length" in text or "max_model_len" in text or "maximum model length" in text
