"""What the demo's relay answers MOQT clients of our own, while the demo runs (tests/test_demo.py):
whether it serves a session without a token, with a wrong one, or with an instance's token inside
and outside the run's scope. The tokens, the CA and the relay's ``--config`` are read from the
run's temporary directory (``kvsp-demo-*`` in the run's own TMPDIR)."""

from __future__ import annotations

import asyncio
import re
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvsp_moq.moqt.errors import RequestErrorCode, SessionErrorCode
from kvsp_moq.pubsub import ErrorKind, MoqtError, connect
from kvsp_moq.transport import TransportConfig
from relay.ops.names import parse_namespace

#: Safety net only: each answer comes in milliseconds on loopback.
GUARD_S = 30.0


async def _answer(url: str, ca_file: Path, token: str | None, namespace: tuple[bytes, ...]) -> str:
    config = TransportConfig(ca_file=str(ca_file))  # the run's CA: the relay's certificate verified
    try:
        async with asyncio.timeout(GUARD_S):
            session = await connect(url, config, setup_tokens=(token,) if token else ())
            try:
                await session.subscribe(namespace, b"probe")
            finally:
                await session.close()
    except MoqtError as exc:
        codes = {ErrorKind.REQUEST: RequestErrorCode, ErrorKind.SESSION: SessionErrorCode}.get(exc.kind)
        name = codes(exc.code).name if codes is not None and exc.code in set(codes) else hex(exc.code)
        return f"{exc.kind.value} {name}"
    return "subscribed"


def relay_answer(url: str, ca_file: Path, token: str | None, namespace: tuple[bytes, ...]) -> str:
    """How the relay at ``url`` answers a client whose SETUP carries ``token`` (None: no token)
    and that SUBSCRIBEs to a track under ``namespace``: ``"subscribed"``, or the MOQT error as
    ``"<kind> <code name>"``: ``"REQUEST_ERROR UNAUTHORIZED"``, or ``"session termination
    UNAUTHORIZED"`` where the relay closed the session at SETUP (moqt-reference §2.9)."""
    return asyncio.run(_answer(url, ca_file, token, namespace))


@dataclass
class DemoRelay:
    """Fed the demo's stderr lines (:meth:`see`): the relay's URL from its progress line, then,
    once the cluster is up, the relay's answers (:attr:`answers`, by who asked)."""

    url: str | None = None
    answers: dict[str, str] = field(default_factory=dict)

    def see(self, line: str, tmp: Path) -> None:
        if m := re.match(r"\[demo\] relay\s+(moqt://\S+)", line):
            self.url = m.group(1)
        elif line.startswith("[demo] cluster up"):
            assert self.url is not None, "no relay line before the cluster was up"
            self.answers = self._ask(self.url, next(tmp.glob("kvsp-demo-*")))

    @staticmethod
    def _ask(url: str, workdir: Path) -> dict[str, str]:
        relay = tomllib.loads((workdir / "relay-auth.toml").read_text())
        prefixes = {p for principal in relay["principals"] for p in principal["subscribe"]}
        assert len(prefixes) == 1, prefixes  # one scope, every instance in it
        # A track of the run's scope nobody publishes: its block key and replica id all zeros.
        inside = (*parse_namespace(prefixes.pop()), bytes(32), bytes(16))
        outside = (b"kvsp-1", bytes(32), bytes(16))  # another Compatibility ID and scope
        ca_file = workdir / "demo-ca.pem"
        answers = {
            "no token": relay_answer(url, ca_file, None, inside),
            "a wrong token": relay_answer(url, ca_file, secrets.token_urlsafe(32), inside),
        }
        for n in (1, 2):  # the token each instance's configuration gives it for the relay
            token = tomllib.loads((workdir / f"instance-{n}.toml").read_text())["instance"]["token"]
            answers[f"instance-{n}"] = relay_answer(url, ca_file, token, inside)
            answers[f"instance-{n} outside its scope"] = relay_answer(url, ca_file, token, outside)
        return answers
