"""Third-party MOQT peers THROUGH OUR RELAY (``python -m relay``): moq-rs 0.5.1 and
caprid-relay 0.1.0 publishers and subscribers, per draft each supports (moq-rs 22/20/18,
caprid 22/20). Every cell checks the exact payload bytes (``interop/peer_scripts/payload.py``),
counts, PUBLISH_DONE and the version every relay session negotiated (the relay's
``session_open`` log events); :func:`interop.relay_cases.check` holds the expectations, the
matrix (``python -m interop.matrix``, column group "peer via our relay") uses the same.

caprid's publisher never announces: it waits for the relay's SUBSCRIBE_NAMESPACE (the moq-relay
ingest model); our relay solicits every downstream session allowed to publish
(relay/subscribe/solicit.py), so its cell runs like the others. See docs/interop.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from interop import peers
from interop.relay_cases import DRAFTS, PEER_OF
from interop.testing import describe, peer_bin, run_case

pytestmark = pytest.mark.interop

CELLS = [(case, d) for case, drafts in DRAFTS.items() for d in drafts]
GAPS: set[str] = set()


def _run(case: str, draft: int, tmp_path: Path) -> dict:
    bin_dir = peer_bin(peers.PEERS[PEER_OF[case]])
    return run_case(case, draft, bin_dir, tmp_path, module="interop.relay_cases")


@pytest.mark.parametrize(("case", "draft"), [c for c in CELLS if c[0] not in GAPS],
                         ids=[f"{c}-{d}" for c, d in CELLS if c not in GAPS])
def test_peer_via_our_relay(case: str, draft: int, tmp_path: Path) -> None:
    r = _run(case, draft, tmp_path)
    assert r["problems"] == [], "\n".join(r["problems"]) + "\n" + describe(r)
