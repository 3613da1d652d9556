"""``kvsp compat-id``, ``kvsp keys``, ``kvsp scope-id`` and ``kvsp container inspect|verify``
(kvsp-draft §4.1–4.4; ``container encode`` is in .encode)."""

from __future__ import annotations

import argparse
import json
import mmap
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..kvsp import blockkeys, compat, container, scope
from ..kvsp.errors import KvspError
from ..kvsp.hexids import format_digest, parse_hex, parse_hex32
from ..kvsp.records import ReplicaRecord, parse_json
from . import encode
from .errors import UsageError

__all__ = ["UsageError", "register"]


def _read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_bytes())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON: {exc}") from None


@contextmanager
def _mapped(path: str) -> Iterator[memoryview]:
    """The file's bytes, memory-mapped read-only (a block can be large)."""
    with open(path, "rb") as fh:
        if Path(path).stat().st_size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                yield view
            finally:
                view.release()


def cmd_compat_id(args: argparse.Namespace) -> int:
    try:
        print(compat.compat_id(_read_json(args.descriptor)).hex())
    except KvspError as exc:
        raise UsageError(f"{args.descriptor}: {exc}") from None
    return 0


def _tokens(args: argparse.Namespace) -> list[int]:
    if args.tokens_file and args.tokens:
        raise UsageError("give tokens as arguments or with --tokens-file, not both")
    words = Path(args.tokens_file).read_text().split() if args.tokens_file else args.tokens
    try:
        return [int(w, 10) for w in words]
    except ValueError as exc:
        raise UsageError(f"tokens must be decimal integers: {exc}") from None


def cmd_keys(args: argparse.Namespace) -> int:
    try:
        scope_key = bytes.fromhex(args.scope_key)
    except ValueError:
        raise UsageError("--scope-key must be hex") from None
    try:
        compat_id = parse_hex32(args.compat_id, "--compat-id")
        keys = blockkeys.block_keys(scope_key, compat_id, _tokens(args), args.block_tokens)
    except (KvspError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    sys.stdout.write("".join(k.hex() + "\n" for k in keys))
    return 0


def _scope_key(args: argparse.Namespace) -> bytes:
    """``--scope-key HEX`` or ``--scope-key-file F`` (hex, whitespace ignored: the format of
    ``[instance.engine] scope_key_files``)."""
    if (args.scope_key is None) == (args.scope_key_file is None):
        raise UsageError("give exactly one of --scope-key HEX and --scope-key-file F")
    text = args.scope_key if args.scope_key is not None else Path(args.scope_key_file).read_text()
    where = "--scope-key" if args.scope_key is not None else args.scope_key_file
    try:
        return bytes.fromhex("".join(text.split()))
    except ValueError:
        raise UsageError(f"{where}: the scope key must be hex digits") from None


def cmd_scope_id(args: argparse.Namespace) -> int:
    key = _scope_key(args)
    try:
        sid = scope.scope_id(key)
    except KvspError as exc:
        raise UsageError(f"{exc} (§4.2)") from None
    print(sid.hex())
    return 0


def _inspect(data: memoryview) -> dict[str, Any]:
    box = container.decode_container(data)
    header = box.header
    digests = box.layer_digests()
    return {
        "version": header.version,
        "codec": header.codec,
        "first_layer": header.first_layer,
        "layer_count": header.layer_count,
        "token_count": header.token_count,
        "size": header.total_size,
        "layer_digests": [d.hex() for d in digests],
        "digest": format_digest(container.replica_digest(digests)),
    }


def _inspect_file(path: str) -> dict[str, Any] | str:
    """The inspection report of a container file, or the reason it is not a valid container.

    The error is returned, not raised, so that no traceback still references views of the
    mapping when it is closed."""
    with _mapped(path) as data:
        try:
            return _inspect(data)
        except KvspError as exc:
            reason = str(exc)
    return reason


def cmd_container_inspect(args: argparse.Namespace) -> int:
    report = _inspect_file(args.file)
    if isinstance(report, str):
        raise UsageError(f"{args.file}: {report}")
    print(json.dumps(report, indent=2))
    return 0


def _verify(report: dict[str, Any], record: ReplicaRecord) -> list[str]:
    """Mismatches between a container and a Replica Record (kvsp-draft §4.3, §6.7)."""
    problems = []
    if report["codec"] != record.codec:
        problems.append(f"codec {report['codec']} differs from the record's {record.codec}")
    if record.layer_digests is not None:
        listed = [d.hex() for d in record.layer_digests]
        for offset, digest in enumerate(report["layer_digests"]):
            layer = report["first_layer"] + offset
            if layer >= len(listed):
                problems.append(f"layer {layer} is not listed in the record's layer_digests")
            elif digest != listed[layer]:
                problems.append(f"layer {layer} digest {digest} differs from the record's {listed[layer]}")
        covers_all = report["first_layer"] == 0 and report["layer_count"] == len(listed)
        if covers_all and format_digest(container.replica_digest(record.layer_digests)) != format_digest(record.digest):
            problems.append("the record's layer_digests do not hash to its digest")
    else:
        covers_all = True
    if covers_all and report["digest"] != format_digest(record.digest):
        problems.append(f"replica digest {report['digest']} differs from the record's {format_digest(record.digest)}")
    return problems


def cmd_container_verify(args: argparse.Namespace) -> int:
    try:
        record = parse_json(Path(args.record).read_bytes(), ReplicaRecord)
    except KvspError as exc:
        raise UsageError(f"{args.record}: {exc}") from None
    report = _inspect_file(args.file)
    if isinstance(report, str):
        print(f"kvsp: {args.file}: invalid container: {report}", file=sys.stderr)
        return 1
    problems = _verify(report, record)
    for problem in problems:
        print(f"kvsp: {args.file}: {problem}", file=sys.stderr)
    if problems:
        return 1
    last = report["first_layer"] + report["layer_count"] - 1
    print(f"{args.file}: OK (layers {report['first_layer']}-{last} match the record)")
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("compat-id", help="print the Compatibility ID of a descriptor (§4.1)")
    p.add_argument("descriptor", metavar="DESCRIPTOR.json")
    p.set_defaults(handler=cmd_compat_id)

    p = sub.add_parser("keys", help="print the Block Keys of a token sequence, one per line (§4.2)")
    p.add_argument("--scope-key", required=True, metavar="HEX", help="the scope key (>= 32 octets)")
    p.add_argument("--compat-id", required=True, metavar="HEX", help="the Compatibility ID (hex32)")
    p.add_argument("--block-tokens", required=True, type=int, metavar="B")
    p.add_argument("--tokens-file", metavar="F", help="whitespace-separated decimal token ids")
    p.add_argument("tokens", nargs="*", metavar="TOKEN")
    p.set_defaults(handler=cmd_keys)

    p = sub.add_parser("scope-id", help="print the Scope ID of a scope key (§4.2)",
                       description="Print the Scope ID (32 hex digits) of a Scope Key: the "
                                   "<scope_id hex16> of the IS principals' scopes and the relay's "
                                   "kvsp-1/0x<compat_id>/0x<scope_id> prefixes (docs/deploy.md)")
    p.add_argument("--scope-key", metavar="HEX", help="the scope key (>= 32 octets, hex)")
    p.add_argument("--scope-key-file", metavar="F",
                   help="a file holding the scope key in hex (as [instance.engine] scope_key_files)")
    p.set_defaults(handler=cmd_scope_id)

    p = sub.add_parser("container", help="inspect, verify or encode a KVB1 container file (§4.3)")
    csub = p.add_subparsers(dest="container_command", required=True, metavar="ACTION")
    q = csub.add_parser("inspect", help="print the container's header and digests as JSON")
    q.add_argument("file", metavar="FILE")
    q.set_defaults(handler=cmd_container_inspect)
    q = csub.add_parser("verify", help="check a container against a Replica Record")
    q.add_argument("file", metavar="FILE")
    q.add_argument("--record", required=True, metavar="RECORD.json")
    q.set_defaults(handler=cmd_container_verify)
    encode.register_action(csub, _inspect_file)
