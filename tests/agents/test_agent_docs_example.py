"""The worked example of docs/agents.md ("Writing a tool") runs as written: loaded by ``file.py:Name`` with its
options, it answers with an image, refuses a bad index as a ``bad_arguments`` observation, and its schema is what
the chat template receives."""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image

from mmrlhf.agents.calls import parse_turn
from mmrlhf.agents.tools import build_tools, tool_schemas
from mmrlhf.agents.types import ToolContext

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def test_the_documented_tool_works(tmp_path):
    text = DOC.read_text()
    section = text[text.index("## Writing a tool"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "my_tools.py"
    path.write_text(code)
    tools = build_tools([{"tool": f"{path}:Posterize", "options": {"bits": 1}}])
    assert tool_schemas(tools)[0]["function"]["name"] == "posterize"
    image = Image.linear_gradient("L").convert("RGB").resize((64, 64))
    context = ToolContext(record={}, images=[image])
    parsed = parse_turn('<tool_call>{"name": "posterize", "arguments": {"image_index": 0}}</tool_call>', tools,
                        remaining_calls=4)
    call = parsed.calls[0]
    result = tools["posterize"](call.arguments, context)
    assert result.error is None and len(result.images) == 1
    assert len(result.images[0].getcolors()) == 2  # one bit per channel: two levels of grey
    bad = tools["posterize"]({"image_index": 3}, context)
    assert bad.error == "bad_arguments"
    refused = parse_turn('<tool_call>{"name": "posterize", "arguments": {"image_index": -1}}</tool_call>', tools,
                         remaining_calls=4)
    assert [e.error for e in refused.errors] == ["bad_arguments"]  # the schema's minimum
