"""``agent``: multi-turn, tool-using rollouts (off unless tools or an environment are configured)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from mmrlhf.config.base import Section


class ToolEntry(Section):
    """A tool with options: ``{tool: image_zoom, options: {min_side: 28}}``."""

    tool: str
    """A registered tool name (``image_zoom``, ``image_crop``, ``image_rotate``, ``calculator``) or
    ``package.module:Name`` / ``path/to/file.py:Name`` (a :class:`mmrlhf.agents.tools.Tool` subclass or instance,
    or a factory returning one)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the tool's constructor."""
    max_concurrency: Optional[int] = Field(default=None, ge=1)
    """At most this many calls of the tool run at once, over every trajectory of the rollout (the rest wait their
    turn, not charged to their deadline): for a backend that takes only so many requests. None: the tool's own
    ``Tool.max_concurrency`` (none for the built-ins); ``agent.tool_workers`` bounds every plain tool together."""


class AgentConfig(Section):
    """Read by the agent rollout (:mod:`mmrlhf.agents.rollout`). Every budget ends a trajectory the same way: it is
    marked (``agent/out_of_budget_rate``), kept, and scored by ``out_of_budget_reward``."""

    tools: list[Union[str, ToolEntry]] = Field(default_factory=list)
    """Tools the policy may call (names or ``{tool, options}``); their names, descriptions and argument schemas go
    into the system prompt through the model's own chat template (``tools=``). Empty and no ``environment``: single
    turn, as without this section."""
    environment: Optional[str] = None
    """An interactive environment instead of tools: ``package.module:Name`` or ``path/to/file.py:Name`` (a class or
    factory with ``reset(record)`` / ``step(action_text)``, see :mod:`mmrlhf.agents.environment`)."""
    environment_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = Field(default=4, ge=1)
    """Most policy turns per trajectory (the first answer counts as one)."""
    max_tool_calls: int = Field(default=8, ge=0)
    """Most tool calls per trajectory; a call beyond it is answered with a ``too_many_calls`` error observation."""
    max_context_tokens: Optional[int] = Field(default=None, ge=16)
    """Token budget of the whole trajectory (prompt, turns and observations); None: ``rollout.max_model_len``.
    Each turn may generate what is left of it (capped by ``max_new_tokens_per_turn``); an observation that does not
    fit ends the trajectory before it is added (ids and pixels never disagree)."""
    max_new_tokens_per_turn: Optional[int] = Field(default=None, ge=1)
    """Cap on one turn's new tokens; None: ``rollout.max_new_tokens``."""
    max_images: int = Field(default=8, ge=0)
    """Most images per trajectory, the prompt's included; a tool image beyond it becomes a ``too_many_images`` error
    observation. The vLLM engine's per-prompt image limit is raised to this value."""
    max_image_pixels: int = Field(default=16_777_216, gt=0)
    """Largest image (width x height, before the processor's resize) a tool may return; larger ones become an
    ``image_too_large`` error observation."""
    max_text_chars: int = Field(default=32_768, gt=0)
    """Longest text (characters) a tool call or an environment may return; a longer one becomes a ``text_too_long``
    error observation (refused whole, never cut, as an oversize image). About 8k tokens of English at the default:
    past it an observation takes most of a usual RL context anyway. Text within it may still not fit what is left
    of ``max_context_tokens``: that ends the trajectory (``context``), its failures still counted."""
    tool_timeout_s: float = Field(default=30.0, gt=0.0)
    """Deadline of one tool call (or environment step); past it the call is answered with a ``timeout`` error."""
    tool_workers: int = Field(default=16, ge=1)
    """Tool calls run concurrently in a pool of this many threads (async tools on one event loop)."""
    max_concurrent_trajectories: Optional[int] = Field(default=None, ge=1)
    """Most trajectories (and so environment sessions) alive at once, whole groups (one group at least, so ``n``
    when it is below ``n``). With ``loop: async`` a pool: a group starts as soon as there is room for it, a
    trajectory's session counting until its ``close()`` returned (a ``reusable`` environment still clean serves the
    next trajectory after ``reset``); with ``lockstep``, waves, each wave's environments closed before the next
    starts. For an environment or tool backend that holds only so many sessions. The trajectories are the same
    whatever the bound (each turn samples from its own trajectory's seed). None: the whole step at once."""
    loop: Literal["auto", "async", "lockstep"] = "auto"
    """How trajectories share the engine. ``async``: each runs on its own, its next turn sent as soon as its
    observation is ready, its calls started as soon as its turn ends. ``lockstep``: every turn waits for the whole
    wave's turns, then for all its tool calls. ``auto``: ``async`` over a vLLM engine whose stream has run on this
    kind of machine (vLLM's CPU platform in-process, which the suite runs; on a GPU once ``mmrlhf doctor --gpu``
    compared it with lockstep there and recorded the pass), else ``lockstep`` (an unproven CUDA vLLM, the
    transformers engine, a CPU engine capturing routed experts, partial rollouts); the choice and why are logged
    once. Each turn draws from its trajectory's own seed, so both sample the same trajectories where the engine is
    batch-invariant (float32 on the CPU: exact); in bf16 on a GPU within its batch variance (a trajectory may part
    at a near-tie token) unless vLLM runs with ``VLLM_BATCH_INVARIANT=1``. ``async`` does not wait for the slowest
    tool or turn (docs/agents.md)."""
    gather_window_s: float = Field(default=0.005, ge=0.0, le=1.0, allow_inf_nan=False)
    """``loop: async`` only: before the engine's next step, the loop waits up to this long (from each call's start)
    for the tool calls and environment steps that just started, so that the turns they make ready reach the engine
    together and the tools do not run beside the engine's thread. It waits only while the recent calls have been
    answering within the window (their median), so slow tools never hold the engine back. Measured on the CPU
    (``benchmarks/bench_agents.py``, five runs, cold caches): on the agent toy, whose tools answer in milliseconds,
    the asynchronous loop ran 0.91-0.98x lockstep's speed with the 5 ms window and 0.89-0.95x without (lockstep
    against itself: 0.97-1.04x); with long-tailed tools 1.89x either way. Samples are the same whatever it is
    (each turn draws from its own seed). 0: never wait."""
    stop_at_tool_call: bool = True
    """End a turn at ``</tool_call>`` (the engine stops there), so nothing the policy writes after a call is kept or
    trained; the template's end-of-turn token is then part of the observation."""
    out_of_budget_reward: Literal["score", "zero"] = "score"
    """Reward of a trajectory ended by a budget (``max_turns``, context, a turn's length limit): ``score`` scores
    what it has (its last assistant turn is the answer); ``zero`` gives 0 without calling the reward sources."""
    tool_bonus: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """Exploration bonus against interaction collapse (docs/agents.md): added to the reward of every trajectory that
    made a tool call answered without an error and then answered (one a budget ended gets none), in the step's
    shaping before the advantages (``reward/mean``, dynamic sampling and evaluations see the task's reward only;
    ``agent/tool_bonus`` logs the step's value). 0: off."""
    tool_bonus_steps: Optional[int] = Field(default=None, ge=1)
    """Anneal ``tool_bonus`` linearly to 0: the step that trains after ``s`` finished steps pays
    ``tool_bonus * max(0, 1 - s / tool_bonus_steps)``, so exactly the first ``tool_bonus_steps`` steps pay one and
    the objective is the task's from then on. None: the bonus is never annealed."""

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    @model_validator(mode="after")
    def _one_kind(self) -> "AgentConfig":
        if self.tools and self.environment is not None:
            raise ValueError("agent.tools and agent.environment are exclusive: an environment answers every turn "
                             "itself (give it the tools it needs)")
        if self.tool_bonus > 0 and not self.tools:
            raise ValueError("agent.tool_bonus pays trajectories that called a tool: it needs agent.tools")
        if self.tool_bonus_steps is not None and self.tool_bonus == 0:
            raise ValueError("agent.tool_bonus_steps anneals agent.tool_bonus, which is 0 (off): set agent.tool_bonus "
                             "or drop agent.tool_bonus_steps")
        return self
