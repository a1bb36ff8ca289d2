"""Built-in rule rewards: format checks and answer matching.

Every rule scores the RESPONSE text only. The prompt is never inspected: chat templates of reasoning models often
end the prompt with ``<think>``, and concatenating prompt and response would let a response that never opened its
own think block look well formatted.

Per-sample helpers (``is_think_answer_format``, ``extract_answer``, ...) are plain functions with examples; the
rewards wrap them in the plugin signature ``fn(responses, prompts, labels, references, **columns)`` and are
registered by name in :mod:`mmrlhf.rewards.functions`.
Samples without a reference get ``None`` from the matching rules ("does not apply"), never a silent 0.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

_THINK_ANSWER = re.compile(r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def is_think_answer_format(response: str) -> bool:
    """True iff the response is exactly ``<think>...</think>`` then ``<answer>...</answer>`` (whitespace around).

    Each tag must appear exactly once and the answer must not be empty.

    >>> is_think_answer_format("<think>2+2 is 4</think> <answer>4</answer>")
    True
    >>> is_think_answer_format("2+2 is 4</think><answer>4</answer>")  # the opening tag was in the prompt
    False
    >>> is_think_answer_format("<think>a</think><answer>4</answer> and more text")
    False
    >>> is_think_answer_format("<think>a</think><answer> </answer>")
    False
    """
    match = _THINK_ANSWER.fullmatch(response)
    if match is None or not match.group("answer").strip():
        return False
    return all(response.count(tag) == 1 for tag in _TAGS)


def extract_boxed(text: str) -> str | None:
    r"""Content of the LAST ``\boxed{...}`` (nested braces allowed), or None if there is none or it is unclosed.

    >>> extract_boxed(r"so \boxed{\frac{1}{2}} is it")
    '\\frac{1}{2}'
    >>> extract_boxed(r"first \boxed{1}, finally \boxed{2}")
    '2'
    >>> extract_boxed(r"\boxed{1") is None
    True
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for pos in range(begin - 1, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:pos]
    return None


def has_boxed_answer(response: str) -> bool:
    r"""True iff the response contains a closed, non-empty ``\boxed{}``.

    >>> has_boxed_answer(r"The answer is \boxed{42}.")
    True
    >>> has_boxed_answer(r"The answer is \boxed{ }.")
    False
    """
    boxed = extract_boxed(response)
    return boxed is not None and bool(boxed.strip())


def final_answer(response: str, prompt: str = "") -> str:
    r"""The part of a response after its thinking block: what answer rules read (Qwen3.5 and other thinking
    templates write ``<think>...</think>`` before the answer, and reasoning may mention wrong candidates).

    A prompt that leaves a ``<think>`` block open (Qwen3.5's thinking mode opens it in the generation prompt) starts
    the response inside the block: the answer is what follows its ``</think>``, and a response that never closes the
    block has none (''). Otherwise the text after the last ``</think>``, or the whole response.

    >>> final_answer("<think>maybe 3</think> 4")
    ' 4'
    >>> final_answer("maybe 3</think>\n\n4", prompt="<|im_start|>assistant\n<think>\n")
    '\n\n4'
    >>> final_answer("still thinking about 3", prompt="<|im_start|>assistant\n<think>\n")
    ''
    >>> final_answer("4", prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    '4'
    """
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    return "" if thinking_left_open(prompt) else response


def thinking_left_open(prompt: str) -> bool:
    """Whether ``prompt`` ends inside a ``<think>`` block (its last ``<think>`` is not closed)."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


def extract_answer(response: str) -> str:
    r"""The final answer of a response: the last ``<answer>`` block, else the last ``\boxed{}``, else all of it.

    A boxed answer inside the answer block wins over the block's surrounding words.

    >>> extract_answer("<think>...</think><answer>The answer is \\boxed{7}</answer>")
    '7'
    >>> extract_answer("<answer> Paris </answer>")
    'Paris'
    >>> extract_answer("just 12")
    'just 12'
    """
    blocks = _ANSWER.findall(response)
    text = blocks[-1] if blocks else response
    boxed = extract_boxed(text)
    return (boxed if boxed is not None else text).strip()


def normalize_text(text: str) -> str:
    """Case-folded, whitespace-collapsed, with surrounding punctuation and quotes removed.

    >>> normalize_text("  The  Eiffel Tower. ")
    'the eiffel tower'
    """
    return " ".join(text.casefold().split()).strip(" .,;:!?\"'`")


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*[-+]?\d+(?:\.\d+)?)?")


def parse_number(text: str) -> float | None:
    """The last number in ``text`` (thousands separators, decimals, exponents, ``a/b`` fractions), or None.

    >>> parse_number("about 1,234.5 apples")
    1234.5
    >>> parse_number("-3/4")
    -0.75
    >>> parse_number("no digits") is None
    True
    """
    found = [m.group(0) for m in _NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
    if not found:
        return None
    token = found[-1].replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return float(num) / float(den) if float(den) != 0 else None
        return float(token)
    except ValueError:
        return None


_CHOICE_KEYWORD = re.compile(r"(?:answer|option|choice)\s*(?:is\b|:)?\s*", re.IGNORECASE)
# After a keyword only UPPER-case standalone letters count: "the answer is a cat" names no option.
_UPPER_OPTION = re.compile(r"(?<![A-Za-z])\(?([A-Z])\)?(?![A-Za-z])")
_CHOICE_ALONE = re.compile(r"\(?([A-Za-z])\)?(?:[.:)]\s.*|[.:)]?)", re.DOTALL)


def extract_choice(text: str, letters: str = "ABCDEFGH") -> str | None:
    """The option letter a short answer picks, upper-cased, or None if it names none of ``letters``.

    >>> extract_choice("(B)")
    'B'
    >>> extract_choice("c. because the sky is blue")
    'C'
    >>> extract_choice("I think the answer is D")
    'D'
    >>> extract_choice("Banana") is None
    True
    >>> extract_choice("The answer is a cat") is None  # an article is not option A
    True
    >>> extract_choice("the answer is A or B") is None  # a hedge names no single option
    True
    """
    text = text.strip()
    match = _CHOICE_ALONE.fullmatch(text) or None
    if match is None:
        keywords = list(_CHOICE_KEYWORD.finditer(text))
        if not keywords:
            return None
        clause = re.split(r"[.;\n]", text[keywords[-1].end():], maxsplit=1)[0].strip()
        whole = re.fullmatch(r"\(?([A-Za-z])\)?", clause)  # "the answer is b": any case when it stands alone
        if whole:
            letter = whole.group(1)
        else:
            picks = {m.group(1) for m in _UPPER_OPTION.finditer(clause) if m.group(1) in letters.upper()}
            letter = picks.pop() if len(picks) == 1 else None
    else:
        letter = match.group(1)
    if letter is None or letter.upper() not in letters.upper():
        return None
    return letter.upper()


def _per_sample(
    score: Callable[[str, str], float], responses: list[str], references: list[str | None], prompts: list[str]
) -> list[float | None]:
    """``score(final answer, reference)`` per sample (the thinking block left out, :func:`final_answer`)."""
    return [None if ref is None else score(final_answer(resp, prompt), ref)
            for resp, ref, prompt in zip(responses, references, prompts)]


def think_answer_format(
    responses: list[str], prompts: list[str], labels: list[str], references: list[Any]
) -> list[float]:
    """1.0 for responses formatted ``<think>...</think><answer>...</answer>``, else 0.0 (prompts ignored: a block the
    prompt opened is not the policy's; with a thinking-mode template, reward the answer, which answer rules read
    after the block, :func:`final_answer`)."""
    del prompts, labels, references  # the format is a property of the response alone
    return [1.0 if is_think_answer_format(r) else 0.0 for r in responses]


def boxed_format(responses: list[str], prompts: list[str], labels: list[str], references: list[Any]) -> list[float]:
    r"""1.0 for responses containing a closed, non-empty ``\boxed{}``, else 0.0 (prompts ignored)."""
    del prompts, labels, references
    return [1.0 if has_boxed_answer(r) else 0.0 for r in responses]


def exact_match(
    responses: list[str], prompts: list[str], labels: list[str], references: list[str | None]
) -> list[float | None]:
    """1.0 if the extracted answer equals the reference after :func:`normalize_text`; None without a reference."""
    del labels

    def score(response: str, reference: str) -> float:
        return float(normalize_text(extract_answer(response)) == normalize_text(str(reference)))

    return _per_sample(score, responses, references, prompts)


def numeric_match(
    responses: list[str],
    prompts: list[str],
    labels: list[str],
    references: list[str | None],
    rel_tol: float = 1e-4,
    abs_tol: float = 1e-8,
) -> list[float | None]:
    """1.0 if the answer's last number is within ``rel_tol`` / ``abs_tol`` of the reference's; None without one.

    A reference that holds no number is a data error and raises, naming the reference.
    """
    del labels

    def score(response: str, reference: str) -> float:
        gold = parse_number(str(reference))
        if gold is None:
            raise ValueError(f"reference {reference!r} contains no number")
        got = parse_number(extract_answer(response))
        return float(got is not None and math.isclose(got, gold, rel_tol=rel_tol, abs_tol=abs_tol))

    return _per_sample(score, responses, references, prompts)


def multiple_choice(
    responses: list[str], prompts: list[str], labels: list[str], references: list[str | None], letters: str = "ABCDEFGH"
) -> list[float | None]:
    """1.0 if the answer picks the reference's option letter; None without a reference."""
    del labels

    def score(response: str, reference: str) -> float:
        gold = extract_choice(str(reference), letters)
        if gold is None:
            raise ValueError(f"reference {reference!r} is not one of the option letters {letters!r}")
        return float(extract_choice(extract_answer(response), letters) == gold)

    return _per_sample(score, responses, references, prompts)
