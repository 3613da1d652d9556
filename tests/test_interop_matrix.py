"""The interop matrix (``python -m interop.matrix``) per draft: aiomoqt's moq-interop-client
against our relay, our test client against aiomoqt's relay (loopback-only network namespace)
and against our relay. Every cell must match ``interop/matrix-baseline.json``: a cell that
passed there and fails now is a regression; cells recorded as failing carry the known gap of
our stack that causes them (docs/interop.md). See docs/interop.md for the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from interop import peers
from interop.matrix import load_baseline
from interop.testing import peer_bin, run_matrix
from kvsp_moq.transport.config import BACKENDS

pytestmark = pytest.mark.interop

LIMIT = 150.0  # seconds for one draft's matrix (≈ 25 s observed)


@pytest.mark.parametrize("draft", [22, 20, 18])
def test_matrix_no_regression(tmp_path: Path, draft: int) -> None:
    peer_bin(peers.AIOMOQT)  # installs it, or skips loudly
    result, output, rc = run_matrix(["--drafts", str(draft)], tmp_path / "matrix.json", LIMIT)
    assert result["regressions"] == [], "\n".join(result["regressions"]) + "\n" + output
    assert rc == 0, output
    baseline = load_baseline()[str(draft)]
    observed = result["cells"][str(draft)]
    expected_columns = {"aiomoqt>ours", "ours>ours"} | ({"ours>aiomoqt"} if peers.can_isolate() else set())
    assert expected_columns <= set(observed), f"columns missing: {sorted(observed)}"
    for column, cases in observed.items():
        assert set(cases) == set(baseline[column]), f"{column}: cases differ from the baseline"


@pytest.mark.skipif("native" not in BACKENDS,
                    reason="the native backend is not built here (docs/transport.md, 'native')")
def test_matrix_on_native_no_regression(tmp_path: Path) -> None:
    """Draft 22 with every process of ours on the native backend (``--backend native``): our
    relay (native server) under aiomoqt's client and the moq-rs / caprid peers, our test client
    (native client) against aiomoqt's relay and ours — both directions against each peer's own
    QUIC stack, held to the same baseline as the default backend (issue 28)."""
    peer_bin(peers.AIOMOQT)
    result, output, rc = run_matrix(["--drafts", "22", "--backend", "native"],
                                    tmp_path / "matrix.json", LIMIT)
    assert result["backend"] == "native"
    assert result["regressions"] == [], "\n".join(result["regressions"]) + "\n" + output
    assert rc == 0, output
    observed = result["cells"]["22"]
    expected_columns = {"aiomoqt>ours", "ours>ours"} | ({"ours>aiomoqt"} if peers.can_isolate() else set())
    assert expected_columns <= set(observed), f"columns missing: {sorted(observed)}"
