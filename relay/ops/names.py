"""The text form of Track Namespaces used by the relay's configuration and logs.

A namespace (or namespace prefix) is written as its fields joined by ``/``:

* a field is the UTF-8 text as written (``kvsp-1``), or
* ``0x`` followed by an even number of hex digits: the field's raw octets (binary KVSP
  fields such as compat_id, scope_id; DESIGN.md §4). A text field that itself begins with
  ``0x`` or contains ``/`` must be written in hex.

``""`` is the empty prefix (every namespace). ``kvsp-1/0x00ff`` is the tuple
``(b"kvsp-1", b"\\x00\\xff")``. Field-wise prefix matching (draft-20 §"Namespace Prefix
Matching"): ``a`` matches ``a/b`` but not ``ab``.
"""

from __future__ import annotations

__all__ = ["Namespace", "format_namespace", "parse_namespace"]

Namespace = tuple[bytes, ...]
#: draft-20 §"Track Namespace": at most 32 fields.
MAX_FIELDS = 32


def parse_namespace(text: str) -> Namespace:
    """``"kvsp-1/0xab01"`` → ``(b"kvsp-1", b"\\xab\\x01")``; raises :class:`ValueError`."""
    if not isinstance(text, str):
        raise ValueError("a namespace is a string of /-joined fields")
    if text == "":
        return ()
    fields: list[bytes] = []
    for part in text.split("/"):
        if part.startswith(("0x", "0X")):
            digits = part[2:]
            if not digits or len(digits) % 2:
                raise ValueError(f"hex field {part!r} needs an even, non-zero number of digits")
            try:
                fields.append(bytes.fromhex(digits))
            except ValueError:
                raise ValueError(f"hex field {part!r} is not hexadecimal") from None
        elif part == "":
            raise ValueError(f"empty field in namespace {text!r}")
        else:
            fields.append(part.encode("utf-8"))
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"namespace {text!r} has more than {MAX_FIELDS} fields")
    return tuple(fields)


def _field_text(field: bytes) -> str:
    try:
        text = field.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + field.hex()
    if not text or "/" in text or text.startswith(("0x", "0X")) or not text.isprintable():
        return "0x" + field.hex()
    return text


def format_namespace(ns: Namespace) -> str:
    """The inverse of :func:`parse_namespace` (binary or ambiguous fields as ``0x`` hex)."""
    return "/".join(_field_text(f) for f in ns)
