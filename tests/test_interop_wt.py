"""The interop matrix over WebTransport (``python -m interop.matrix --transport
webtransport``): aiomoqt's moq-interop-client against our relay with an ``https://`` URL, our
test client against aiomoqt's relay in its WebTransport mode (loopback-only network namespace),
our client against our relay, and the moq-rs publishers and subscribers through our relay with
``https://`` URLs (every relay session checked to be a WebTransport one). Every WebTransport
cell must pass where its raw-QUIC twin passes in ``interop/matrix-baseline.json`` (issue 20:
the same cases over both transports), and match its own baseline. See docs/interop.md,
"WebTransport".
"""

from __future__ import annotations

import pytest

from interop import peers
from interop.matrix import QUIC_COLUMNS, RELAY_COLUMN, WT, load_baseline
from interop.testing import peer_bin, run_matrix

pytestmark = pytest.mark.interop

LIMIT = 300.0  # seconds for the three drafts (≈ 90 s observed on 2 busy cores)
DRAFTS = (22, 20, 18)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    peer_bin(peers.AIOMOQT)  # installs them, or skips loudly
    peer_bin(peers.MOQ_RS)
    out = tmp_path_factory.mktemp("matrix-wt") / "matrix.json"
    result, output, _ = run_matrix(["--drafts", ",".join(map(str, DRAFTS)), "--transport",
                                    "webtransport"], out, LIMIT)
    result["_output"] = output
    return result


@pytest.mark.parametrize("draft", DRAFTS)
def test_webtransport_cells_pass_where_raw_quic_passes(observed: dict, draft: int) -> None:
    assert observed["regressions"] == [], "\n".join(observed["regressions"])
    cells = observed["cells"][str(draft)]
    baseline = load_baseline()[str(draft)]
    columns = [c for c in QUIC_COLUMNS if c != "ours>aiomoqt" or peers.can_isolate()]
    columns.append(RELAY_COLUMN)
    for column in columns:
        wt = cells.get(column + WT)
        assert wt is not None, f"column {column + WT} missing: {sorted(cells)}"
        quic = baseline[column]
        # moq-rs cells only: caprid-relay has no WebTransport (interop.relay_cases)
        twins = {case: cell for case, cell in quic.items() if case in wt}
        assert twins, column
        failing = {case: wt[case].get("message", "") for case, cell in twins.items()
                   if cell["result"] == "pass" and wt[case]["result"] != "pass"}
        assert failing == {}, f"{column + WT}: {failing}\n{observed['_output']}"
