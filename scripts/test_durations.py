"""Seconds per test file from a pytest run's durations table, into tests/durations.json (the order the suite hands
files to its workers: longest first, tests/conftest.py).

    bash scripts/test.sh --durations=0 --durations-min=0 | tee run.log
    python scripts/test_durations.py run.log

Each file's setup, call and teardown times are summed. Files the run did not time keep their old value; files that
no longer exist are dropped. The table of a plain run (its 25 slowest tests) is enough to place the long files:
the suite counts a file the table does not list as short.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mmrlhf.testing.suite_order import file_seconds  # noqa: E402

TABLE = ROOT / "tests" / "durations.json"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    measured = file_seconds(Path(argv[0]).read_text(errors="replace"))
    if not measured:
        print(f"error: no durations table in {argv[0]} (run pytest with --durations=0 --durations-min=0)",
              file=sys.stderr)
        return 1
    old = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    table = {f: round(s, 1) for f, s in {**old, **measured}.items() if (ROOT / f).is_file()}
    TABLE.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    print(f"{len(measured)} files timed, {sum(measured.values()) / 60:.1f} min in all; the longest:")
    for f, s in sorted(measured.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {s:8.1f} s  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
