"""``agent`` config section -> the turn loop (:class:`~mmrlhf.agents.rollout.AgentLoop`). The only place that reads
the section; the loop and the plug-ins take plain arguments."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mmrlhf.agents.loop_types import AgentLimits, ImageEncoder
from mmrlhf.agents.rollout import AgentLoop
from mmrlhf.config.agent import AgentConfig


def agent_limits(cfg: AgentConfig, *, max_new_tokens: int, max_model_len: int) -> AgentLimits:
    """The budgets of one trajectory; the context budget never exceeds the engine's context."""
    context = min(cfg.max_context_tokens or max_model_len, max_model_len)
    return AgentLimits(max_turns=cfg.max_turns, max_tool_calls=cfg.max_tool_calls, max_context_tokens=context,
                       max_new_tokens_per_turn=cfg.max_new_tokens_per_turn or max_new_tokens,
                       max_images=cfg.max_images, stop_at_tool_call=cfg.stop_at_tool_call,
                       max_concurrent_trajectories=cfg.max_concurrent_trajectories, loop=cfg.loop,
                       gather_window_s=cfg.gather_window_s)


def build_tool_map(cfg: AgentConfig) -> dict[str, Any]:
    """Name -> tool for the configured tools (empty in environment mode)."""
    from mmrlhf.agents.tools import build_tools

    return build_tools(list(cfg.tools)) if cfg.tools else {}


def build_agent(cfg: AgentConfig, *, engine: Any, tokenizer: Any, adapter: Any, encode_images: ImageEncoder,
                eos_ids: Sequence[int], max_new_tokens: int, max_model_len: int,
                tools: dict[str, Any] | None = None) -> AgentLoop:
    """The turn loop for ``cfg`` (tools, or an environment) over ``engine``; ``tools`` when already built."""
    from mmrlhf.agents.runner import ToolRunner

    tools = build_tool_map(cfg) if tools is None else tools
    environment: Callable[[], Any] | None = None
    if cfg.environment is not None:
        from mmrlhf.agents.environment import load_environment

        environment = load_environment(cfg.environment, dict(cfg.environment_options))
    runner = ToolRunner.from_config(tools, cfg)
    return AgentLoop(engine, tokenizer, adapter, encode_images,
                     agent_limits(cfg, max_new_tokens=max_new_tokens, max_model_len=max_model_len), eos_ids, runner,
                     tools=tools if environment is None else None, environment=environment)
