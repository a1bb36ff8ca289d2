"""Seconds per test file from a pytest run's durations table, into tests/durations.json (the order the suite hands
files to its workers: longest first, tests/conftest.py).

    bash scripts/test.sh --durations=0 --durations-min=0 | tee run.log
    python scripts/test_durations.py run.log

Each file's setup, call and teardown times are summed. Files the run did not time keep their old value; files that
no longer exist are dropped.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.json"
LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+?\.py)::")


def file_seconds(log: str) -> dict[str, float]:
    """Seconds per test file in a pytest log's durations table."""
    total: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return dict(total)


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
