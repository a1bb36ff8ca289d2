"""An example environment: guess a whole number, told "higher" or "lower" after each guess.

Use it as ``agent.environment: mmrlhf.agents.example_env:GuessNumber`` with ``environment_options: {low: 1,
high: 100, max_guesses: 7}``. The policy writes its guess as ``<guess>N</guess>`` (the last one in a turn counts);
a turn without one is answered with a reminder and still uses a guess. The secret is ``record["target"]`` when the
record has one, else derived from ``record["id"]`` (or its prompt) by SHA-256: the same record always hides the
same number, in every process (Python's ``hash`` of a str is salted per process, so it is not used).

``info`` (merged into the trajectory for reward functions): ``target``, ``guesses`` (turns taken), ``solved``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from mmrlhf.agents.types import StepResult, ToolResult

_GUESS = re.compile(r"<guess>\s*(-?\d{1,18})\s*</guess>")


class GuessNumber:
    """One episode of the guessing game (one per trajectory). ``intro``: reset answers a first observation stating
    the range (off: the prompt states the task)."""

    def __init__(self, *, low: int = 1, high: int = 100, max_guesses: int = 7, intro: bool = False) -> None:
        if not (isinstance(low, int) and isinstance(high, int) and low < high):
            raise ValueError(f"need integers low < high, got low={low!r}, high={high!r}")
        if not isinstance(max_guesses, int) or max_guesses < 1:
            raise ValueError(f"max_guesses must be a positive int, got {max_guesses!r}")
        self.low, self.high, self.max_guesses, self.intro = low, high, max_guesses, intro
        self.target: int | None = None
        self.guesses = 0

    def secret_for(self, record: dict[str, Any]) -> int:
        """The number ``record`` hides (see the module docstring)."""
        if "target" in record:
            target = int(record["target"])
            if not self.low <= target <= self.high:
                raise ValueError(f"record target {target} is outside [{self.low}, {self.high}]")
            return target
        key = str(record.get("id", record.get("prompt", "")))
        digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        return self.low + digest % (self.high - self.low + 1)

    def reset(self, record: dict[str, Any]) -> ToolResult | None:
        self.target, self.guesses = self.secret_for(record), 0
        if self.intro:
            return ToolResult(text=f"I am thinking of a whole number from {self.low} to {self.high}. You have "
                                   f"{self.max_guesses} guesses; write each as <guess>N</guess>.")
        return None

    def step(self, action_text: str) -> StepResult:
        if self.target is None:
            raise RuntimeError("GuessNumber.step called before reset")
        self.guesses += 1
        found = _GUESS.findall(action_text)
        left = self.max_guesses - self.guesses
        if not found:
            text = "Write your guess as <guess>N</guess>."
        else:
            guess = int(found[-1])
            if guess == self.target:
                return StepResult(ToolResult(text=f"Correct: the number is {guess}."), done=True,
                                  info=self._info(solved=True))
            text = f"{guess} is too low: guess higher." if guess < self.target else f"{guess} is too high: guess lower."
        if left <= 0:
            return StepResult(ToolResult(text=f"{text} No guesses left."), done=True, info=self._info(solved=False))
        return StepResult(ToolResult(text=f"{text} {left} guess{'es' if left > 1 else ''} left."),
                          info=self._info(solved=False))

    def _info(self, *, solved: bool) -> dict[str, Any]:
        return {"target": self.target, "guesses": self.guesses, "solved": solved}
