"""The interop matrix (``python -m interop.matrix``) per draft: aiomoqt's moq-interop-client
against our relay, our test client against aiomoqt's relay (loopback-only network namespace)
and against our relay. Every cell must match ``interop/matrix-baseline.json``: a cell that
passed there and fails now is a regression; cells recorded as failing carry the known gap of
our stack that causes them (docs/interop.md). See docs/interop.md for the table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from interop import peers
from interop.harness import ROOT, kill_group
from interop.matrix import load_baseline
from interop.testing import peer_bin

pytestmark = pytest.mark.interop

LIMIT = 150.0  # seconds for one draft's matrix (≈ 25 s observed)


@pytest.mark.parametrize("draft", [22, 20, 18])
def test_matrix_no_regression(tmp_path: Path, draft: int) -> None:
    peer_bin(peers.AIOMOQT)  # installs it, or skips loudly
    out = tmp_path / "matrix.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "interop.matrix", "--drafts", str(draft),
                             "--json", str(out)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"matrix for draft {draft} did not finish within {LIMIT:.0f} s\n{output[-4000:]}")
    finally:
        kill_group(proc.pid, signal.SIGKILL)
    assert out.exists(), output[-4000:]
    result = json.loads(out.read_text())
    assert result["regressions"] == [], "\n".join(result["regressions"]) + "\n" + output[-4000:]
    assert proc.returncode == 0, output[-4000:]
    baseline = load_baseline()[str(draft)]
    observed = result["cells"][str(draft)]
    expected_columns = {"aiomoqt>ours", "ours>ours"} | ({"ours>aiomoqt"} if peers.can_isolate() else set())
    assert expected_columns <= set(observed), f"columns missing: {sorted(observed)}"
    for column, cases in observed.items():
        assert set(cases) == set(baseline[column]), f"{column}: cases differ from the baseline"
