"""The suite's schedule (tests/conftest.py, scripts/test.sh): the agent toy's learning file first, then the files by
their number of tests."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def conftest(request):
    """The suite's root conftest as pytest loaded it (a plain ``import conftest`` may find a sub-folder's)."""
    path = ROOT / "tests" / "conftest.py"
    return next(m for m in request.config.pluginmanager.get_plugins()
                if getattr(m, "__file__", None) and Path(m.__file__).resolve() == path)


def test_every_first_file_exists(conftest):
    # A renamed or removed file would silently fall back to its test count and end the suite on a learning run.
    missing = [path for path in conftest.FIRST if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py FIRST names files that do not exist: {missing}"


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_first_files_lead_then_files_by_test_count_and_every_file_keeps_its_order(conftest):
    first = conftest.FIRST[0]
    ids = ["tests/a.py::t1", "tests/b.py::t1", "tests/b.py::t2", f"{first}::x", "tests/c.py::t1",
           "tests/a.py::t2", "tests/b.py::t3", "tests/c.py::t2"]
    got = [item.nodeid for item in conftest.schedule([_Item(i) for i in ids])]
    assert got == [f"{first}::x", "tests/b.py::t1", "tests/b.py::t2", "tests/b.py::t3",
                   "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t1", "tests/c.py::t2"]


def test_the_suite_command_keeps_collection_order_across_workers():
    # xdist's default re-sorts files by test count (a learning file has few tests: it would be dealt last).
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script
