"""Arithmetic the policy writes, evaluated by walking its syntax tree: never ``eval``.

Allowed: int and float literals; ``+ - * / // % **``; unary ``+`` / ``-``; parentheses; calls of the functions in
:data:`FUNCTIONS` with positional arguments; the constants in :data:`CONSTANTS`. Everything else (names, attribute
access, subscripts, strings, comparisons, lambdas, keywords...) is refused with a :class:`CalculatorError` naming
it. Sizes are bounded so an expression cannot exhaust the machine: the text's length, exponents (``|b| <=
MAX_EXPONENT``, and integer powers whose result would exceed ``MAX_MAGNITUDE`` are refused before computing),
``factorial``'s argument, and every intermediate value's magnitude.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

MAX_LENGTH = 500
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e100
MAX_FACTORIAL = 100

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is meant for the model."""


def _factorial(n: Number) -> int:
    if isinstance(n, float):
        if not n.is_integer():
            raise CalculatorError("factorial needs a whole number")
        n = int(n)
    if not 0 <= n <= MAX_FACTORIAL:
        raise CalculatorError(f"factorial needs a whole number from 0 to {MAX_FACTORIAL}")
    return math.factorial(n)


def _round(value: Number, ndigits: Number = 0) -> Number:
    if not isinstance(ndigits, int) or abs(ndigits) > 100:
        raise CalculatorError("round() takes a whole number of digits from -100 to 100")
    return round(value, ndigits)


FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log10": math.log10, "log2": math.log2,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan,
    "atan2": math.atan2, "sinh": math.sinh, "cosh": math.cosh, "tanh": math.tanh,
    "degrees": math.degrees, "radians": math.radians, "hypot": math.hypot,
    "abs": abs, "round": _round, "floor": math.floor, "ceil": math.ceil, "min": min, "max": max,
    "factorial": _factorial,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def _bounded(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"the result is not a real number ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a value exceeds the calculator's bound of {MAX_MAGNITUDE:g}")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent:g} is too large (at most {MAX_EXPONENT} in size)")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE) + 1:
            raise CalculatorError(f"{base} ** {exponent} exceeds the calculator's bound of {MAX_MAGNITUDE:g}")
    return base**exponent


def _node_name(node: ast.AST) -> str:
    names = {ast.Attribute: "attribute access", ast.Subscript: "subscripts", ast.Compare: "comparisons",
             ast.BoolOp: "'and' / 'or'", ast.Lambda: "lambda", ast.IfExp: "conditional expressions",
             ast.Call: "calling the result of a call"}
    return names.get(type(node), f"{type(node).__name__} expressions")


class _Evaluator:
    def visit(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
            return _bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.visit(node.left), self.visit(node.right)
            if isinstance(node.op, ast.Pow):
                return self._apply(_power, left, right, symbol=_SYMBOL[ast.Pow])
            return self._apply(_BINARY[type(node.op)], left, right, symbol=_SYMBOL[type(node.op)])
        if isinstance(node, ast.BinOp):
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; use + - * / // % **")
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _bounded(_UNARY[type(node.op)](self.visit(node.operand)))
        if isinstance(node, ast.UnaryOp):
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; use unary + or -")
        if isinstance(node, ast.Name):
            if node.id in CONSTANTS:
                return CONSTANTS[node.id]
            raise CalculatorError(f"name {node.id!r} is not allowed; constants: {', '.join(CONSTANTS)}")
        if isinstance(node, ast.Call):
            return self._call(node)
        raise CalculatorError(f"not allowed: {_node_name(node)}")

    def _call(self, node: ast.Call) -> Number:
        if not isinstance(node.func, ast.Name):
            raise CalculatorError(f"not allowed: {_node_name(node.func)} (only these functions may be called: "
                                  f"{', '.join(FUNCTIONS)})")
        name = node.func.id
        if name not in FUNCTIONS:
            raise CalculatorError(f"function {name!r} is not allowed; allowed: {', '.join(FUNCTIONS)}")
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise CalculatorError(f"{name}() takes positional numbers only")
        args = [self.visit(arg) for arg in node.args]
        return self._apply(FUNCTIONS[name], *args, symbol=f"{name}()")

    @staticmethod
    def _apply(fn: Callable[..., Any], *args: Number, symbol: str) -> Number:
        try:
            return _bounded(fn(*args))
        except CalculatorError:
            raise
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"{symbol} overflows") from None
        except (ValueError, TypeError) as exc:
            raise CalculatorError(f"{symbol}: {exc}") from None


def evaluate(expression: str) -> Number:
    """The value of ``expression`` (int or float), or CalculatorError saying what is wrong or not allowed."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid syntax ({exc.msg})") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    try:
        return _Evaluator().visit(tree)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Number) -> str:
    """A short, exact-looking rendering: whole floats without ``.0``, others with 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)
