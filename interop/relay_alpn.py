"""``python -m interop.relay_alpn --alpn moqt-20 [python -m relay options]``: our relay
(``relay.__main__``, unchanged code path) with its server ALPN list pinned.

``python -m relay`` offers our default list (``moqt-22,21,20,18``) and picks by its own
preference; moq-rs and caprid have no API to pin their version, so the "peer via our relay"
cells (``interop/relay_cases.py``) pin the *relay* to ``moqt-<draft>`` for drafts below 22.
Everything else (listening line, certificate, logging, shutdown) is ``python -m relay``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kvsp_moq.transport import run
from relay.__main__ import build_config, parse_args, serve
from relay.ops.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m interop.relay_alpn", add_help=False)
    ap.add_argument("--alpn", required=True, help="comma list, e.g. moqt-20")
    ours, rest = ap.parse_known_args(argv)
    args = parse_args(rest)
    level = args.log_level or ("INFO" if args.verbose or args.log_format == "json"
                               else "WARNING")
    configure_logging(args.log_format, getattr(logging, level))
    config = build_config(args)
    alpns = tuple(a for a in ours.alpn.split(",") if a)
    config.server_transport = dataclasses.replace(config.server_transport,
                                                  alpn_protocols=alpns)
    return run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
