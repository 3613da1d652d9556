"""The connector's settings: ``kv_connector_extra_config`` (docs/vllm.md "Settings").

vLLM hands a connector its ``KVTransferConfig.kv_connector_extra_config`` (a JSON object).
:meth:`ConnectorSettings.from_extra` reads it, checks every value and fills the defaults;
:func:`kv_transfer_config` builds the whole ``KVTransferConfig`` argument (a dict, so this
module imports no vLLM) from a cluster's URLs and tokens, for ``LLM(kv_transfer_config=...)``
and ``vllm serve --kv-transfer-config '<json>'`` alike.

Scopes (kvsp-draft §4.2): ``scopes`` maps a scope name to its Scope Key (hex, at least 32
octets). A tenant's scope is chosen only by something the operator controls (DESIGN.md §9),
never by a name in the client's request body:

- ``scope_salts`` maps a scope name to the SHA-256 digests (``sha-256:<hex>``, see
  :func:`salt_digest`) of the secret salts that select it. The operator's gateway sets each
  tenant's secret as the request's ``cache_salt`` (vLLM's per-tenant prefix-cache salt, which
  also keeps vLLM's own cache apart); the connector stores only the digests.
- A request without a ``cache_salt`` is in ``default_scope`` (none: it shares nothing; a
  multi-tenant engine sets none).
- A ``cache_salt`` that selects no scope shares nothing: no lookup, no load, no publication
  (reported in the request's ``kv_transfer_params["kvsp"]``, and logged).
- ``kv_transfer_params["kvsp_scope"]`` selects nothing (it came from the request body); it is
  ignored with a warning. ``kv_transfer_params={"kvsp": false}`` switches the connector off for
  one request (opting out takes nothing from anyone).

Codecs (``codec_policy``, :class:`~kvsp_moq.kvsp.codecs.policy.CodecPolicy`; docs/vllm.md
"Codecs"): the operator names the codec a scope's blocks are loaded in (``scopes``: scope
name -> codec), a lossless codec for every other scope (``lossless``) and the codec of a
request class (``classes``). A request names its class in ``kv_transfer_params["kvsp_class"]``
(the request body): so a class is honoured only where it adds no loss the operator did not
allow for the request's scope — its codec is lossless, or the scope's own choice is lossy
(:meth:`ConnectorSettings.codec_of`). ``kv_transfer_params["kvsp_codec"]`` chooses nothing
(ignored with a warning). Without ``codec_policy`` every load is raw, bit-exact.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...kvsp.codecs.policy import CodecChoice, CodecPolicy
from ...kvsp.errors import RecordError
from ...kvsp.scope import check_scope_key, scope_id

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "WORKER_EXTENSION", "ConnectorSettings", "ScopeChoice", "SettingsError",
           "connector_extra_config", "kv_transfer_config", "salt_digest"]

#: What ``KVTransferConfig`` names to load the connector (``kv_connector_module_path``).
CONNECTOR_MODULE = "kvsp_moq.integrations.vllm.connector"
CONNECTOR_CLASS = "KVSPConnector"
#: ``LLM(worker_extension_cls=...)``: the workers' ``kvsp_flush`` (``llm.collective_rpc``).
WORKER_EXTENSION = CONNECTOR_MODULE + ".KVSPWorkerExtension"


def salt_digest(salt: str) -> str:
    """How ``scope_salts`` names a secret salt: ``sha-256:`` + the hex SHA-256 of its UTF-8."""
    return "sha-256:" + hashlib.sha256(salt.encode()).hexdigest()


@dataclass(frozen=True)
class ScopeChoice:
    """A request's scope (None: it shares nothing) and, when it shares nothing, why."""

    scope: str | None
    reason: str | None = None


class SettingsError(ValueError):
    """A ``kv_connector_extra_config`` value is missing or invalid; names the key."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(f"kv_connector_extra_config[{key!r}]: {detail}")


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's keys (docs/vllm.md lists them with these defaults)."""

    #: Index Service base URL (``POST lookup``, ``PUT replicas/...``); None: no KVSP at all.
    index_url: str | None = None
    index_token: str | None = None
    #: The MOQT relay (``moqt://host:port/path``): loads FETCH through it, publications
    #: PUBLISH_NAMESPACE to it. None: no MOQT (HTTP only).
    relay_url: str | None = None
    #: Token sent as AUTHORIZATION_TOKEN in SETUP to the relay (binding §9).
    moqt_token: str | None = None
    #: HTTP holder base URL: computed blocks are PUT there (the HTTP fallback of loads).
    holder_url: str | None = None
    holder_token: str | None = None
    #: Token for GETs of HTTP replicas (default: ``holder_token``).
    fetch_token: str | None = None
    #: scope name -> Scope Key (hex); ``default_scope`` names the scope of requests naming none.
    scopes: Mapping[str, bytes] = field(default_factory=dict)
    default_scope: str | None = None
    #: salt digest (``sha-256:<hex>``) -> scope name: the secret ``cache_salt`` that selects it.
    scope_salts: Mapping[str, str] = field(default_factory=dict)
    #: TLS of the MOQT client: CA file to verify the relay with; ``insecure`` skips that.
    ca_file: str | None = None
    insecure: bool = False
    #: Load and publish (either can be switched off: a consumer-only or producer-only engine).
    load: bool = True
    #: Loads are asynchronous (vLLM's ``load_kv_async``: the request waits outside the batch
    #: while its blocks arrive, the other requests run); false: layer-wise during the request's
    #: first forward pass (layer l waited for just before layer l is computed).
    async_loads: bool = True
    publish: bool = True
    #: The bound on every wait on a peer, in ms: the IS lookup in the scheduler, each layer in
    #: ``wait_for_layer_load``, the completion of publications in ``wait_for_save``.
    deadline_ms: int = 5_000
    #: The bound on each MOQT request (connect, FETCH) of a load, in ms: shorter than
    #: ``deadline_ms`` so that a dead relay leaves time for the HTTP fallback.
    moqt_timeout_ms: int = 2_000
    #: TTL asked for the Replica Records the connector publishes (the IS caps it, §6.1).
    record_ttl_ms: int = 600_000
    #: Bytes of the connector's own block store (the replicas it serves over MOQT).
    store_bytes: int = 256 * 1024 * 1024
    #: Model name in the Compatibility Descriptor (default: the engine's served model name).
    model_name: str | None = None
    #: The largest QUIC datagram the worker's MOQT sessions send (its publications to the relay
    #: above all): None keeps the transport's default (1200, safe on any path); inside a
    #: datacenter or on loopback a larger one costs far fewer packets (docs/transport.md).
    max_datagram_size: int | None = None
    #: Tokens per KVSP block (B of the Block Keys, kvsp-draft §4.2): a multiple of vLLM's block
    #: size (its page), default that page. A KVSP block of m pages is one MOQT track, one FETCH
    #: and one record for m pages: far fewer requests per prefix, at the cost of sharing only
    #: whole blocks (docs/vllm.md "Block size").
    block_tokens: int | None = None
    #: Loads in flight per worker (blocks being fetched): more wait for a free place, bounded
    #: by the request's deadline. The relay caps the requests of one session (binding §9).
    max_loads_in_flight: int = 32
    #: Publications in flight per worker (blocks whose HTTP holder PUT or IS record is under
    #: way, in the background): a block computed while all are taken is kept in the worker's
    #: store and served over MOQT, its record published by the refresh (``publish_dropped``
    #: counts the holder PUTs so skipped).
    max_saves_in_flight: int = 64
    #: The codec loads ask for, per scope and request class (module notes); None: raw.
    codec_policy: CodecPolicy | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise SettingsError(unknown[0], f"unknown key (known: {', '.join(sorted(known))})")
        strings = {k: _opt_str(extra, k) for k in (
            "index_url", "index_token", "relay_url", "moqt_token", "holder_url", "holder_token",
            "fetch_token", "default_scope", "ca_file", "model_name")}
        raw_scopes = extra.get("scopes", {})
        if not isinstance(raw_scopes, Mapping):
            raise SettingsError("scopes", "must be an object of scope name -> hex Scope Key")
        scopes: dict[str, bytes] = {}
        for name, value in raw_scopes.items():
            try:
                scopes[str(name)] = check_scope_key(bytes.fromhex(str(value)))
            except ValueError as exc:
                raise SettingsError("scopes", f"scope {name!r}: {exc}") from None
        default = strings["default_scope"]
        if default is not None and default not in scopes:
            raise SettingsError("default_scope", f"{default!r} is not in scopes")
        salts = _scope_salts(extra.get("scope_salts", {}), scopes)
        relay = strings["relay_url"]
        if relay is not None and not relay.startswith("moqt://"):
            raise SettingsError("relay_url", "must be a moqt:// URL")
        return cls(
            **{k: v for k, v in strings.items() if k != "default_scope"},
            default_scope=default,
            scopes=scopes,
            scope_salts=salts,
            insecure=_bool(extra, "insecure", False),
            load=_bool(extra, "load", True),
            async_loads=_bool(extra, "async_loads", True),
            publish=_bool(extra, "publish", True),
            deadline_ms=_positive(extra, "deadline_ms", 5_000),
            moqt_timeout_ms=_positive(extra, "moqt_timeout_ms", 2_000),
            record_ttl_ms=_positive(extra, "record_ttl_ms", 600_000),
            store_bytes=_positive(extra, "store_bytes", 256 * 1024 * 1024),
            max_datagram_size=_datagram_size(extra),
            block_tokens=_positive(extra, "block_tokens", 0) if "block_tokens" in extra else None,
            max_loads_in_flight=_positive(extra, "max_loads_in_flight", 32),
            max_saves_in_flight=_positive(extra, "max_saves_in_flight", 64),
            codec_policy=_codec_policy(extra.get("codec_policy"), scopes),
        )

    @property
    def enabled(self) -> bool:
        return self.index_url is not None and bool(self.scopes)

    @property
    def deadline_s(self) -> float:
        return self.deadline_ms / 1000

    def scope_of(self, kv_transfer_params: Mapping[str, Any] | None, cache_salt: str | None) -> ScopeChoice:
        """The scope of a request (module notes): selected by the digest of its secret
        ``cache_salt``, else ``default_scope``; nothing the request names selects one."""
        params = kv_transfer_params or {}
        if params.get("kvsp") is False:
            return ScopeChoice(None, "switched off by the request")
        if cache_salt is None or cache_salt == "":
            if self.default_scope is None:
                return ScopeChoice(None, "no cache_salt and no default_scope")
            return ScopeChoice(self.default_scope)
        wanted = salt_digest(cache_salt)
        for digest, scope in self.scope_salts.items():
            if hmac.compare_digest(digest, wanted):
                return ScopeChoice(scope)
        return ScopeChoice(None, "its cache_salt selects no scope")

    def codec_of(self, scope: str, kv_transfer_params: Mapping[str, Any] | None) -> CodecChoice:
        """The codec a request of ``scope`` loads its blocks in (module notes): the policy's
        choice for the scope, or for the request's class where that adds no loss the
        operator did not allow for the scope; raw (``codec`` None) without a policy."""
        if self.codec_policy is None:
            return CodecChoice(None, "no codec_policy: raw")
        sid = scope_id(self.scopes[scope])
        for_scope = self.codec_policy.choose(sid)
        request_class = (kv_transfer_params or {}).get("kvsp_class")
        if not isinstance(request_class, str):
            return for_scope
        for_class = self.codec_policy.choose(sid, request_class)
        if for_class.lossy and not for_scope.lossy:
            return CodecChoice(for_scope.codec, f"{for_scope.reason} (request class {request_class!r} names a lossy "
                                                "codec the operator did not allow for this scope: ignored)")
        return for_class


def _codec_policy(raw: object, scopes: Mapping[str, bytes]) -> CodecPolicy | None:
    """``codec_policy`` ({"scopes": {scope name: codec}, "classes": {class: codec},
    "lossless": codec}) as a :class:`CodecPolicy` over Scope IDs, checked."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SettingsError("codec_policy", "must be an object with scopes, classes and lossless")
    doc = dict(raw)
    named = doc.get("scopes", {})
    if not isinstance(named, Mapping):
        raise SettingsError("codec_policy", "scopes must be an object of scope name -> codec")
    for name in named:
        if name not in scopes:
            raise SettingsError("codec_policy", f"scope {name!r} is not in scopes")
    doc["scopes"] = {scope_id(scopes[name]).hex(): codec for name, codec in named.items()}
    try:
        return CodecPolicy.from_mapping(doc, "codec_policy")
    except RecordError as exc:
        raise SettingsError("codec_policy", str(exc)) from None


def _scope_salts(raw: object, scopes: Mapping[str, bytes]) -> dict[str, str]:
    """``scope_salts`` ({scope: [salt digest, ...]}) as salt digest -> scope, checked."""
    if not isinstance(raw, Mapping):
        raise SettingsError("scope_salts", "must be an object of scope name -> [sha-256:<hex> salt digests]")
    out: dict[str, str] = {}
    for scope, digests in raw.items():
        if scope not in scopes:
            raise SettingsError("scope_salts", f"{scope!r} is not in scopes")
        if isinstance(digests, str) or not isinstance(digests, (list, tuple)) or not digests:
            raise SettingsError("scope_salts", f"scope {scope!r}: must be a non-empty array of salt digests")
        for digest in digests:
            if not isinstance(digest, str) or not digest.startswith("sha-256:") or len(digest) != 72 \
                    or any(c not in "0123456789abcdef" for c in digest[8:]):
                raise SettingsError("scope_salts", f"scope {scope!r}: {digest!r} is not sha-256:<64 lowercase hex> "
                                    "(salt_digest(salt); the salt itself is never configured)")
            if out.get(digest, scope) != scope:
                raise SettingsError("scope_salts", f"one salt selects two scopes ({out[digest]!r}, {scope!r})")
            out[digest] = scope
    return out


def _datagram_size(extra: Mapping[str, Any]) -> int | None:
    value = extra.get("max_datagram_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1200 <= value <= 65527:
        raise SettingsError("max_datagram_size", "must be an integer in [1200, 65527] (QUIC's minimum to UDP's maximum)")
    return value


def _opt_str(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SettingsError(key, "must be a non-empty string")
    return value


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise SettingsError(key, "must be true or false")
    return value


def _positive(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SettingsError(key, "must be a positive integer")
    return value


def connector_extra_config(*, index_url: str, scopes: Mapping[str, bytes], default_scope: str | None = None,
                           scope_salts: Mapping[str, list[str]] | None = None,
                           relay_url: str | None = None, holder_url: str | None = None,
                           index_token: str | None = None, moqt_token: str | None = None,
                           holder_token: str | None = None, ca_file: str | None = None,
                           **more: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for a cluster (JSON-ready: Scope Keys as hex); ``more``
    passes any other key of :class:`ConnectorSettings`. Checked by ``from_extra``."""
    extra: dict[str, Any] = {
        "index_url": index_url, "relay_url": relay_url, "holder_url": holder_url,
        "index_token": index_token, "moqt_token": moqt_token, "holder_token": holder_token,
        "ca_file": ca_file, "scopes": {name: key.hex() for name, key in scopes.items()},
        "default_scope": default_scope, "scope_salts": dict(scope_salts) if scope_salts else None, **more,
    }
    extra = {k: v for k, v in extra.items() if v is not None}
    ConnectorSettings.from_extra(extra)
    return extra


def kv_transfer_config(extra: Mapping[str, Any], *, kv_role: str = "kv_both",
                       kv_load_failure_policy: str = "recompute") -> dict[str, Any]:
    """The ``KVTransferConfig`` fields that load the KVSP connector: pass the dict to
    ``KVTransferConfig(**d)`` or, as JSON, to ``vllm serve --kv-transfer-config``."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": dict(extra),
    }
