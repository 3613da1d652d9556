"""Settings of the inference engine an instance runs (``[instance.engine]``; docs/http-api.md
"Inference Instance", "Generation").

Pure: no torch, no I/O beyond reading the scope key files named in the configuration. The
engine itself (:mod:`.engine`) imports the model only when it is built, so an instance without
``[instance.engine]`` never imports torch.

```toml
[instance.engine]
model_dir = "/var/lib/kvsp/model/kvsp-ref-tiny-1"   # default: ensure_model_files' directory
block_tokens = 64                                  # B of the Compatibility Descriptor (§4.1)
device = "cpu"                                     # or "cuda", "cuda:1"
torch_threads = 1                                  # 0: leave torch's default
relay_url = "moqt://relay.rack7.example:4443/moq"  # publish computed blocks here over MOQT
ca_file = "relay-ca.pem"                           # its trust anchors (default: [tls] ca_file)
holder_url = "https://h1.example/kvsp/"            # and PUT them here over HTTP
scope_key_files = ["shared-prompts.key"]           # hex of >= 32 octets each (§4.2)
moqt_timeout_s = 10.0                              # per MOQT request, whole
moqt_idle_timeout_s = 2.0                          # per MOQT request, without an octet
index_timeout_s = 2.0                              # each IS call (lookup: then recompute; records)
moqt_keepalive_s = 5.0                             # liveness PING of the MOQT sessions (0: off)
moqt_liveness_timeout_s = 5.0                      # a PING unacknowledged this long: session lost
moqt_reconnect_initial_s = 0.1                     # reconnect backoff, doubling per failure
moqt_reconnect_max_s = 5.0                         # up to this

[instance.engine.moqt_limits]    # what a relay / holder may make each MOQT session hold
max_object_size = 67108864       # pubsub/limits.py ReceiveLimits; every key optional,
max_buffered_bytes = 268435456   # integers >= 0, defaults shown (docs/security.md)
max_queued_objects = 65536
preallocate = 16384
max_namespace_updates = 4096
max_peer_namespaces = 4096
max_incoming_publishes = 1024
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ...kvsp.scope import scope_id as derive_scope_id
from ...pubsub.limits import DEFAULT_RECEIVE_LIMITS, ReceiveLimits
from ...pubsub.liveness import Reconnect
from .errors import ConfigError

__all__ = ["EngineConfig", "engine_config_from_mapping", "read_scope_key", "receive_limits_from_mapping"]

#: The least number of octets of a Scope Key (§4.2 "at least 32 random octets").
MIN_SCOPE_KEY_OCTETS = 32


@dataclass(frozen=True)
class EngineConfig:
    """What the engine loads and where it publishes (see the module notes)."""

    #: The reference model's files (``kvsp_moq.model.ensure_model_files``); None: the default
    #: directory (``$KVSP_MODEL_DIR/<name>``, else the user cache).
    model_dir: str | None = None
    block_tokens: int = 64
    device: str = "cpu"
    #: torch intra-op threads (process-wide); 0 leaves torch's default.
    torch_threads: int = 1
    #: A ``moqt://`` relay the instance publishes its computed blocks through (binding v1), and
    #: from which it loads blocks the IS lists under ``moqt://`` holders.
    relay_url: str | None = None
    #: An HTTP holder the computed blocks are stored at (``PUT blocks/...``, §6.7).
    holder_url: str | None = None
    #: Scope keys (§4.2), by Scope ID: the scopes this instance computes Block Keys for.
    scope_keys: Mapping[bytes, bytes] = field(default_factory=dict)
    #: Longest output of one request, and seconds per MOQT request (TRACK_STATUS, FETCH).
    max_tokens: int = 4096
    moqt_timeout_s: float = 10.0
    #: Seconds a MOQT request (a FETCH, TRACK_STATUS) may go without receiving an octet before
    #: it is abandoned and the load moves on to the next source (a stalled holder or relay,
    #: one that died without closing: docs/reliability.md). At most ``moqt_timeout_s``.
    moqt_idle_timeout_s: float = 2.0
    #: Seconds each call of the request path to the IS may take: the lookup (§6.2) — an IS
    #: that does not answer in time, or cannot be reached, is a miss: the prompt is recomputed —
    #: and the publication of a record (§6.1) the answer waits for — one not acknowledged in
    #: time is retried by the refresh of its publisher, the answer goes out without it.
    index_timeout_s: float = 2.0
    #: TLS of the MOQT connections (the relay, ``moqt://`` holders), which carry the instance's
    #: token (binding §9): the server certificate is verified against ``ca_file`` (None: the
    #: ``[tls] ca_file``, else the system trust store) unless ``insecure`` (None: ``[tls]
    #: insecure``; an explicit opt-in, logged; refused for a relay other than loopback unless
    #: ``[tls] allow_insecure_remote``). Integrity rests on the layer digests either way (§6.7);
    #: TLS keeps the token and the blocks confidential (docs/security.md).
    ca_file: str | None = None
    insecure: bool | None = None
    #: TTL of the Replica Records the engine publishes for the MOQT replicas it serves (§6.1).
    record_ttl_ms: int = 60_000
    #: What a relay or holder may make each of the engine's MOQT sessions hold (its load pool,
    #: its holder's relay session, the prefetch loads): ``[instance.engine.moqt_limits]``.
    moqt_limits: ReceiveLimits = DEFAULT_RECEIVE_LIMITS
    #: A relay that dies or restarts (docs/reliability.md "Relays"): every MOQT session of the
    #: engine (its load pool, its holder's relay session) is PINGed every ``moqt_keepalive_s``
    #: seconds (0: never) and closed when a PING is not acknowledged within
    #: ``moqt_liveness_timeout_s``; a lost relay session is connected again after
    #: ``moqt_reconnect_initial_s``, the wait doubling per failure up to ``moqt_reconnect_max_s``
    #: (the pool does not try a URL whose connect failed again before that wait).
    moqt_keepalive_s: float = 5.0
    moqt_liveness_timeout_s: float = 5.0
    moqt_reconnect_initial_s: float = 0.1
    moqt_reconnect_max_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.moqt_limits, ReceiveLimits):
            raise ConfigError("instance.engine.moqt_limits", "must be a table")
        for name, minimum in (("block_tokens", 1), ("torch_threads", 0), ("max_tokens", 1), ("record_ttl_ms", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"instance.engine.{name}", f"must be an integer >= {minimum}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError("instance.engine.device", 'must be "cpu", "cuda" or "cuda:N"')
        if self.relay_url is not None and (not isinstance(self.relay_url, str) or not self.relay_url.startswith("moqt://")):
            raise ConfigError("instance.engine.relay_url", "must be a moqt:// URL")
        if self.holder_url is not None and (
            not isinstance(self.holder_url, str) or "://" not in self.holder_url or not self.holder_url.endswith("/")
        ):
            raise ConfigError("instance.engine.holder_url", "must be an absolute URL ending in '/'")
        if self.ca_file is not None and not isinstance(self.ca_file, str):
            raise ConfigError("instance.engine.ca_file", "must be a file name")
        if self.insecure is not None and not isinstance(self.insecure, bool):
            raise ConfigError("instance.engine.insecure", "must be true or false")
        for name in ("moqt_timeout_s", "moqt_idle_timeout_s", "index_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"instance.engine.{name}", "must be a number > 0")
        for name, low in (("moqt_keepalive_s", 0.0), ("moqt_liveness_timeout_s", None),
                          ("moqt_reconnect_initial_s", None), ("moqt_reconnect_max_s", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (value < low if low is not None else value <= 0):
                raise ConfigError(f"instance.engine.{name}", "must be a number >= 0" if low is not None else "must be a number > 0")
        if self.moqt_reconnect_initial_s > self.moqt_reconnect_max_s:
            raise ConfigError("instance.engine.moqt_reconnect_initial_s", "must be <= moqt_reconnect_max_s")

    @property
    def moqt_reconnect(self) -> Reconnect:
        """The liveness probe and reconnect backoff of the engine's MOQT sessions."""
        return Reconnect(keepalive=self.moqt_keepalive_s, liveness_timeout=self.moqt_liveness_timeout_s,
                         backoff_initial=self.moqt_reconnect_initial_s, backoff_max=self.moqt_reconnect_max_s)

    def scope_key(self, scope_id: bytes) -> bytes | None:
        return self.scope_keys.get(scope_id)


def read_scope_key(path: Path, key: str) -> bytes:
    """A Scope Key file: hex digits (whitespace ignored) of at least 32 octets (§4.2)."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        secret = bytes.fromhex("".join(text.split()))
    except ValueError:
        raise ConfigError(key, f"{path}: must hold the scope key in hex") from None
    if len(secret) < MIN_SCOPE_KEY_OCTETS:
        raise ConfigError(key, f"{path}: a scope key has at least {MIN_SCOPE_KEY_OCTETS} octets (§4.2), got {len(secret)}")
    return secret


def engine_config_from_mapping(section: object, base_dir: Path) -> EngineConfig:
    """``[instance.engine]`` as decoded from TOML; paths are relative to ``base_dir``."""
    if not isinstance(section, dict):
        raise ConfigError("instance.engine", "must be a table")
    known = {f.name for f in fields(EngineConfig)} - {"scope_keys"} | {"scope_key_files"}
    unknown = set(section) - known
    if unknown:
        raise ConfigError(f"instance.engine.{sorted(unknown)[0]}", "unknown key")
    values: dict[str, Any] = dict(section)
    if "moqt_limits" in values:
        values["moqt_limits"] = receive_limits_from_mapping(values["moqt_limits"], "instance.engine.moqt_limits")
    files = values.pop("scope_key_files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigError("instance.engine.scope_key_files", "must be an array of file names")
    keys: dict[bytes, bytes] = {}
    for i, name in enumerate(files):
        secret = read_scope_key(base_dir / name, f"instance.engine.scope_key_files[{i}]")
        keys[derive_scope_id(secret)] = secret
    for name in ("model_dir", "ca_file"):
        if isinstance(values.get(name), str):
            values[name] = str(base_dir / values[name])
    if values.get("ca_file") is not None and not Path(values["ca_file"]).is_file():
        raise ConfigError("instance.engine.ca_file", f"{values['ca_file']}: no such file")
    return EngineConfig(**values, scope_keys=keys)


def receive_limits_from_mapping(section: object, key: str) -> ReceiveLimits:
    """A ``ReceiveLimits`` table (``[instance.engine.moqt_limits]``): its keys are the fields of
    :class:`~kvsp_moq.pubsub.limits.ReceiveLimits`, each an integer >= 0; absent ones keep
    their default."""
    if not isinstance(section, dict):
        raise ConfigError(key, "must be a table")
    names = {f.name for f in fields(ReceiveLimits)}
    unknown = set(section) - names
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown key")
    for name, value in section.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key}.{name}", "must be an integer >= 0")
    return ReceiveLimits(**section)
