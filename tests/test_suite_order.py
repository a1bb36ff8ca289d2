"""The suite's schedule: the slowest files start first (tests/conftest.py, scripts/test.sh)."""

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


def test_every_heavy_file_exists(conftest):
    # A renamed or removed file would silently fall back to collection order and end the suite on a learning run.
    missing = [path for path in conftest.HEAVY_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py HEAVY_FIRST names files that do not exist: {missing}"
    assert len(set(conftest.HEAVY_FIRST)) == len(conftest.HEAVY_FIRST)


class _Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_heavy_files_move_to_the_front_in_their_rank_and_the_rest_keep_their_order(conftest):
    heavy = conftest.HEAVY_FIRST
    ids = [
        "tests/a/test_x.py::test_1",
        f"{heavy[1]}::test_b",
        "tests/test_y.py::test_2",
        f"{heavy[0]}::test_a1",
        "tests/a/test_x.py::test_3",
        f"{heavy[0]}::test_a2[p]",
    ]
    got = [item.nodeid for item in conftest.heavy_first([_Item(i) for i in ids])]
    assert got == [
        f"{heavy[0]}::test_a1",
        f"{heavy[0]}::test_a2[p]",
        f"{heavy[1]}::test_b",
        "tests/a/test_x.py::test_1",
        "tests/test_y.py::test_2",
        "tests/a/test_x.py::test_3",
    ]


def test_the_suite_command_keeps_collection_order_across_workers():
    # xdist's default re-sorts files by test count (a learning file has few tests: it would be dealt last).
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script
