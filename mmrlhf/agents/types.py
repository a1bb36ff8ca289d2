"""Plain data of multi-turn, tool-using rollouts: what a tool or an environment receives and returns, and the
trajectory a reward function may read. No engine, model or tokenizer references (a trajectory travels to reward
servers and Ray actors).

Vocabulary used across :mod:`mmrlhf.agents`:

- a *turn* is one generation by the policy (its tokens are *policy tokens*: trained, scored, counted);
- an *observation* is what comes back between two turns: the chat template's tool turn (or an environment's
  observation turn) with its text and images, then the next assistant header (*observation tokens*: attended to,
  never trained);
- a *trajectory* is the first prompt followed by turns and observations, kept as token ids end to end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Kinds of tool failure, each counted in the step metrics (``agent/errors/<kind>``) and answered to the model as an
# error observation it can learn from (never a crash, never dropped).
ERROR_KINDS = (
    "bad_json",  # the text between <tool_call> and </tool_call> is not a JSON object with "name" / "arguments"
    "unknown_tool",  # the name is not one of the configured tools
    "bad_arguments",  # the arguments fail the tool's JSON schema
    "tool_raised",  # the tool raised (any BaseException: sys.exit and KeyboardInterrupt in a tool included)
    "timeout",  # the tool did not answer within agent.tool_timeout_s
    "image_too_large",  # an image the tool returned exceeds agent.max_image_pixels
    "text_too_long",  # the text the tool returned exceeds agent.max_text_chars
    "too_many_images",  # the trajectory would exceed agent.max_images
    "too_many_calls",  # the trajectory would exceed agent.max_tool_calls
)


@dataclass
class ToolResult:
    """What a tool (or an environment step) answers: text and / or images (PIL), in that order of rendering
    (images first, then the text, inside one tool-response block). ``error`` names the failure kind
    (:data:`ERROR_KINDS`) when the result is an error message, None when the call succeeded."""

    text: str = ""
    images: list[Any] = field(default_factory=list)
    error: str | None = None


@dataclass
class ToolContext:
    """What a tool call sees besides its arguments.

    ``record``: the dataset record of the trajectory: ``prompt``, ``reference``, ``label``, ``id`` (under these
    names whatever ``data.*_key`` reads them) and every other column of the row under its own name, as read (the
    images / videos columns come as ``images`` / ``videos`` below instead); ``data_dir``: the folder the record's
    relative paths are relative to (the folder of its data file; None for generated records, whose relative paths
    are relative to the working directory, as for the data processor); ``images`` / ``videos``: the record's
    ORIGINAL inputs at full resolution (a zoom tool crops these, not the resized copy the model saw);
    ``model_image_sizes``: ``(width, height)`` of each input image as the model saw it after the processor's resize
    (the space Qwen2.5-VL's absolute boxes live in); ``box_space``: how the model family writes boxes
    (``"absolute"``: pixels of the resized image, Qwen2.5-VL; ``"relative1000"``: 0-1000 of the image, Qwen2-VL and
    Qwen3-VL); ``state``: a per-trajectory dict the tools of one trajectory share (e.g. the images they returned so
    far); ``trajectory_index``: the trajectory's position in the step.

    ``record`` is shared by the trajectories of one prompt: read it, keep what a call changes in ``state``."""

    record: dict[str, Any]
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    model_image_sizes: list[tuple[int, int]] = field(default_factory=list)
    box_space: str = "relative1000"
    state: dict[str, Any] = field(default_factory=dict)
    trajectory_index: int = 0
    data_dir: str | None = None

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        """Where a path written in the record points: an absolute path as it is, a relative one under
        :attr:`data_dir` (under the working directory when there is none). Not checked here: a missing file raises
        where the tool opens it, naming the path (a ``tool_raised`` observation)."""
        path = Path(path)
        if path.is_absolute() or self.data_dir is None:
            return path
        return Path(self.data_dir) / path


@dataclass
class ToolCall:
    """One parsed call: the tool's name, its arguments (a dict after JSON parsing), the raw text between the call
    tags (kept for reports and error messages)."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass
class ParsedTurn:
    """What the policy's turn asked for: the calls it made (possibly none: then the turn is the final answer) and the
    failures found while parsing (each a :class:`ToolResult` with ``error`` set, answered as an observation).

    ``order`` says how calls and errors interleaved in the text: ``("call", i)`` is ``calls[i]``, ``("error", j)``
    is ``errors[j]``; the observation answers them in that order (:meth:`items`). Left empty (a ParsedTurn built by
    hand), the order is every call, then every error."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolResult] = field(default_factory=list)
    order: list[tuple[str, int]] = field(default_factory=list)

    def items(self) -> list[ToolCall | ToolResult]:
        """Calls (ToolCall) and parse errors (ToolResult) in the order they appeared in the turn's text."""
        order = self.order or [("call", i) for i in range(len(self.calls))] + [
            ("error", j) for j in range(len(self.errors))
        ]
        return [self.calls[i] if kind == "call" else self.errors[i] for kind, i in order]

    @property
    def is_final(self) -> bool:
        """No call and no malformed call: the turn is the answer."""
        return not self.calls and not self.errors


@dataclass
class StepResult:
    """An environment's answer to one action: the next observation (text and / or images), whether the episode is
    over, and free-form info the reward functions receive in the trajectory."""

    observation: ToolResult
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class FailedStep(StepResult):
    """What the runner answers for an environment call (``reset`` or ``step``) that failed: it raised, timed out
    (a plain call's thread may still be running inside the environment), or returned what the runner refused (not a
    StepResult, an image or a text over its limit). The episode is over, and the environment is no longer known to
    be clean: the loop closes it and never hands it to another trajectory."""

    done: bool = True


@dataclass
class TurnRecord:
    """One step of a trajectory as reward functions and reports see it.

    ``role`` is ``"assistant"`` (a policy turn: ``text`` is its decoded tokens, ``calls`` what it asked for) or
    ``"tool"`` (an observation: ``text`` and ``images`` of each result, ``errors`` the failure kinds among them,
    ``latency_s`` the slowest call's seconds)."""

    role: str
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    latency_s: float = 0.0


# How a trajectory ended (``Trajectory.ended``).
ENDINGS = (
    "answer",  # a turn without a tool call: the final answer
    "done",  # the environment said the episode is over
    "max_turns",  # agent.max_turns policy turns were generated
    "context",  # the next observation or turn would not fit agent.max_context_tokens / the engine's context
    "length",  # the last turn hit its token limit without finishing
)
BUDGET_ENDINGS = ("max_turns", "context", "length")


@dataclass
class Trajectory:
    """The whole multi-turn exchange of one sample, for reward functions (``trajectories`` argument) and reports.

    ``turns`` alternate assistant / tool records, starting and ending with an assistant turn unless the budget cut
    it; ``final_answer`` is the decoded text of the last assistant turn (what rule rewards score); ``ended`` one of
    :data:`ENDINGS`; ``info`` what an environment reported (merged over its steps)."""

    turns: list[TurnRecord] = field(default_factory=list)
    final_answer: str = ""
    ended: str = "answer"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for t in self.turns if t.role == "assistant" for c in t.calls]

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def errors(self) -> list[str]:
        return [e for t in self.turns if t.role == "tool" for e in t.errors]

    @property
    def out_of_budget(self) -> bool:
        return self.ended in BUDGET_ENDINGS
