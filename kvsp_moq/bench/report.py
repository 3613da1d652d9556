"""Figures of a benchmark run: one JSON line each on stdout, a table on stderr.

Each figure has ``name``, ``unit``, ``value``, ``baseline_name``, ``baseline_value`` and
``ratio`` = value / baseline_value, both measured in the same run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, TextIO


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    value: float
    baseline_name: str
    baseline_value: float
    ratio: float = field(init=False)
    params: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ratio = self.value / self.baseline_value if self.baseline_value else float("nan")
        object.__setattr__(self, "ratio", float(f"{ratio:.6g}"))

    def json_line(self) -> str:
        doc = asdict(self)
        for key in ("value", "baseline_value"):
            doc[key] = float(f"{doc[key]:.6g}")
        if not self.params:
            del doc["params"]
        return json.dumps(doc, separators=(",", ":"))


def best_seconds(run: Callable[[], object], repeat: int, *, warmup: int = 1) -> float:
    """The shortest wall time of ``repeat`` runs after ``warmup`` untimed ones: the least
    disturbed measurement on a shared machine."""
    for _ in range(warmup):
        run()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def emit(figures: list[Figure], out: TextIO = sys.stdout, table: TextIO = sys.stderr) -> None:
    """Print each figure as a JSON line on ``out`` and all of them as a table on ``table``."""
    for fig in figures:
        print(fig.json_line(), file=out, flush=True)
    rows = [("figure", "value", "baseline", "baseline value", "ratio")]
    rows += [(f.name, f"{f.value:.4g} {f.unit}", f.baseline_name, f"{f.baseline_value:.4g} {f.unit}",
              f"{f.ratio:.3f}") for f in figures]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=table)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=table)
    table.flush()
