"""The ``kvsp`` command: argument parsing and dispatch. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..control.frontend import cli as cli_frontend
from ..control.holder import cli as cli_holder
from ..control.index import cli as cli_index
from ..control.instance import cli as cli_instance
from ..control.pc import cli as cli_pc
from . import bench, core, demo, moq, relay_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsp", description="KV Cache Storage Protocol over MOQT")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    core.register(sub)
    bench.register(sub)
    demo.register(sub)
    moq.register(sub)
    cli_index.register_cli(sub)
    cli_holder.register_cli(sub)
    cli_pc.register_cli(sub)
    cli_instance.register_cli(sub)
    cli_frontend.register_cli(sub)
    relay_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["relay"]:
        return relay_cmd.run(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        return int(args.handler(args) or 0)
    except (core.UsageError, OSError) as exc:
        print(f"kvsp: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvsp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
