"""``moq-test-client``: our side of the moq-interop-runner test-client contract.

    python -m interop.test_client -r moqt://127.0.0.1:4443/moq -t setup-only [--draft 22]
    RELAY_URL=... TESTCASE=... TLS_DISABLE_VERIFY=1 MOQT_DRAFT=18 python -m interop.test_client

TAP version 14 on stdout; exit 0 when every case passed, 1 when one failed, 127 for a test
name we do not know (or a draft we cannot speak). ``-l`` lists the cases; no ``-t`` runs all
fourteen. ``--draft`` pins the ALPN to ``moqt-NN`` (default: the environment's ``MOQT_DRAFT``,
or ``DRAFT`` as moq-interop-runner injects it, as ``18``, ``draft-18`` or
``draft-ietf-moq-transport-18``; neither: our list, newest first). A draft given but not one we
speak, or not a draft number at all, is the contract's "unsupported": exit 127.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re
import sys
from collections.abc import Sequence

from .client_cases import CASES, Run, run_case
from .client_support import Target
from .tap import CaseResult, render

DRAFTS = (22, 20, 18)
EXIT_UNSUPPORTED = 127
#: Environment variables naming the draft, first set one wins: moq-interop-runner's contract
#: names MOQT_DRAFT; its runner injects DRAFT (aiomoqt's client reads both).
DRAFT_ENV = ("MOQT_DRAFT", "DRAFT")
_DRAFT_SPELLINGS = re.compile(r"(?:draft-ietf-moq-transport-|draft-)?0*(\d{1,4})", re.IGNORECASE)


def parse_draft(text: str) -> int | None:
    """``18``, ``draft-18`` or ``draft-ietf-moq-transport-18`` -> 18; anything else None."""
    m = _DRAFT_SPELLINGS.fullmatch(text.strip())
    return int(m.group(1)) if m else None


def _env_draft() -> str | None:
    return next((os.environ[k] for k in DRAFT_ENV if os.environ.get(k, "").strip()), None)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moq-test-client", description=__doc__.split("\n\n")[0])
    p.add_argument("-r", "--relay", default=os.environ.get("RELAY_URL", ""),
                   help="relay URL, moqt://host:port/path (raw QUIC) or https://host:port/path "
                        "(WebTransport) (env RELAY_URL)")
    p.add_argument("-t", "--test", default=os.environ.get("TESTCASE") or None,
                   help="one test case (env TESTCASE); default: all")
    p.add_argument("-l", "--list", action="store_true", help="list the test cases")
    p.add_argument("--tls-disable-verify", action="store_true",
                   default=_truthy(os.environ.get("TLS_DISABLE_VERIFY")),
                   help="do not verify the relay's certificate (env TLS_DISABLE_VERIFY=1)")
    p.add_argument("--draft", default=_env_draft(),
                   help=f"pin the ALPN to moqt-NN (one of {', '.join(map(str, DRAFTS))}; "
                        "env MOQT_DRAFT or DRAFT)")
    return p


def _relay_url(raw: str) -> str:
    """moq-interop-runner passes ``https://`` (WebTransport) or ``moqt://`` (raw QUIC) URLs;
    both are spoken as given. ``quic://`` (older runners) means raw QUIC."""
    if raw.startswith("quic://"):
        return "moqt://" + raw[len("quic://"):]
    return raw


async def _run_all(target: Target, names: Sequence[str]) -> list[CaseResult]:
    run = Run(target)
    results = []
    for name in names:
        result = await run_case(run, name)
        print(f"  [{'PASS' if result.passed else 'FAIL'}] {name}: {result.message}",
              file=sys.stderr, flush=True)
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    header = [f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
              f"target: {args.relay}", "implementation: kvsp_moq interop test client"]
    if args.draft is not None:
        header.append(f"draft: {args.draft}")
    draft = None if args.draft is None else parse_draft(args.draft)
    if args.draft is not None and draft not in DRAFTS:
        print(f"TAP version 14\n1..0 # SKIP draft {args.draft} not supported "
              f"(we speak {', '.join(map(str, DRAFTS))})")
        return EXIT_UNSUPPORTED
    if args.test is not None and args.test not in CASES:
        print(f"TAP version 14\n1..0 # SKIP unsupported test case {args.test}")
        return EXIT_UNSUPPORTED
    if not args.relay:
        print("moq-test-client: no relay URL (-r or RELAY_URL)", file=sys.stderr)
        return 2
    target = Target(_relay_url(args.relay), draft, args.tls_disable_verify)
    names = [args.test] if args.test else list(CASES)
    results = asyncio.run(_run_all(target, names))
    print(render(results, header=header), flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
