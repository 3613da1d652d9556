"""``kvsp soak`` for about a minute, as a real command (issue 19; docs/reliability.md "Soak").

Every role is a child process of the soak (IS, PC, holder, front end, two chained relays joined by a
lossy link, four instances running the reference model); the seeded chaos schedule SIGKILLs and
restarts an instance, a relay and the holder and SIGSTOPs the holder while sessions, prefetches and
plain generations run. The report must count no token lost, repeated or wrong and no block served
with a wrong digest, and every kind of fault must have happened (the schedule cycles through them).
A long run's report is quoted in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
#: A safety net against a hang of the soak itself, never a way to wait for something.
GUARD_S = 600


def test_a_one_minute_soak_loses_repeats_and_misserves_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsp_moq", "soak", "--minutes", "1", "--seed", "7", "--chaos-every", "6", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S)
    assert proc.stdout.strip(), proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    detail = json.dumps({k: report[k] for k in ("sessions", "generations", "prefetches", "failures", "digests",
                                                "fallbacks", "chaos")}, indent=1)
    assert report["tokens_lost"] == 0, detail
    assert report["tokens_repeated"] == 0, detail
    assert report["tokens_wrong"] == 0, detail
    assert report["blocks_wrong_digest"] == 0, detail
    assert report["chaos_kinds"] == ["kill-holder", "kill-instance", "kill-relay", "stall-holder"], detail
    assert report["sessions"]["finished"] > 0 and report["tokens_delivered"] > 0, detail
    assert report["digests"]["verified"] > 0, detail  # the check read real replicas
    assert all(v["start"] and v["end"] for v in report["rss_mib"].values()), report["rss_mib"]
    link = report["lossy_link"]  # MOQT crossed the lossy link both ways (drops are counted, few in a minute)
    assert link["a_to_b"]["forwarded"] > 0 and link["b_to_a"]["forwarded"] > 0, link
    assert report["ok"] is True and proc.returncode == 0, detail
