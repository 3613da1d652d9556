"""``kvsp relay ...``: the MOQT relay (same options as ``python -m relay``; docs/relay.md)."""

from __future__ import annotations

import argparse


def run(argv: list[str]) -> int:
    """Hand the arguments after ``kvsp relay`` to the relay's own parser unchanged
    (argparse cannot forward options such as ``--listen`` through a sub-command)."""
    from relay.__main__ import main

    return main(argv, prog="kvsp relay")


def _relay(args: argparse.Namespace) -> int:
    return run(args.relay_args)


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("relay", help="run the MOQT relay (options: kvsp relay --help)",
                       add_help=False)
    p.add_argument("relay_args", nargs=argparse.REMAINDER,
                   help="--listen HOST:PORT [--upstream URL] [--cert PEM --key PEM] ...")
    p.set_defaults(handler=_relay)
