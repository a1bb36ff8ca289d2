"""The calculator tool: arithmetic by walking the syntax tree; hostile input refused quickly, never evaluated."""

from __future__ import annotations

import builtins
import re
import time

import pytest

from mmrlhf.agents.builtin_tools import Calculator
from mmrlhf.agents.calculator import CalculatorError, evaluate
from mmrlhf.agents.types import ToolContext

CTX = ToolContext(record={})


@pytest.mark.parametrize("expression, text", [
    ("2 + 3 * 4", "2 + 3 * 4 = 14"),
    ("sqrt(16) + 2**10", "sqrt(16) + 2**10 = 1028"),
    ("(1 + 2) / 4", "(1 + 2) / 4 = 0.75"),
    ("-7 // 2 + 7 % 3", "-7 // 2 + 7 % 3 = -3"),
    ("round(pi, 4)", "round(pi, 4) = 3.1416"),
    ("log(8, 2) + log10(1000)", "log(8, 2) + log10(1000) = 6"),
    ("  max(1, -2.5, 3) ", "max(1, -2.5, 3) = 3"),
    ("factorial(5) - +1", "factorial(5) - +1 = 119"),
    ("10**100", "10**100 = 1" + "0" * 100),
    ("1/3", "1/3 = 0.333333333333"),
])
def test_good_expressions(expression, text):
    result = Calculator()({"expression": expression}, CTX)
    assert result.error is None and result.text == text


@pytest.mark.parametrize("expression, match", [
    ("__import__('os')", "function '__import__' is not allowed"),
    ("__import__('os').system('echo pwned')", "attribute access"),
    ("().__class__.__bases__[0]", "subscripts"),
    ("().__class__", "attribute access"),
    ("(1).real", "attribute access"),
    ("[x for x in range(10)]", "not allowed"),
    ("lambda: 1", "lambda"),
    ("open('/etc/passwd')", "function 'open' is not allowed"),
    ("x", "name 'x' is not allowed"),
    ("'a' * 10", "only numbers"),
    ("1 < 2", "comparisons"),
    ("1 << 1000", "operator LShift is not allowed"),
    ("~1", "operator Invert is not allowed"),
    ("9**9**9", "exponent .* is too large"),
    ("10**10**10", "exponent .* is too large"),
    ("2**1000", "exceeds the calculator's bound"),
    ("(10**50)*(10**60)", "exceeds the calculator's bound"),
    ("2.0**5000", "exponent .* is too large"),
    ("10.0**400", "overflows"),
    ("exp(10000)", "overflows"),
    ("factorial(100000)", "factorial needs"),
    ("round(5, -10**18)", "round"),
    ("1e999", "not a finite number"),
    ("(-8)**(1/3)", "not a real number"),
    ("1/0", "division by zero"),
    ("sqrt(-1)", "math domain error"),
    ("1 +", "invalid syntax"),
    ("max()", "max"),
    ("sqrt(x=4)", "positional numbers only"),
    ("1" * 501, "longer than 500"),
])
def test_hostile_and_bad_expressions_are_refused_quickly(expression, match):
    start = time.monotonic()
    result = Calculator()({"expression": expression}, CTX)
    assert time.monotonic() - start < 1.0
    assert result.error == "bad_arguments", result.text
    assert result.text.startswith("Error: ")
    assert re.search(match, result.text), result.text


def test_deep_nesting_within_the_length_limit_evaluates():
    assert evaluate("-" * 499 + "1") == -1
    assert evaluate("(" * 199 + "1" + ")" * 199) == 1


def test_never_calls_eval_or_exec(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec/compile-to-code was called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert evaluate("2 * (3 + 4)") == 14
    with pytest.raises(CalculatorError):
        evaluate("__import__('os')")


def test_non_string_expression_is_refused():
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate(42)  # type: ignore[arg-type]
