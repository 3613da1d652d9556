"""The interop matrix: every moq-interop-runner case, per draft, for each pairing of a test
client and a relay, compared with a committed baseline (``interop/matrix-baseline.json``).

    python -m interop.matrix [--drafts 22,20,18] [--transport quic|webtransport|both]
                             [--backend aioquic|qh3|native] [--write-docs] [--json OUT]
                             [--update-baseline]

Columns: ``aiomoqt>ours`` (aiomoqt's ``moq-interop-client`` against our relay,
``python -m relay``), ``ours>aiomoqt`` (our ``interop.test_client`` against aiomoqt's
``moq-interop-relay``) and ``ours>ours``. aiomoqt's relay listens on every address whatever
``--bind`` says, so the whole matrix runs in a private network namespace with only loopback
(``unshare -n``; the command re-executes itself there). Without one (not root) the aiomoqt
relay column is skipped, loudly. Each process runs in its own process group and is killed when
its step ends; readiness is the line each relay prints.

A second group of columns, ``peer via our relay`` (one per draft), has its own rows: moq-rs
and caprid-relay publishers and subscribers through our relay (``interop/relay_cases.py``,
one fresh relay per cell, exact bytes, counts and negotiated versions). ``--groups`` picks
``test-client`` (the fourteen-case table), ``relay-peers`` or both (default). A peer that
cannot be installed leaves its cells out, with a LOUD SKIP.

``--transport webtransport`` runs the same cells over WebTransport: our relay's same port
with ``https://`` URLs, aiomoqt's relay in its WebTransport mode (``https://127.0.0.1:P/``),
the moq-rs cells of the relay group with ``https://`` URLs (caprid-relay has no WebTransport);
their columns carry the suffix `` wt`` (``aiomoqt>ours wt``, ``peer via our relay wt``).

``--backend B`` runs every process of ours (relay, test client, the relay cells' relay) on the
QUIC backend B (``$KVSP_QUIC_BACKEND``, which they all read; default: that variable, else
aioquic): both directions of every cell then cross B and the peer's own QUIC stack. The cells
are held to the same baseline whatever the backend: a backend passes the cells the default one
passes.

Exit status: 0, or 1 when a cell that passed in the baseline fails now (a regression);
improvements (baseline fail, now pass) are reported and do not fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsp_moq.transport.config import BACKEND_ENV, BACKENDS
from kvsp_moq.transport.tls import make_self_signed

from . import peers
from . import relay_cases
from .client_cases import CASES
from .harness import ROOT, CaseError, PeerProcess, only_loopback, parse_json
from .tap import parse

BASELINE = Path(__file__).resolve().parent / "matrix-baseline.json"
DOCS = ROOT / "docs" / "interop.md"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
RELAY_BEGIN, RELAY_END = "<!-- relay-peers:begin -->", "<!-- relay-peers:end -->"
WT_BEGIN, WT_END = "<!-- matrix-wt:begin -->", "<!-- matrix-wt:end -->"
RELAY_WT_BEGIN, RELAY_WT_END = "<!-- relay-peers-wt:begin -->", "<!-- relay-peers-wt:end -->"
QUIC_COLUMNS = ("aiomoqt>ours", "ours>aiomoqt", "ours>ours")
#: The same pairings over WebTransport (``https://`` URLs; aiomoqt's relay in its WebTransport
#: mode): a column name plus this suffix.
WT = " wt"
COLUMNS = QUIC_COLUMNS + tuple(c + WT for c in QUIC_COLUMNS)
RELAY_COLUMN = relay_cases.COLUMN  # "peer via our relay"
TRANSPORTS = ("quic", "webtransport")
RELAY_CELL_LIMIT = 60.0  # seconds for one relay-peer cell process (safety net; ≈ 1-3 s seen)
AIOMOQT_ONLY_WITH_T = ("fetch", "join")  # its client runs these only when named with -t
RUN_LIMIT = 90.0  # seconds for one client process (safety net)

Results = dict[str, dict[str, dict[str, dict[str, str]]]]  # draft -> column -> case -> cell


@dataclass
class Env:
    tmp: Path
    cert: Path
    key: Path
    aiomoqt_bin: Path | None
    isolated: bool
    #: peer name (interop.peers.PEERS) -> venv bin, for the "peer via our relay" cells
    relay_peer_bins: dict[str, Path] | None = None
    test_client: bool = True
    #: "quic" and/or "webtransport": which transports the cells run over
    transports: tuple[str, ...] = ("quic",)


def _env_with_path() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def _start_our_relay(env: Env) -> tuple[PeerProcess, str]:
    relay = PeerProcess("our relay", [sys.executable, "-m", "relay", "--listen", "127.0.0.1:0",
                                      "--cert", env.cert, "--key", env.key],
                        cwd=ROOT, env=_env_with_path())
    await relay.start()
    url = await relay.expect(lambda ln: ln.split("relay listening on ")[-1].strip()
                             if "relay listening on " in ln else None, 30, "listening line")
    return relay, str(url)


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _start_aiomoqt_relay(env: Env, drafts: Sequence[int], transport: str = "quic"
                               ) -> tuple[PeerProcess, str]:
    """aiomoqt's relay over raw QUIC (``--quic``) or WebTransport (its default mode; the
    path must be ``/``)."""
    if not only_loopback():
        raise CaseError("refusing to start moq-interop-relay outside a loopback-only namespace")
    assert env.aiomoqt_bin is not None
    port = _free_port()
    mode = ["--quic"] if transport == "quic" else []
    relay = PeerProcess(f"moq-interop-relay ({transport})", [
        env.aiomoqt_bin / "moq-interop-relay", "--bind", "127.0.0.1", "--port", port, *mode,
        "--draft", ",".join(map(str, drafts)), "--cert", env.cert, "--key", env.key])
    await relay.start()
    await relay.expect(lambda ln: "Listening on" in ln, 30, "listening line")
    return relay, f"{_scheme(transport)}://127.0.0.1:{port}/"


def _scheme(transport: str) -> str:
    return "https" if transport == "webtransport" else "moqt"


def _suffix(transport: str) -> str:
    return WT if transport == "webtransport" else ""


async def _tap_run(name: str, argv: Sequence[object], cwd: Path | None = None
                   ) -> dict[str, dict[str, str]]:
    """Run one TAP-speaking client; {case: cell}. A crash or hang fails the cases it names."""
    proc = PeerProcess(name, argv, cwd=cwd, env=_env_with_path(), keep_lines=5000)
    try:
        await proc.start()
        await proc.wait(RUN_LIMIT)
    finally:
        await proc.stop()
    text = "\n".join(proc.lines)
    cells: dict[str, dict[str, str]] = {}
    messages = _messages(text)
    for case, ok in parse(text).items():
        cells[case] = {"result": "pass" if ok else "fail", "message": messages.get(case, "")}
    return cells


def _messages(text: str) -> dict[str, str]:
    """{case: the YAML ``message`` of its test point}."""
    out: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(("ok ", "not ok ")):
            current = line.split(" - ", 1)[-1].split(" # ")[0].strip()
        elif current and line.strip().startswith("message:"):
            raw = line.split("message:", 1)[1].strip()
            try:
                out[current] = str(json.loads(raw))
            except ValueError:
                out[current] = raw
    return out


def _our_client(url: str, draft: int) -> list[object]:
    return [sys.executable, "-m", "interop.test_client", "-r", url, "--tls-disable-verify",
            "--draft", draft]


def _aiomoqt_client(env: Env, url: str, draft: int, case: str | None) -> list[object]:
    assert env.aiomoqt_bin is not None
    argv: list[object] = [env.aiomoqt_bin / "moq-interop-client", "-r", url,
                          "--tls-disable-verify", "--draft", draft]
    return argv + (["-t", case] if case else [])


def _missing(cells: dict[str, dict[str, str]], why: str) -> dict[str, dict[str, str]]:
    for case in CASES:
        cells.setdefault(case, {"result": "fail", "message": why})
    return cells


async def _relay_peer_cell(env: Env, case: str, draft: int, bin_dir: Path,
                           transport: str = "quic") -> dict[str, str]:
    """One "peer via our relay" cell: ``python -m interop.relay_cases`` in its own process
    group; pass when :func:`interop.relay_cases.check` found no problem."""
    proc = PeerProcess(f"relay cell {case} {draft} {transport}", [
        sys.executable, "-m", "interop.relay_cases", case, "--draft", draft, "--peer-bin",
        bin_dir, "--cert", env.cert, "--key", env.key, "--guard", RELAY_CELL_LIMIT - 15,
        "--transport", transport], cwd=ROOT, env=_env_with_path(), keep_lines=2000)
    try:
        await proc.start()
        result = await proc.expect(lambda ln: ln.startswith("RESULT ") and
                                   parse_json(ln[len("RESULT "):]), RELAY_CELL_LIMIT, "RESULT")
    except CaseError as exc:
        return {"result": "fail", "message": str(exc)}
    finally:
        await proc.stop()
    problems = result.get("problems") or []
    return {"result": "pass"} if not problems else {"result": "fail",
                                                    "message": "; ".join(problems)}


async def run_relay_peers(env: Env, drafts: Sequence[int], results: Results) -> None:
    """The "peer via our relay" column group: each cell one after another."""
    for transport in env.transports:
        for d in drafts:
            for case, case_drafts in relay_cases.DRAFTS.items():
                bin_dir = (env.relay_peer_bins or {}).get(relay_cases.PEER_OF[case])
                if d not in case_drafts or bin_dir is None or (
                        transport == "webtransport"
                        and case not in relay_cases.WEBTRANSPORT_CASES):
                    continue
                cell = await _relay_peer_cell(env, case, d, bin_dir, transport)
                column = RELAY_COLUMN + _suffix(transport)
                results[str(d)].setdefault(column, {})[case] = cell


async def run_matrix(env: Env, drafts: Sequence[int]) -> Results:
    results: Results = {str(d): {} for d in drafts}
    if env.relay_peer_bins is not None:
        await run_relay_peers(env, drafts, results)
    if not env.test_client:
        return results
    procs: list[PeerProcess] = []
    try:
        ours, quic_url = await _start_our_relay(env)  # one port: raw QUIC and WebTransport
        procs.append(ours)
        for transport in env.transports:
            our_url = f"{_scheme(transport)}://{quic_url.split('://', 1)[1]}"
            sfx = _suffix(transport)
            aio_url = None
            if env.aiomoqt_bin is not None and env.isolated:
                aio, aio_url = await _start_aiomoqt_relay(env, drafts, transport)
                procs.append(aio)
            for d in drafts:
                row = results[str(d)]
                if env.aiomoqt_bin is not None:
                    cells = await _tap_run("moq-interop-client",
                                           _aiomoqt_client(env, our_url, d, None))
                    for case in AIOMOQT_ONLY_WITH_T:
                        cells.update(await _tap_run("moq-interop-client",
                                                    _aiomoqt_client(env, our_url, d, case)))
                    row["aiomoqt>ours" + sfx] = _missing(cells, "no TAP line for this case")
                if aio_url is not None:
                    row["ours>aiomoqt" + sfx] = _missing(
                        await _tap_run("our test client", _our_client(aio_url, d), ROOT),
                        "no TAP line for this case")
                row["ours>ours" + sfx] = _missing(
                    await _tap_run("our test client", _our_client(our_url, d), ROOT),
                    "no TAP line for this case")
    finally:
        for p in reversed(procs):
            await p.stop()
    return results


# ---------------------------------------------------------------------------------------------
# baseline, table, docs
def load_baseline(path: Path = BASELINE) -> Results:
    return json.loads(path.read_text())["cells"] if path.exists() else {}


def compare(baseline: Results, now: Results) -> tuple[list[str], list[str]]:
    """(regressions, improvements) as 'draft column case: ...' lines."""
    regressions, improvements = [], []
    for d, columns in now.items():
        for col, cases in columns.items():
            for case, cell in cases.items():
                base = baseline.get(d, {}).get(col, {}).get(case)
                where = f"draft {d} {col} {case}"
                if base is None:
                    continue
                if base["result"] == "pass" and cell["result"] != "pass":
                    regressions.append(f"{where}: was pass, now {cell['result']}: "
                                       f"{cell.get('message', '')}")
                elif base["result"] != "pass" and cell["result"] == "pass":
                    improvements.append(f"{where}: was fail ({base.get('reason', '')}), now pass")
    return regressions, improvements


def updated_baseline(old: Results, now: Results) -> Results:
    """``now`` as a baseline: failing cells keep the recorded reason (or take the message)."""
    out: Results = {}
    for d, columns in now.items():
        for col, cases in columns.items():
            for case, cell in cases.items():
                entry = {"result": cell["result"]}
                if cell["result"] != "pass":
                    prior = old.get(d, {}).get(col, {}).get(case, {})
                    entry["reason"] = prior.get("reason") or cell.get("message", "")
                out.setdefault(d, {}).setdefault(col, {})[case] = entry
    return out


def table(now: Results, baseline: Results, columns: Sequence[str] = QUIC_COLUMNS) -> str:
    drafts = list(now)
    cols = [c for c in columns if any(c in now[d] for d in drafts)]
    head = "| case | " + " | ".join(f"{c} {d}" for c in cols for d in drafts) + " |"
    lines = [head, "|---" * (1 + len(cols) * len(drafts)) + "|"]
    for case in CASES:
        row = []
        for c in cols:
            for d in drafts:
                cell = now[d].get(c, {}).get(case)
                if cell is None:
                    row.append("—")
                elif cell["result"] == "pass":
                    row.append("pass")
                else:
                    gap = baseline.get(d, {}).get(c, {}).get(case, {}).get("result") == "fail"
                    row.append("gap" if gap else "**FAIL**")
        lines.append(f"| {case} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def relay_table(now: Results, baseline: Results, transport: str = "quic") -> str:
    """The "peer via our relay" table: one row per path, one column per draft."""
    drafts = list(now)
    column = RELAY_COLUMN + _suffix(transport)
    lines = [f"| path ({column}) | " + " | ".join(drafts) + " |",
             "|---" * (1 + len(drafts)) + "|"]
    for case, case_drafts in relay_cases.DRAFTS.items():
        if transport == "webtransport" and case not in relay_cases.WEBTRANSPORT_CASES:
            continue
        row = []
        for d in drafts:
            cell = now[d].get(column, {}).get(case)
            if cell is None:
                row.append("—" if int(d) not in case_drafts else "not run")
            elif cell["result"] == "pass":
                row.append("pass")
            else:
                base = baseline.get(d, {}).get(column, {}).get(case, {})
                row.append("gap" if base.get("result") == "fail" else "**FAIL**")
        lines.append(f"| {case} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_docs(text: str, path: Path = DOCS, begin: str = BEGIN, end_mark: str = END) -> None:
    doc = path.read_text()
    start, end = doc.index(begin) + len(begin), doc.index(end_mark)
    path.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


# ---------------------------------------------------------------------------------------------
# command line
def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m interop.matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", default="22,20,18")
    p.add_argument("--write-docs", action="store_true", help="rewrite the table in docs/interop.md")
    p.add_argument("--json", type=Path, help="write the observed cells here")
    p.add_argument("--groups", default="test-client,relay-peers",
                   help="column groups: test-client (the fourteen cases), relay-peers "
                        "(moq-rs / caprid via our relay), or both")
    p.add_argument("--transport", choices=(*TRANSPORTS, "both"), default="quic",
                   help="run the cells over raw QUIC (moqt://), WebTransport (https://; "
                        "columns suffixed 'wt') or both")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="QUIC backend of every process of ours (sets $KVSP_QUIC_BACKEND; "
                        "default: that variable, else aioquic)")
    p.add_argument("--update-baseline", action="store_true",
                   help="record this run as interop/matrix-baseline.json")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _reexec_isolated(argv: Sequence[str]) -> int:
    cmd = [sys.executable, "-m", "interop.matrix", *argv, "--inside"]
    proc = __import__("subprocess").run(peers.isolated_command("exec " + shlex.join(cmd)),
                                        cwd=ROOT, env=_env_with_path())
    return proc.returncode


def _install_peers(groups: set[str]) -> None:
    """Install (or find) every peer the chosen groups need; failures are reported later,
    where the cells are left out with a LOUD SKIP."""
    wanted = [peers.AIOMOQT] if "test-client" in groups else []
    if "relay-peers" in groups:
        wanted += [peers.PEERS[name] for name in sorted(set(relay_cases.PEER_OF.values()))]
    for spec in wanted:
        try:
            peers.ensure_peer(spec)
        except peers.PeerUnavailable:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _args(raw)
    groups = {g.strip() for g in args.groups.split(",") if g.strip()}
    if args.backend is not None:  # read by every process of ours (TransportConfig's default)
        os.environ[BACKEND_ENV] = args.backend
    if not args.inside and not only_loopback() and peers.can_isolate():
        # Install the peers first: inside the loopback-only namespace no package index is
        # reachable, so a peer missing there would silently lose its cells.
        _install_peers(groups)
        return _reexec_isolated(raw)
    drafts = [int(d) for d in args.drafts.split(",") if d.strip()]
    aiomoqt_bin: Path | None = None
    if "test-client" in groups:
        try:
            aiomoqt_bin = peers.ensure_peer(peers.AIOMOQT)
        except peers.PeerUnavailable as exc:
            print(f"LOUD SKIP: aiomoqt columns cannot run here: {exc}", file=sys.stderr)
    relay_peer_bins: dict[str, Path] | None = None
    if "relay-peers" in groups:
        relay_peer_bins = {}
        for name in sorted(set(relay_cases.PEER_OF.values())):
            try:
                relay_peer_bins[name] = peers.ensure_peer(peers.PEERS[name])
            except peers.PeerUnavailable as exc:
                print(f"LOUD SKIP: {name} cells of '{RELAY_COLUMN}' cannot run here: {exc}",
                      file=sys.stderr)
    isolated = only_loopback()
    if not isolated and "test-client" in groups:
        print("LOUD SKIP: no loopback-only network namespace (needs root): the ours>aiomoqt "
              "column is skipped", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvsp-matrix-") as tmp:
        cert = make_self_signed()
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert.cert_pem if isinstance(cert.cert_pem, bytes)
                              else cert.cert_pem.encode())
        key_path.write_bytes(cert.key_pem if isinstance(cert.key_pem, bytes)
                             else cert.key_pem.encode())
        transports = TRANSPORTS if args.transport == "both" else (args.transport,)
        env = Env(Path(tmp), cert_path, key_path, aiomoqt_bin, isolated,
                  relay_peer_bins=relay_peer_bins, test_client="test-client" in groups,
                  transports=transports)
        now = asyncio.run(run_matrix(env, drafts))
    old = load_baseline()
    regressions, improvements = compare(old, now)
    quic, wt = "quic" in transports, "webtransport" in transports
    text = table(now, old) if "test-client" in groups and quic else ""
    rtext = relay_table(now, old) if "relay-peers" in groups and quic else ""
    wtext = table(now, old, [c + WT for c in QUIC_COLUMNS]) \
        if "test-client" in groups and wt else ""
    wrtext = relay_table(now, old, "webtransport") if "relay-peers" in groups and wt else ""
    print("\n\n".join(t for t in (text, rtext, wtext, wrtext) if t))
    for line in improvements:
        print(f"IMPROVEMENT {line}")
    for line in regressions:
        print(f"REGRESSION {line}")
    if args.json:
        args.json.write_text(json.dumps({"cells": now, "regressions": regressions,
                                         "improvements": improvements,
                                         "backend": os.environ.get(BACKEND_ENV) or "aioquic"},
                                        indent=1))
    if args.update_baseline:
        # Re-read (others may have changed cells meanwhile) and replace only the columns
        # this run observed; every other draft / column is kept as it is in the file.
        merged = load_baseline()
        for d, columns in updated_baseline(merged, now).items():
            merged.setdefault(d, {}).update(columns)
        BASELINE.write_text(json.dumps({"cells": merged}, indent=1, sort_keys=True) + "\n")
    if args.write_docs:
        if text:
            write_docs(text)
        if rtext:
            write_docs(rtext, begin=RELAY_BEGIN, end_mark=RELAY_END)
        if wtext:
            write_docs(wtext, begin=WT_BEGIN, end_mark=WT_END)
        if wrtext:
            write_docs(wrtext, begin=RELAY_WT_BEGIN, end_mark=RELAY_WT_END)
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
