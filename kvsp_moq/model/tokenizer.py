"""The byte-level tokenizer of the reference model and its definition file.

Token ids 0..255 are the octets of the UTF-8 (or any) input; 256 is BOS and 257 is EOS. The
definition file is a small JSON document with deterministic bytes (sorted keys, fixed
separators, trailing newline), so its SHA-256 is the ``tokenizer_digest`` of the Compatibility
Descriptor (kvsp-draft §4.1, :func:`kvsp_moq.kvsp.compat.tokenizer_digest`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import TokenizerError

__all__ = ["BOS_ID", "BYTE_TOKENS", "EOS_ID", "TOKENIZER_FORMAT", "ByteTokenizer"]

TOKENIZER_FORMAT = "kvsp-byte-tokenizer-1"
BYTE_TOKENS = 256
BOS_ID = 256
EOS_ID = 257


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ByteTokenizer:
    """256 byte tokens plus BOS and EOS (vocabulary of 258)."""

    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def __post_init__(self) -> None:
        if (self.bos_id, self.eos_id) != (BOS_ID, EOS_ID):
            raise TokenizerError(f"the byte tokenizer has BOS={BOS_ID}, EOS={EOS_ID}")

    @property
    def vocab_size(self) -> int:
        return BYTE_TOKENS + 2

    # -- the definition file ------------------------------------------------------------------

    def definition(self) -> dict[str, object]:
        """The JSON document of the definition file."""
        return {
            "format": TOKENIZER_FORMAT,
            "byte_tokens": BYTE_TOKENS,
            "special_tokens": {"bos": self.bos_id, "eos": self.eos_id},
            "vocab_size": self.vocab_size,
        }

    def definition_bytes(self) -> bytes:
        """The exact octets of the definition file (deterministic: its SHA-256 is the
        ``tokenizer_digest``, §4.1)."""
        text = json.dumps(self.definition(), sort_keys=True, separators=(",", ":"))
        return (text + "\n").encode("ascii")

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the definition file (atomically) and return its path."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(self.definition_bytes())
        os.replace(tmp, target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ByteTokenizer:
        """Read a definition file; TokenizerError unless it is exactly the one this class
        writes (another tokenizer must never be used under this one's digest)."""
        tokenizer = cls()
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise TokenizerError(f"cannot read tokenizer file {path}: {exc}") from None
        if data != tokenizer.definition_bytes():
            raise TokenizerError(f"{path} is not a {TOKENIZER_FORMAT} definition file")
        return tokenizer

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text`` (str is UTF-8 encoded), with BOS first / EOS last if asked."""
        if isinstance(text, str):
            data = text.encode("utf-8")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TokenizerError(f"encode takes str or bytes, got {type(text).__name__}")
        ids = list(data)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def check_ids(self, ids: Iterable[int]) -> list[int]:
        """The ids as a list; TokenizerError naming the first one outside [0, vocab_size)."""
        out = list(ids)
        for i, token in enumerate(out):
            if not _is_int(token) or not 0 <= token < self.vocab_size:
                raise TokenizerError(
                    f"token id {token!r} at position {i} is outside [0, {self.vocab_size})"
                )
        return out

    def decode_bytes(self, ids: Sequence[int], *, skip_special: bool = True) -> bytes:
        """The octets of the byte tokens. BOS/EOS are dropped (``skip_special``) or rejected."""
        out = bytearray()
        for i, token in enumerate(self.check_ids(ids)):
            if token < BYTE_TOKENS:
                out.append(token)
            elif not skip_special:
                raise TokenizerError(f"special token {token} at position {i} has no bytes")
        return bytes(out)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of the byte tokens (invalid UTF-8 becomes U+FFFD)."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")
