"""The ``kvsp`` subcommands, by name and help line, without importing them.

A subcommand's module pulls in what its work needs (QUIC, aiohttp, numpy, redis, torch ...):
over a second of imports. ``kvsp --version``, ``kvsp --help`` and a mistyped command need
none of it, so the top-level parser lists every subcommand from this table and imports only
the module of the subcommand that is run (:func:`kvsp_moq.cli.build_parser`). The help lines
here are those the modules register; tests/test_cli_startup.py checks that they agree.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], object]


@dataclass(frozen=True)
class Group:
    """The subcommands one module registers, in its order, each with its help line."""

    commands: tuple[tuple[str, str], ...]
    #: Imports the module and returns its function that adds the subcommands.
    load: Callable[[], Register]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.commands)

    def add_stubs(self, sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
        """Name each subcommand with its help line, as the top-level help lists it."""
        for name, help_line in self.commands:
            sub.add_parser(name, help=help_line)


# One loader per module: the import stays inside the function, so that naming a group costs nothing.

def _core() -> Register:
    from . import core
    return core.register


def _bench() -> Register:
    from . import bench
    return bench.register


def _demo() -> Register:
    from . import demo
    return demo.register


def _soak() -> Register:
    from . import soak
    return soak.register


def _dashboard() -> Register:
    from . import dashboard
    return dashboard.register


def _moq() -> Register:
    from . import moq
    return moq.register


def _index() -> Register:
    from ..control.index import cli
    return cli.register_cli


def _holder() -> Register:
    from ..control.holder import cli
    return cli.register_cli


def _pc() -> Register:
    from ..control.pc import cli
    return cli.register_cli


def _instance() -> Register:
    from ..control.instance import cli
    return cli.register_cli


def _frontend() -> Register:
    from ..control.frontend import cli
    return cli.register_cli


def _descriptor() -> Register:
    from . import descriptor
    return descriptor.register


def _relay() -> Register:
    from . import relay_cmd
    return relay_cmd.register


#: Every subcommand, in the order ``kvsp --help`` lists them.
GROUPS: tuple[Group, ...] = (
    Group((("compat-id", "print the Compatibility ID of a descriptor (§4.1)"),
           ("keys", "print the Block Keys of a token sequence, one per line (§4.2)"),
           ("scope-id", "print the Scope ID of a scope key (§4.2)"),
           ("container", "inspect, verify or encode a KVB1 container file (§4.3)")), _core),
    Group((("descriptor", "print the Compatibility Descriptor a vLLM engine derives for a local model (§4.1), "
                          "for holders and relays that transcode"),), _descriptor),
    Group((("bench", "benchmarks: JSON figures on stdout, a table on stderr"),), _bench),
    Group((("demo", "run the main job end to end on loopback with embedded defaults"),), _demo),
    Group((("soak", "traffic on a loopback cluster of processes while faults are done to them; "
                    "counts what was lost (docs/reliability.md)"),), _soak),
    Group((("dashboard", "serve a live dashboard page of a running cluster"),), _dashboard),
    Group((("moq", "MOQT client and server tools"),), _moq),
    Group((("index", "run the Index Service (replica records, lookup)"),), _index),
    Group((("holder", "run a holder (block storage and retrieval, leases)"),), _holder),
    Group((("pc", "run the Placement Controller (instance status, placement)"),), _pc),
    Group((("instance", "run an inference instance (prefetch, state, sessions on its model)"),), _instance),
    Group((("frontend", "run a front end (output tokens exactly once per index, sessions for clients)"),),
          _frontend),
    Group((("relay", "run the MOQT relay (options: kvsp relay --help)"),), _relay),
)
