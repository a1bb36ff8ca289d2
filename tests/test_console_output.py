"""What the main jobs print, read as a user reads it: in a terminal (a pseudo-terminal here, so the progress bar is
the real tqdm bar), through the commands the README and the docs give.

A run that prints one library warning per call drowns its progress bar (a 200-step toy run once printed 3,840
identical lines), and nothing else in the suite looks at the terminal. Each job's first steps must print no visible
line twice and no warning at all: from our code, a library's logger, Python's warnings or compiled code. A new
warning from an upgraded library then fails here, where someone decides whether a user must act on it
(``mmrlhf/rollout/vllm_quiet.py`` lists what is dropped and why)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from collections import Counter
from pathlib import Path

import pytest

from mmrlhf.testing.tiny_models import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# The environment a user's shell would give: as it was when the suite was collected, before any test's in-process
# engine added its own variables (vLLM sets VLLM_DIST_IDENT, which a new process's vLLM then warns about).
USER_ENV = dict(os.environ)



def run_in_terminal(argv: list[str], *, timeout: float = 600) -> tuple[int, str]:
    """``argv`` with stdout and stderr on a pseudo-terminal of 160 columns; (exit code, everything printed)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {**USER_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), USER_ENV.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child, cwd=ROOT, env=env,
                            close_fds=True)
    os.close(child)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{argv[:3]} did not finish in {timeout} s:\n" + b"".join(chunks).decode()[-3000:])
            try:
                data = os.read(main, 65536)
            except OSError:  # the terminal's last writer closed it (Linux answers EIO)
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(main)
    return proc.wait(timeout=60), b"".join(chunks).decode("utf-8", "replace")


def visible_lines(text: str) -> list[str]:
    """The lines a terminal keeps: each line's last carriage-return segment, colours stripped, blanks left out."""
    out = []
    for line in ANSI.sub("", text).replace("\r\n", "\n").split("\n"):
        segments = [s for s in line.split("\r") if s.strip()]
        if segments:
            out.append(segments[-1].rstrip())
    return out


def check_clean(code: int, text: str, *, steps: int) -> list[str]:
    lines = visible_lines(text)
    assert code == 0, "\n".join(lines[-40:])
    repeated = {line: n for line, n in Counter(lines).items() if n > 1}
    assert not repeated, f"lines printed more than once: {repeated}"
    warned = [line for line in lines if re.search(r"warn", line, re.IGNORECASE)]
    assert not warned, f"warnings in the main job's output: {warned}"
    assert any(f"{steps}/{steps}" in line and "reward=" in line for line in lines), lines  # the bar, at its end
    assert any(line.startswith(f"done: step {steps}") for line in lines), lines
    return lines


def _short(out: Path, steps: int) -> list[str]:
    return [f"trainer.output_dir={out}", f"trainer.max_steps={steps}", "trainer.eval_steps=2", "trainer.save_steps=2",
            "trainer.report_steps=2", "trainer.overwrite_output_dir=true"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_the_quick_start_prints_each_line_once_and_no_warning(tmp_path, family):
    """The README's first command (``scripts/demo.sh``), shortened to 4 steps with an evaluation, a report and a
    checkpoint inside; and the same recipe on the tiny Qwen3.5 the recipe's header names."""
    extra = [] if family == "qwen2_vl" else [f"model.pretrain={tiny_model_dir(family)}"]
    code, text = run_in_terminal(["bash", "scripts/demo.sh", *_short(tmp_path / "run", 4), *extra])
    check_clean(code, text, steps=4)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_agent_toy_prints_each_line_once_and_no_warning(tmp_path):
    """The agent quick start of docs/agents.md (``mmrlhf train examples/agent_zoom_toy_cpu.yaml``), 3 steps."""
    model = tiny_model_dir("qwen2_vl", tools=True)
    code, text = run_in_terminal([sys.executable, "-m", "mmrlhf.cli", "train", "examples/agent_zoom_toy_cpu.yaml",
                                  f"model.pretrain={model}", *_short(tmp_path / "run", 3)])
    check_clean(code, text, steps=3)


def test_the_check_catches_a_repeated_warning():
    """The control: the output of the toy run before its template variables were filtered (one transformers
    warning per prompt) fails both checks."""
    noisy = "\n".join(["Kwargs passed to `processor.__call__` have to be in `processor_kwargs` dict"] * 3
                      + ["train: 100%|####| 4/4 [00:01<00:00, reward=0.1]", "done: step 4, reward 0.1"])
    with pytest.raises(AssertionError, match="more than once"):
        check_clean(0, noisy, steps=4)
    with pytest.raises(AssertionError, match="warnings"):
        check_clean(0, "WARNING mmrlhf.data.prompts: something\ntrain: 4/4 reward=0.1\ndone: step 4", steps=4)
    bar = "train:  50%|##  | 2/4 [reward=0.1]\rtrain: 100%|####| 4/4 [reward=0.2]\r\ndone: step 4, reward 0.2\n"
    assert check_clean(0, bar, steps=4) == ["train: 100%|####| 4/4 [reward=0.2]", "done: step 4, reward 0.2"]
