"""Building tools from config: registered names, module / file plug-ins (class, instance, factory), options, and
clear errors for every bad spec; argument validation; normalising what tools return."""

from __future__ import annotations

import textwrap

import pytest
from PIL import Image

from mmrlhf.agents.builtin_tools import ImageZoom
from mmrlhf.agents.tools import (
    TOOLS, Tool, ToolSpecError, as_result, build_tool, build_tools, is_async_tool, tool_schemas, validate_arguments,
)
from mmrlhf.agents.types import ToolResult
from mmrlhf.config.agent import ToolEntry
from mmrlhf.registry import RegistryError

PLUGIN = textwrap.dedent('''
    from mmrlhf.agents.tools import Tool

    class Echo(Tool):
        name = "echo"
        description = "Repeat the text."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

        def __init__(self, prefix=""):
            self.prefix = prefix

        def __call__(self, arguments, context):
            return self.prefix + arguments["text"]

    class AsyncEcho(Echo):
        name = "async_echo"

        async def __call__(self, arguments, context):
            return arguments["text"]

    def make_echo(prefix="made: "):
        return Echo(prefix)

    READY = Echo("ready: ")

    def make_nothing():
        return 42

    class NotATool:
        pass

    class BadSchema(Tool):
        name = "bad_schema"
        parameters = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}

    class ArraySchema(Tool):
        name = "array_schema"
        parameters = {"type": "array"}

    class BadName(Tool):
        name = "has spaces"

    class Refuses(Tool):
        name = "refuses"

        def __init__(self, size=1):
            if size < 1:
                raise ValueError("size must be >= 1")

    NUMBER = 7
''')


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(PLUGIN)
    return path


def test_builtins_are_registered():
    assert set(TOOLS) == {"image_zoom", "image_crop", "image_rotate", "calculator"}
    for name in TOOLS:
        tool = build_tool(name)
        assert tool.name == name and isinstance(tool, Tool)


def test_registered_name_with_options_in_every_entry_form():
    for entry in ({"tool": "image_zoom", "options": {"min_side": 56}},
                  ToolEntry(tool="image_zoom", options={"min_side": 56})):
        tool = build_tool(entry)
        assert isinstance(tool, ImageZoom) and tool.min_side == 56
    assert build_tool("mmrlhf.agents.builtin_tools:ImageZoom").name == "image_zoom"


def test_file_plugins_class_instance_and_factory(plugin_file):
    echo = build_tool({"tool": f"{plugin_file}:Echo", "options": {"prefix": "> "}})
    assert echo({"text": "hi"}, None) == "> hi"
    assert not is_async_tool(echo)
    assert build_tool(f"{plugin_file}:READY")({"text": "x"}, None) == "ready: x"
    assert build_tool(f"{plugin_file}:make_echo")({"text": "x"}, None) == "made: x"
    assert is_async_tool(build_tool(f"{plugin_file}:AsyncEcho"))


@pytest.mark.parametrize("spec, options, error, match", [
    ("image_zom", {}, RegistryError, "unknown tool 'image_zom'.*did you mean 'image_zoom'"),
    ("{file}:Missing", {}, RegistryError, "has no attribute 'Missing'"),
    ("/no/such/file.py:Echo", {}, RegistryError, "file not found"),
    ("no_such_module_xyz:Echo", {}, RegistryError, "cannot import module"),
    ("{file}:NotATool", {}, ToolSpecError, "class NotATool, which is not a subclass"),
    ("{file}:make_nothing", {}, ToolSpecError, "factory returned a int"),
    ("{file}:NUMBER", {}, ToolSpecError, "resolved to a int"),
    ("{file}:READY", {"prefix": "x"}, ToolSpecError, "ready Tool instance and takes no options"),
    ("{file}:Echo", {"colour": "red"}, ToolSpecError, r"options \['colour'\] do not fit"),
    ("{file}:Refuses", {"size": 0}, ToolSpecError, "'.*:Refuses': size must be >= 1"),
    ("{file}:BadSchema", {}, ToolSpecError, "not a valid JSON schema"),
    ("{file}:ArraySchema", {}, ToolSpecError, "\"type\": \"object\""),
    ("{file}:BadName", {}, ToolSpecError, "name 'has spaces' must be"),
    ("image_zoom", {"min_side": -1}, ToolSpecError, "'image_zoom': min_side must be a positive int"),
])
def test_bad_specs_fail_naming_the_spec(plugin_file, spec, options, error, match):
    spec = spec.format(file=plugin_file)
    with pytest.raises(error, match=match) as info:
        build_tool({"tool": spec, "options": options})
    assert spec.split(":")[-1] in str(info.value) or spec in str(info.value)


def test_bad_entries():
    with pytest.raises(ToolSpecError, match="is not {tool"):
        build_tool({"name": "image_zoom"})
    with pytest.raises(ToolSpecError, match="a name or {tool, options}"):
        build_tool(3)  # type: ignore[arg-type]


def test_build_tools_keeps_order_and_refuses_duplicates(plugin_file):
    tools = build_tools(["calculator", {"tool": "image_zoom"}, f"{plugin_file}:Echo"])
    assert list(tools) == ["calculator", "image_zoom", "echo"]
    assert [s["function"]["name"] for s in tool_schemas(tools)] == ["calculator", "image_zoom", "echo"]
    with pytest.raises(ToolSpecError, match="two configured tools are named 'echo'"):
        build_tools([f"{plugin_file}:Echo", f"{plugin_file}:make_echo"])


def test_schema_is_the_chat_template_function_form_and_a_copy():
    tool = build_tool("calculator")
    schema = tool.schema()
    assert schema["type"] == "function"
    assert set(schema["function"]) == {"name", "description", "parameters"}
    assert schema["function"]["parameters"]["required"] == ["expression"]
    schema["function"]["parameters"]["required"].append("oops")
    assert tool.parameters["required"] == ["expression"]


def test_validate_arguments_messages():
    tool = build_tool("image_rotate")
    assert validate_arguments(tool, {"angle": 90}) is None
    assert validate_arguments(tool, {"angle": 90.0}) is None  # JSON schema: 90.0 is an integer
    assert "'angle' is a required property" in validate_arguments(tool, {})
    assert validate_arguments(tool, {"angle": True}).startswith("angle:")  # a boolean is not a number
    assert "image_index" in validate_arguments(tool, {"angle": 90, "image_index": "0"})
    assert "Additional properties" in validate_arguments(tool, {"angle": 90, "scale": 2})
    assert len(validate_arguments(build_tool("calculator"), {"expression": "1" * 10_000})) <= 300


def test_as_result_normalises_and_names_the_tool_on_wrong_types():
    red = Image.new("RGB", (4, 4), "red")
    assert as_result("text") == ToolResult(text="text")
    assert as_result(red).images == [red]
    mixed = as_result(["a", red, "b", red])
    assert mixed.text == "a\nb" and mixed.images == [red, red]
    given = ToolResult(text="x", images=[red], error="bad_arguments")
    assert as_result(given) is given
    for bad, match in [(None, "returned a NoneType"), (3, "returned a int"), (["a", 3], "list holding a int"),
                       (ToolResult(images=["not an image"]), "holding a str"),
                       (ToolResult(error="whatever"), "error 'whatever'")]:
        with pytest.raises(TypeError, match=match) as info:
            as_result(bad, "my_tool")
        assert "'my_tool'" in str(info.value)
