"""The tool registry and building tools from config (``agent.tools``).

A tool is named by a registered name (:data:`TOOLS`: ``image_zoom``, ``image_crop``, ``image_rotate``,
``calculator``) or by ``package.module:Name`` / ``path/to/file.py:Name`` resolved through the registry (by import),
where ``Name`` is a :class:`Tool` subclass (instantiated with the entry's options), a Tool instance (no options), or
a factory callable returning a Tool (called with the options). Every built tool is checked once (name, description,
a valid JSON schema of type object), so a broken plug-in fails the run's start.

The built-ins are listed here rather than registered by decorators in their module, so that importing this module
is what makes the names exist (no import side effect to remember, no circle).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping

from mmrlhf.agents.builtin_tools import Calculator, ImageCrop, ImageRotate, ImageZoom
from mmrlhf.agents.tool_base import Tool, ToolSpecError, as_result, check_tool, is_async_tool, validate_arguments
from mmrlhf.config.agent import ToolEntry
from mmrlhf.registry import Registry, check_options

__all__ = [
    "TOOLS", "Tool", "ToolSpecError", "as_result", "build_tool", "build_tools", "is_async_tool", "tool_schemas",
    "validate_arguments",
]


def _with_builtins() -> Registry[Any]:
    registry: Registry[Any] = Registry("tool")
    for cls in (ImageZoom, ImageCrop, ImageRotate, Calculator):
        registry.add(cls.name, cls)
    return registry


TOOLS = _with_builtins()
"""Built-in tools by name (classes); ``package.module:Name`` and ``path/to/file.py:Name`` resolve through it too."""


def _entry(entry: str | ToolEntry | Mapping[str, Any]) -> ToolEntry:
    if isinstance(entry, ToolEntry):
        return entry
    if isinstance(entry, str):
        return ToolEntry(tool=entry)
    if isinstance(entry, Mapping):
        try:
            return ToolEntry.model_validate(dict(entry))
        except ValueError as exc:
            raise ToolSpecError(f"tool entry {dict(entry)!r} is not {{tool: <name>, options: {{...}}}}: {exc}") \
                from exc
    raise ToolSpecError(f"a tool entry is a name or {{tool, options}}, got a {type(entry).__name__}: {entry!r}")


def _construct(factory: Any, options: dict[str, Any], spec: str) -> Any:
    """``factory(**options)``, with a message naming the spec when the options do not fit its signature or the
    constructor refuses them."""
    check_options(factory, options, f"tool {spec!r}", error=ToolSpecError)
    try:
        return factory(**options)
    except (TypeError, ValueError) as exc:
        raise ToolSpecError(f"tool {spec!r}: {exc}") from exc


def build_tool(entry: str | ToolEntry | Mapping[str, Any]) -> Tool:
    """One configured tool: a registered name, ``module:Name`` or ``file.py:Name``, with ``options`` as keyword
    arguments of its constructor (or factory) and the entry's ``max_concurrency`` set on it. Errors name the spec
    and say what it resolved to."""
    entry = _entry(entry)
    spec, options = entry.tool, dict(entry.options)
    target = TOOLS.get(spec)
    if inspect.isclass(target):
        if not issubclass(target, Tool):
            raise ToolSpecError(f"tool {spec!r} is the class {target.__name__}, which is not a subclass of "
                                "mmrlhf.agents.tools.Tool")
        tool = _construct(target, options, spec)
    elif isinstance(target, Tool):
        if options:
            raise ToolSpecError(f"tool {spec!r} is a ready Tool instance and takes no options (got "
                                f"{sorted(options)}); point at its class or a factory to pass options")
        tool = target
    elif callable(target):
        tool = _construct(target, options, spec)
        if not isinstance(tool, Tool):
            raise ToolSpecError(f"tool {spec!r}: the factory returned a {type(tool).__name__}, not a "
                                "mmrlhf.agents.tools.Tool")
    else:
        raise ToolSpecError(f"tool {spec!r} resolved to a {type(target).__name__}; expected a Tool subclass, a "
                            "Tool instance or a factory returning a Tool")
    if entry.max_concurrency is not None:  # the entry's bound wins over the tool's own
        tool.max_concurrency = entry.max_concurrency
    return check_tool(tool, spec)


def build_tools(entries: Iterable[str | ToolEntry | Mapping[str, Any]]) -> dict[str, Tool]:
    """The configured tools by name, in config order; two tools of one name are refused (the model could not
    tell them apart)."""
    tools: dict[str, Tool] = {}
    for entry in entries:
        tool = build_tool(entry)
        if tool.name in tools:
            raise ToolSpecError(f"two configured tools are named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The ``tools=`` argument of a chat template for these tools, in order."""
    return [tool.schema() for tool in tools.values()]
