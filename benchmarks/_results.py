"""The JSON a benchmark script writes with ``--json PATH`` (read by ``run_all.py``).

One small schema for every script, so the runner renders any benchmark without knowing it:

    {"benchmark": "grpo_step", "headline": "update 60% of the step", "params": {...},
     "tables": [{"title": "...", "columns": ["phase", "s / step", "share %"], "rows": [["generate", 0.24, 26.6]]}]}

``headline`` is the one-line result (a ratio or a share measured in this run) that the suite's summary shows.
Cells are numbers or strings; ``None`` renders as a dash. The scripts keep printing their own tables: the JSON is
an extra, written at the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """One table; every row must have one cell per column (a mismatch is a bug in the script, caught here)."""
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(f"table {title!r}: row {i} has {len(row)} cells for {len(columns)} columns")
    return {"title": title, "columns": list(columns), "rows": [[_cell(c) for c in row] for row in rows]}


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """``rows`` under ``columns`` as a right-aligned plain-text table (what a script prints for a human)."""
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    print(" | ".join(str(c).rjust(w) for c, w in zip(columns, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).rjust(w) for c, w in zip(row, widths)))


def write_json(path: str | Path, benchmark: str, headline: str, params: dict[str, Any],
               tables: Sequence[dict[str, Any]]) -> None:
    """Write the result file (parent folders created)."""
    out = {"benchmark": benchmark, "headline": headline, "params": params, "tables": list(tables)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def _cell(value: Any) -> Any:
    """JSON has no NaN / inf: they become None (rendered as a dash) rather than invalid JSON."""
    if hasattr(value, "item"):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
