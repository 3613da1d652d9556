"""TAP version 14 output for the interop test client (moq-interop-runner contract)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class CaseResult:
    name: str
    passed: bool
    message: str = ""
    duration_ms: float = 0.0
    skipped: str = ""  # a SKIP reason (counts as passed)
    details: dict[str, str] = field(default_factory=dict)  # expected / received / ...


def _yaml(value: object) -> str:
    return json.dumps(str(value), ensure_ascii=False)  # JSON strings are YAML scalars


def render(results: Sequence[CaseResult], *, header: Sequence[str] = ()) -> str:
    """The TAP document: version line, comments, plan, one test point + YAML block each."""
    lines = ["TAP version 14", *(f"# {h}" for h in header), f"1..{len(results)}"]
    for i, r in enumerate(results, 1):
        skip = f" # SKIP {r.skipped}" if r.skipped else ""
        lines.append(f"{'ok' if r.passed else 'not ok'} {i} - {r.name}{skip}")
        lines.append("  ---")
        lines.append(f"  duration_ms: {round(r.duration_ms)}")
        if r.message:
            lines.append(f"  message: {_yaml(r.message)}")
        for key, value in r.details.items():
            lines.append(f"  {key}: {_yaml(value)}")
        lines.append("  ...")
    return "\n".join(lines)


def parse(text: str) -> dict[str, bool]:
    """{test name: passed} from a TAP document (ours or aiomoqt's)."""
    out: dict[str, bool] = {}
    for line in text.splitlines():
        for prefix, ok in (("ok ", True), ("not ok ", False)):
            if line.startswith(prefix):
                rest = line[len(prefix):]
                _, _, name = rest.partition(" - ")
                name = name.split(" # ")[0].strip()
                if name:
                    out[name] = ok
                break
    return out
