"""The relay's, the publish/subscribe layer's and the KVSP bridge's suites once more, with every
endpoint on the native QUIC backend (issue 28: CI "runs the suites on it").

One pytest run in a child process whose ``$KVSP_QUIC_BACKEND`` is ``native``: every
``TransportConfig()`` of those modules takes it as its default backend, and so does every
relay or holder process they start (they inherit the environment). The rest of the suite
runs them on the default backend (aioquic); the transport suite runs every backend pair
itself (tests/test_transport.py), and the native data plane has its own modules
(tests/test_native_*.py, tests/test_transport_native.py).

What cannot hold on native is skipped inside those modules with the reason (a stalled
subscriber loop does not stall a native connection: docs/transport.md, native gaps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq.transport import native
from kvsp_moq.transport.config import BACKEND_ENV

pytestmark = pytest.mark.skipif(not native.available(), reason=native.unavailable_reason() or "")

ROOT = Path(__file__).resolve().parent.parent
#: The suites run again on native: the relay's, pubsub's, MOQT over WebTransport's and the
#: bridge's (holder publishing, loading into sinks, streaming, hostile and tampering peers).
SUITES = ("test_relay*.py", "test_pubsub*.py", "test_webtransport.py", "test_bridge*.py",
          "test_holder_moqt.py", "test_holder_publication.py", "test_instance_moqt.py",
          "test_sinks_moqt.py", "test_sinks_ahead.py")
#: A bound on the child run (about 3–4 minutes on the 2-core CI machine).
LIMIT_S = 900


def test_the_relay_pubsub_and_bridge_suites_pass_on_native() -> None:
    modules = sorted({str(p.relative_to(ROOT)) for pattern in SUITES
                      for p in (ROOT / "tests").glob(pattern)})
    assert len(modules) > 35, modules
    env = {**os.environ, BACKEND_ENV: "native"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfs",
         *modules], cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    tail = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"the suites failed on native:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and " failed" not in summary, summary
