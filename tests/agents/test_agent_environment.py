"""Loading environments from a spec (one object per trajectory) and the example guessing game."""

from __future__ import annotations

import textwrap

import pytest

from mmrlhf.agents.environment import Environment, EnvironmentSpecError, close_environment, load_environment
from mmrlhf.agents.example_env import GuessNumber
from mmrlhf.registry import RegistryError

SPEC = "mmrlhf.agents.example_env:GuessNumber"

PLUGIN = textwrap.dedent('''
    from mmrlhf.agents.types import StepResult, ToolResult

    class Echo:
        closed = 0

        def __init__(self, suffix="!"):
            self.suffix = suffix

        def reset(self, record):
            return None

        def step(self, action_text):
            return StepResult(ToolResult(text=action_text + self.suffix), done=True)

        def close(self):
            Echo.closed += 1

    def make_echo(suffix="?"):
        return Echo(suffix)

    def make_nothing():
        return object()

    class NoStep:
        def reset(self, record):
            return None

    INSTANCE = Echo()
    NUMBER = 3
''')


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(PLUGIN)
    return path


def play(env: GuessNumber, record: dict) -> tuple[int, list[str]]:
    """Binary search through the game; the number of guesses and the observations."""
    env.reset(record)
    low, high, seen = env.low, env.high, []
    while True:
        guess = (low + high) // 2
        result = env.step(f"I think <guess>{low}</guess> no wait <guess>{guess}</guess>")  # the last one counts
        seen.append(result.observation.text)
        if result.done:
            return result.info["guesses"], seen
        low, high = (guess + 1, high) if "higher" in result.observation.text else (low, guess - 1)


def test_factory_makes_a_fresh_environment_each_time():
    make = load_environment(SPEC, {"low": 1, "high": 100, "max_guesses": 7})
    first, second = make(), make()
    assert first is not second and isinstance(first, Environment) and isinstance(first, GuessNumber)
    assert first.max_guesses == 7


def test_binary_search_solves_the_game_and_info_says_so():
    env = load_environment(SPEC, {"low": 1, "high": 100, "max_guesses": 7})()
    guesses, seen = play(env, {"target": 73})
    assert guesses <= 7 and seen[-1] == "Correct: the number is 73."
    assert env.step  # still usable
    assert seen[0] == "50 is too low: guess higher. 6 guesses left."


def test_secret_is_deterministic_per_record_and_varies_across_records():
    env = GuessNumber(low=1, high=1000)
    secrets = [env.secret_for({"id": f"sample-{i}"}) for i in range(20)]
    assert secrets == [GuessNumber(low=1, high=1000).secret_for({"id": f"sample-{i}"}) for i in range(20)]
    assert len(set(secrets)) > 10 and all(1 <= s <= 1000 for s in secrets)
    assert env.secret_for({"id": 5, "target": 42}) == 42


def test_running_out_of_guesses_and_missing_guess_tags():
    env = GuessNumber(low=1, high=10, max_guesses=2)
    env.reset({"target": 5})
    first = env.step("no tag here, 5")
    assert not first.done and first.observation.text == "Write your guess as <guess>N</guess>. 1 guess left."
    last = env.step("<guess>9</guess>")
    assert last.done and last.info == {"target": 5, "guesses": 2, "solved": False}
    assert "too high" in last.observation.text and "No guesses left" in last.observation.text


def test_example_env_refuses_misuse():
    with pytest.raises(RuntimeError, match="before reset"):
        GuessNumber().step("<guess>1</guess>")
    with pytest.raises(ValueError, match="low < high"):
        GuessNumber(low=5, high=5)
    with pytest.raises(ValueError, match="outside"):
        GuessNumber(low=1, high=10).reset({"target": 11})


def test_file_plugins_class_and_factory(plugin_file):
    env = load_environment(f"{plugin_file}:Echo", {"suffix": "."})()
    assert env.step("hi").observation.text == "hi."
    close_environment(env)
    assert type(env).closed == 1
    assert load_environment(f"{plugin_file}:make_echo", None)().step("hi").observation.text == "hi?"
    close_environment(GuessNumber())  # no close(): nothing to do


@pytest.mark.parametrize("spec, options, error, match", [
    ("GuessNumber", {}, EnvironmentSpecError, "must be 'package.module:Name'"),
    ("no_such_module_xyz:Env", {}, RegistryError, "cannot import module"),
    ("{file}:Missing", {}, RegistryError, "has no attribute"),
    ("{file}:NUMBER", {}, EnvironmentSpecError, "resolved to a int"),
    ("{file}:INSTANCE", {}, EnvironmentSpecError, "is an instance"),
    ("{file}:NoStep", {}, EnvironmentSpecError, "class NoStep has no step method"),
    ("{file}:Echo", {"colour": 1}, EnvironmentSpecError, r"options \['colour'\] do not fit"),
    (SPEC, {"lo": 1}, EnvironmentSpecError, r"options \['lo'\] do not fit"),
])
def test_bad_specs_fail_clearly(plugin_file, spec, options, error, match):
    spec = spec.format(file=plugin_file)
    with pytest.raises(error, match=match) as info:
        load_environment(spec, options)
    assert spec in str(info.value)


def test_a_factory_returning_no_environment_fails_when_called(plugin_file):
    make = load_environment(f"{plugin_file}:make_nothing", {})
    with pytest.raises(EnvironmentSpecError, match="made a object without reset.. / step.."):
        make()
