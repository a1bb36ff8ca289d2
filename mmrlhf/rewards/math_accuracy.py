r"""Math answer accuracy with math-verify.

Why math-verify (over mathruler): it is maintained by Hugging Face, parses both LaTeX (``\frac{1}{2}``,
``\boxed{}``, sets, intervals, percentages) and plain expressions into sympy and checks symbolic equivalence, so
``0.5``, ``\frac12`` and ``1/2`` all match; it is already a declared dependency (``mmrlhf[rewards]``). mathruler is a
smaller regex + sympy grader that we would have to add as a new dependency for no extra coverage.

math-verify guards its sympy calls with ``signal.alarm``, which Python allows only in the main thread (and only a
signal can stop sympy building a huge integer while it holds the GIL, as ``10^{10^{10^{10}}}`` makes it do), so
the function is marked ``@main_thread``: the engine runs it there, alongside remote requests (see
``mmrlhf.rewards.runners``). Outside the main thread it is called without that timeout rather than crash; this is
logged once. Only the response's final answer (``<answer>`` block / last ``\boxed{}``) is parsed, never the prompt.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from mmrlhf.rewards.rules import extract_answer, final_answer
from mmrlhf.rewards.runners import main_thread

logger = logging.getLogger(__name__)
_warned_no_timeout = False


def _timeout(seconds: int) -> int | None:
    global _warned_no_timeout
    if threading.current_thread() is threading.main_thread():
        return seconds
    if not _warned_no_timeout:
        logger.warning("math_accuracy runs outside the main thread: math-verify's signal timeout is disabled")
        _warned_no_timeout = True
    return None


def math_equal(response: str, reference: str, timeout_s: int = 5) -> bool:
    r"""Whether the response's final answer is mathematically equal to ``reference``.

    >>> math_equal("<think>half of one</think><answer>\\frac{1}{2}</answer>", "0.5")
    True
    >>> math_equal("The result is \\boxed{3}", "$4$")
    False
    """
    from math_verify import parse, verify  # imported here: sympy is slow to import and only this rule needs it

    seconds = _timeout(timeout_s)
    gold = parse(_as_math(reference), parsing_timeout=seconds, raise_on_error=True)
    if not gold:
        raise ValueError(f"math-verify found no answer in the reference {reference!r}")
    # An unparseable response is a wrong answer (0), not an error: the policy produced it.
    answer = parse(_as_math(extract_answer(response)), parsing_timeout=seconds)
    if not answer:
        return False
    # Likewise a verification that errors or times out on the policy's answer scores 0 rather than stopping the
    # step (the reference already parsed, so the failure is the response's).
    return bool(verify(gold, answer, timeout_seconds=seconds, raise_on_error=False))


def _as_math(text: str) -> str:
    """Wrap bare text in ``$...$`` so math-verify's LaTeX extractor anchors on it (already-delimited text is kept)."""
    text = text.strip()
    return text if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text else f"${text}$"


@main_thread
def math_accuracy(
    responses: list[str], prompts: list[str], labels: list[str], references: list[Any], timeout_s: int = 5
) -> list[float | None]:
    """1.0 if the final answer equals the reference under math-verify, 0.0 if not, None without a reference."""
    del labels  # the answer is read from the response, after its thinking block (the prompt may open it)
    return [
        None if ref is None else float(math_equal(final_answer(resp, prompt), str(ref), timeout_s))
        for resp, ref, prompt in zip(responses, references, prompts)
    ]
