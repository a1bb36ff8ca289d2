"""Fixtures for the reward tests (helpers live in reward_testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from reward_testing import plugin, serve


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text("s3cret-token\n")
    return path


@pytest.fixture(scope="module")
def echo_server(token_file):
    """A token-protected server scoring each response as the number it spells."""
    server = serve("--reward", plugin("echo_number"), "--token-file", str(token_file), "--max-body-mb", "1")
    yield server
    server.stop()
