"""``mmrlhf serve-reward`` argument handling (the serving itself is exercised in test_reward_remote.py)."""

from __future__ import annotations

import argparse

import pytest

from mmrlhf.cli import serve_reward


def parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    serve_reward.register(sub)
    return parser.parse_args(["serve-reward", *argv])


def test_defaults_bind_loopback_and_dispatch_to_run():
    args = parse(["--reward", "format"])
    assert args.host == "127.0.0.1" and args.func is serve_reward.run and args.token_file == ""


def test_reward_and_reward_model_are_mutually_exclusive_and_one_is_required():
    with pytest.raises(SystemExit):
        parse([])
    with pytest.raises(SystemExit):
        parse(["--reward", "format", "--reward-model", "qwen_vl_scalar"])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--reward", "format", "--host", "0.0.0.0"], "refusing to serve on non-loopback address 0.0.0.0"),
        (["--reward", "format", "--options", "[1]"], "--options must be a JSON object"),
        (["--reward", "no_such_reward"], "unknown reward function 'no_such_reward'"),
        (["--reward", "format", "--token-file", "/nonexistent/token"], "cannot read token file"),
        (["--reward", "format", "--threads", "0"], "--threads must be >= 1"),
        (["--reward", "format", "--max-concurrent", "0"], "--max-concurrent must be >= 1"),
        (["--reward", "format", "--request-timeout-s", "0"], "--request-timeout-s must be > 0"),
    ],
)
def test_bad_invocations_exit_2_with_a_message(argv, words, capsys):
    assert serve_reward.run(parse(argv)) == 2
    assert words in capsys.readouterr().err


def test_empty_token_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "t"
    empty.write_text("\n")
    assert serve_reward.run(parse(["--reward", "format", "--token-file", str(empty)])) == 2
    assert "is empty" in capsys.readouterr().err
