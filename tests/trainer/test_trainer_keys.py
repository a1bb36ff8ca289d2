"""No key that parses but does nothing: every ``trainer.*`` and ``algorithm.*`` key is read by the code that builds
or runs the trainer (behaviour is tested elsewhere; this guards against a key silently falling out of use)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmrlhf.config.algorithm import AlgorithmConfig
from mmrlhf.config.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[2] / "mmrlhf"
READERS = {
    "trainer": ["trainer/builder.py"],
    "algorithm": ["trainer/builder.py", "experience/settings.py", "experience/builder.py"],
}


def _source(section: str) -> str:
    return "\n".join((ROOT / f).read_text() for f in READERS[section])


@pytest.mark.parametrize("section,model", [("trainer", TrainerConfig), ("algorithm", AlgorithmConfig)])
def test_every_key_is_read(section, model):
    text = _source(section)
    unread = [name for name in model.model_fields if not re.search(rf"\.{name}\b", text)]
    assert not unread, f"{section} keys validated but never read: {unread}"


def test_the_check_can_fail():
    assert not re.search(r"\.no_such_key\b", _source("trainer"))
