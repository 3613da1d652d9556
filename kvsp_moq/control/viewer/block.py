"""What the viewer page is given about one block (docs/viewer.md): the WebTransport URL, the
relay's certificate hash, and what the Replica Record says (kvsp-draft §4.4, binding v1).

Everything the page allocates comes from here, never from the relay: the layer count L and
the payload size of every layer, ``2·S`` octets where the record's ``size`` is
``20 + 16·L + 2·L·S`` (codec raw, §4.3; docs/binding.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...kvsp.records import ReplicaRecord
from ...kvsp.registries import codec_by_value
from ...transport import parse_moqt_url

__all__ = ["ViewerBlock", "ViewerError"]

_HEADER = 20    # KVB1 header octets (§4.3)
_PER_LAYER = 16  # KVB1 layer table entry octets (§4.3)


class ViewerError(ValueError):
    """A record the viewer cannot show (not served over MOQT, no layer digests, ...)."""


@dataclass(frozen=True)
class ViewerBlock:
    record: ReplicaRecord
    #: ``https://host:port/path`` of the relay's WebTransport endpoint.
    url: str
    #: SHA-256 (hex) of the relay's certificate for ``serverCertificateHashes`` (None: the
    #: browser verifies it as usual).
    certificate_sha256: str | None = None
    #: How long the page waits for the session, each answer and the whole block (ms).
    timeout_ms: int = 20_000

    @classmethod
    def from_record(cls, record: ReplicaRecord, url: str | None = None,
                    certificate_sha256: str | None = None, timeout_ms: int = 20_000) -> ViewerBlock:
        """``url`` defaults to the record's ``moqt://`` holder as ``https://`` (MOQT §"MOQT URI
        Scheme": the same authority and path over WebTransport)."""
        if not record.is_moqt or record.block_name() is None:
            raise ViewerError(f"the record's holder {record.holder} is not a moqt:// URL")
        if record.layer_digests is None:
            raise ViewerError("the record has no layer_digests: nothing to verify against")
        if url is None:
            url = str(parse_moqt_url(record.holder).with_scheme("https"))
        if not parse_moqt_url(url).is_webtransport:
            raise ViewerError(f"{url} is not an https:// (WebTransport) URL")
        if certificate_sha256 is not None and (len(certificate_sha256) != 64 or
                                               any(c not in "0123456789abcdef" for c in certificate_sha256)):
            raise ViewerError("certificate_sha256 must be 64 lowercase hex digits")
        if timeout_ms <= 0:
            raise ViewerError("timeout_ms must be > 0")
        block = cls(record, url, certificate_sha256, timeout_ms)
        block.layer_bytes  # checks the size
        return block

    @property
    def layer_count(self) -> int:
        assert self.record.layer_digests is not None
        return len(self.record.layer_digests)

    @property
    def layer_bytes(self) -> int:
        """The payload octets of every layer (codec raw: K then V, 2·S)."""
        count = self.layer_count
        body = self.record.size - _HEADER - _PER_LAYER * count
        if body < 0 or body % count or (body // count) % 2:
            raise ViewerError(f"size {self.record.size} is not that of {count} layers of codec raw")
        return body // count

    def page_config(self) -> dict[str, Any]:
        """The JSON the page reads (``GET api/blocks/{n}``)."""
        name = self.record.block_name()
        assert name is not None and self.record.layer_digests is not None
        return {
            "url": self.url,
            "certificate_sha256": self.certificate_sha256,
            "timeout_ms": self.timeout_ms,
            "namespace": [f.hex() for f in name.namespace_fields()],
            "track": codec_by_value(self.record.codec).name,
            "block_key": self.record.block_key.hex(),
            "replica_id": name.replica_id.hex(),
            "holder": self.record.holder,
            "layer_bytes": self.layer_bytes,
            "layer_digests": [d.hex() for d in self.record.layer_digests],
        }
