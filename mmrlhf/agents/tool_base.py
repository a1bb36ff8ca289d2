"""The tool plug-in interface: the :class:`Tool` base class, argument validation against its JSON schema, and the
normalisation of whatever a tool returned into a :class:`~mmrlhf.agents.types.ToolResult`.

Why a module of its own: the built-in tools subclass :class:`Tool` and the tool registry
(:mod:`mmrlhf.agents.tools`) lists the built-ins, so the base cannot live beside the registry without an import
circle. Plug-in authors import it from either place (``mmrlhf.agents.tools.Tool`` is the same class).
"""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any

import jsonschema
from PIL import Image

from mmrlhf.agents.types import ERROR_KINDS, ToolContext, ToolResult

# Function names as chat templates and the OpenAI tool format accept them.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
_MAX_MESSAGE = 300


class ToolSpecError(ValueError):
    """A tool that cannot be built or used as configured (bad spec, bad options, bad schema). Names the spec."""


class Tool:
    """Base of every tool. Subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema of type
    ``object`` describing the ``arguments`` dict), take their options as keyword arguments of ``__init__``, and
    implement ``__call__(arguments, context)``.

    ``__call__`` may be a plain method (run in the runner's thread pool) or ``async def`` (run on the runner's event
    loop; it must not block, or it stalls every other async call). It returns a ToolResult, a str, a PIL image, or
    a list mixing str and PIL images (see :func:`as_result`). It receives arguments already validated against
    ``parameters``. A failure the model caused (a box outside the image) is best answered as
    ``ToolResult(error="bad_arguments", text=...)``; an exception is reported as ``tool_raised`` and logged.
    """

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    max_concurrency: int | None = None
    """At most this many calls of the tool run at once (the runner queues the rest, uncharged, as it queues calls
    behind busy workers): a bound for a backend that takes only so many requests. None: no bound of its own. The
    config entry's ``max_concurrency`` overrides it."""

    def __call__(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement __call__(arguments, context)")

    def schema(self) -> dict[str, Any]:
        """The function schema chat templates take in ``tools=`` (a copy: templates may not edit the tool)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def is_async_tool(tool: Any) -> bool:
    """True when ``tool.__call__`` is ``async def`` (the runner awaits it on its event loop)."""
    return inspect.iscoroutinefunction(tool.__call__)


def check_tool(tool: Tool, spec: str) -> Tool:
    """Refuse a tool whose name, description or parameter schema a chat template or the validator cannot use.

    Checked once when the tool is built, so a broken schema fails the run's start, not its 40th step."""
    if not isinstance(tool, Tool):
        raise ToolSpecError(f"tool {spec!r} is a {type(tool).__name__}, not a mmrlhf.agents.tools.Tool")
    if not isinstance(tool.name, str) or not _NAME.match(tool.name):
        raise ToolSpecError(f"tool {spec!r}: name {tool.name!r} must be 1-64 letters, digits, '_' or '-', "
                            "starting with a letter or '_'")
    if not isinstance(tool.description, str):
        raise ToolSpecError(f"tool {spec!r}: description must be a str, got {type(tool.description).__name__}")
    params = tool.parameters
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ToolSpecError(f"tool {spec!r}: parameters must be a JSON schema dict with \"type\": \"object\", "
                            f"got {params!r}")
    try:
        jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
    except jsonschema.SchemaError as exc:
        raise ToolSpecError(f"tool {spec!r}: parameters is not a valid JSON schema: {exc.message}") from exc
    if not callable(getattr(tool, "__call__", None)):
        raise ToolSpecError(f"tool {spec!r} has no __call__(arguments, context)")
    bound = tool.max_concurrency
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
        raise ToolSpecError(f"tool {spec!r}: max_concurrency must be a positive int or None, got {bound!r}")
    return tool


def _short(text: str, limit: int = _MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_arguments(tool: Tool, arguments: Any) -> str | None:
    """The reason ``arguments`` fail ``tool.parameters`` (one short sentence naming the offending key), None when
    they pass. Booleans are not numbers here (JSON schema's rule); ``1.0`` passes as an integer (also its rule),
    so tools convert integer arguments with ``int()``."""
    schema = tool.parameters
    validator_cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    return _short(f"{where}: {error.message}" if where else error.message)


def _check_image(value: Any, tool_name: str) -> Any:
    if not isinstance(value, Image.Image):
        raise TypeError(f"tool {tool_name!r} returned an image list holding a {type(value).__name__}; "
                        "expected PIL images")
    return value


def as_result(value: Any, tool_name: str = "<tool>") -> ToolResult:
    """Normalise what a tool returned: a ToolResult (checked), a str (text), a PIL image, or a list / tuple mixing
    str and PIL images (the images in order, the texts joined by newlines: a tool observation renders its images
    first, then its text). Anything else raises TypeError naming the tool."""
    if isinstance(value, ToolResult):
        if not isinstance(value.text, str):
            raise TypeError(f"tool {tool_name!r} returned a ToolResult whose text is a {type(value.text).__name__}")
        if not isinstance(value.images, list):
            raise TypeError(f"tool {tool_name!r} returned a ToolResult whose images is a "
                            f"{type(value.images).__name__}, not a list")
        if value.error is not None and value.error not in ERROR_KINDS:
            raise TypeError(f"tool {tool_name!r} returned a ToolResult with error {value.error!r}; "
                            f"expected None or one of {', '.join(ERROR_KINDS)}")
        for image in value.images:
            _check_image(image, tool_name)
        return value
    if isinstance(value, str):
        return ToolResult(text=value)
    if isinstance(value, Image.Image):
        return ToolResult(images=[value])
    if isinstance(value, (list, tuple)):
        texts: list[str] = []
        images: list[Any] = []
        for item in value:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, Image.Image):
                images.append(item)
            else:
                raise TypeError(f"tool {tool_name!r} returned a list holding a {type(item).__name__}; "
                                "expected str and PIL images")
        return ToolResult(text="\n".join(texts), images=images)
    raise TypeError(f"tool {tool_name!r} returned a {type(value).__name__}; expected a ToolResult, a str, "
                    "a PIL image or a list of them")
