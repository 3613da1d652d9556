"""Configuration of the control-plane servers: one TOML file (docs/http-api.md "Configuration").

```toml
[index]                      # the Index Service; every key optional
base_path = "/"              # the IS base: routes are {base_path}lookup, ...
max_ttl_ms = 600000          # cap on a replica record's ttl_ms (§6.1)
max_status_ttl_ms = 60000    # cap on an instance status record's ttl_ms (§6.3)
max_body_octets = 5242880    # larger request bodies get 413
max_block_keys = 65536       # cap on block_keys in one lookup (§6.2)
max_batch_records = 1000     # cap on the records of one POST {base_path}replicas:batch (ours)
purge_interval_ms = 5000     # how often expired records are reclaimed (0: never)
max_descriptors = 1024       # cap on registered Compatibility Descriptors
descriptors = ["model.json"] # descriptor files (JSON, §4.1), relative to this file
store = "memory"             # or "redis://HOST:PORT/DB", "redis+cluster://HOST:PORT,..." (also in [holder], [pc], [frontend]):
                             # see common/store.py for store_password_file, store_timeout_ms, ...

[holder]                     # the holder (docs/http-api.md "Holder"); every key optional
base_path = "/"              # routes are {base_path}blocks/..., {base_path}leases
url = "https://h1.example/kvsp/"  # the holder URL written in Replica Records (default: the bound address)
index_url = "https://is.example/" # the IS to publish to (none: no publication)
index_token = "..."          # bearer token presented to the IS
record_ttl_ms = 60000        # ttl_ms asked for published Replica Records (§6.1)
max_lease_ttl_ms = 60000     # per-client quota on a lease's TTL (§6.6)
max_leased_octets = 4294967296   # per-client quota on leased octets (§6.6)
tiers = [{kind = "host", capacity = 1073741824}]
moqt_relays = ["moqt://relay.rack7.example:4443/moq"]  # also publish over MOQT there (none: HTTP only)
moqt_token = "..."           # AUTHORIZATION_TOKEN in SETUP to the relays (binding §9)

[[principals]]               # see kvsp_moq/control/common/auth.py
name = "holder-h1"
token = "..."                # or token_sha256 = "<hex of SHA-256(token)>"
scopes = ["<hex16>"]         # or ["*"]
holders = ["https://h1.example/kvsp/"]
instances = []
```

Unknown keys are errors: a misspelt limit or grant must not pass silently.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from ...kvsp.codecs.policy import CodecPolicy
from ...kvsp.compat import validate_descriptor
from ...kvsp.errors import DescriptorError, RecordError
from ...pubsub.liveness import Reconnect
from .auth import Authorizer
from .engine_config import EngineConfig, engine_config_from_mapping
from .errors import ConfigError
from .tls import TlsConfig, tls_config_from_mapping, with_transport_section
from .store import DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT_MS, StoreSpec, parse_store

MiB = 1 << 20


@dataclass(frozen=True)
class StoreSettings:
    """The store keys every stateful role section has (``common/store.py``, DESIGN.md §8):
    where the role's state lives, "memory" (the embedded default) or a redis:// / rediss://
    URL; the password may come from a file; every call is bounded. ``SECTION`` names the
    section in errors."""

    SECTION: ClassVar[str] = ""
    store: str = "memory"
    store_password_file: str | None = None
    store_timeout_ms: int = DEFAULT_TIMEOUT_MS
    store_key_prefix: str = DEFAULT_KEY_PREFIX
    store_wait_replicas: int | None = None  # None: 1 on a cluster, 0 on one Redis

    @property
    def store_spec(self) -> StoreSpec:
        """The validated ``store`` setting."""
        return parse_store(self.SECTION, self.store, password_file=self.store_password_file,
                           timeout_ms=self.store_timeout_ms, key_prefix=self.store_key_prefix,
                           wait_replicas=self.store_wait_replicas)


@dataclass(frozen=True)
class IndexConfig(StoreSettings):
    """Limits and settings of the Index Service (§6.1, §6.2)."""

    SECTION: ClassVar[str] = "index"

    base_path: str = "/"
    max_ttl_ms: int = 600_000
    max_status_ttl_ms: int = 60_000
    max_body_octets: int = 5 * MiB
    max_block_keys: int = 65_536
    max_batch_records: int = 1_000
    purge_interval_ms: int = 5_000
    max_descriptors: int = 1_024
    #: Validated descriptor documents (§4.1), loaded from the files named in the TOML.
    descriptors: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    #: ``GET {base_path}metrics`` without a bearer token (docs/metrics.md); default: any principal's.
    metrics_public: bool = False

    def __post_init__(self) -> None:
        self.store_spec  # validates the store keys (ConfigError names the one at fault)
        if not (self.base_path.startswith("/") and self.base_path.endswith("/")):
            raise ConfigError("index.base_path", "must start and end with '/'")
        _check_bool("index", self, "metrics_public")
        for name, minimum in (
            ("max_ttl_ms", 1),
            ("max_status_ttl_ms", 1),
            ("max_body_octets", 1024),
            ("max_block_keys", 1),
            ("max_batch_records", 1),
            ("purge_interval_ms", 0),
            ("max_descriptors", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"index.{name}", f"must be an integer >= {minimum}")


#: Tier kinds a holder configuration may name, fastest first.
TIER_KINDS = ("device", "host", "disk")
_TIER_KEYS = frozenset({"kind", "name", "capacity", "path", "read_mbit_per_s", "device"})


@dataclass(frozen=True)
class TierConfig:
    """One storage tier of a holder (``kind`` device, host or disk; ``path`` for disk)."""

    kind: str
    capacity: int
    name: str | None = None
    path: str | None = None
    read_mbit_per_s: float | None = None
    device: str | None = None  # device tier: torch device ("cuda:0"; default: the tier's choice)

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ConfigError("holder.tiers.kind", f"must be one of {', '.join(TIER_KINDS)}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 0:
            raise ConfigError("holder.tiers.capacity", "must be an integer >= 0")
        if (self.kind == "disk") != (self.path is not None):
            raise ConfigError("holder.tiers.path", "required for a disk tier, and only for one")


@dataclass(frozen=True)
class HolderConfig(StoreSettings):
    """Settings, limits and quotas of the holder (§6.1, §6.6, §6.7)."""

    SECTION: ClassVar[str] = "holder"

    base_path: str = "/"
    #: The holder URL written in Replica Records and used by clients to reach the holder;
    #: ``None``: the address the server binds (``http://host:port{base_path}``).
    url: str | None = None
    #: Base URL of the Index Service the holder publishes to; ``None``: no publication.
    index_url: str | None = None
    index_token: str | None = None
    record_ttl_ms: int = 60_000
    #: §6.1: a file listing the Replica Records the holder may have at the IS, so that a
    #: restart withdraws those of the replicas it lost (client/journal.py); none: they stay
    #: listed until their TTL.
    records_journal: str | None = None
    #: How often records are refreshed; 0: a third of ``record_ttl_ms``.
    refresh_interval_ms: int = 0
    #: First retry delay of a failed withdrawal (doubles up to ``withdraw_retry_max_ms``).
    withdraw_retry_ms: int = 200
    withdraw_retry_max_ms: int = 10_000
    #: Largest container a PUT may carry (413 above).
    max_block_octets: int = 256 * MiB
    #: Largest JSON body (lease requests).
    max_body_octets: int = 1 * MiB
    #: Per-client quotas (§6.6): lease TTL, leased octets, number of live leases.
    max_lease_ttl_ms: int = 60_000
    max_leased_octets: int = 4096 * MiB
    max_leases: int = 1024
    max_lease_keys: int = 4096
    #: Octets per write when streaming a block response.
    chunk_octets: int = 256 * 1024
    tiers: tuple[TierConfig, ...] = (TierConfig("host", 1024 * MiB),)
    #: ``GET {base_path}metrics`` without a bearer token (docs/metrics.md); default: any principal's.
    metrics_public: bool = False
    #: ``moqt://`` relays the holder publishes its replicas through (binding v1 §8, §10): each
    #: replica's namespace is announced there (PUBLISH_NAMESPACE) and a Replica Record naming
    #: the relay goes to the IS beside the HTTP one; none: HTTP only.
    moqt_relays: tuple[str, ...] = ()
    #: The AUTHORIZATION_TOKEN sent in SETUP to the relays: a principal allowed to publish the
    #: scopes (binding §9); none: no token.
    moqt_token: str | None = None
    #: TLS of the relay connections: verified against ``moqt_ca_file`` (None: ``[tls] ca_file``,
    #: else the system store) unless ``moqt_insecure`` (None: ``[tls] insecure``).
    moqt_ca_file: str | None = None
    moqt_insecure: bool | None = None
    #: How long a replica's record waits for the relays' answer to its PUBLISH_NAMESPACE (a
    #: relay that does not answer in time gets the record at a later refresh), and a relay
    #: connection attempt.
    moqt_timeout_ms: int = 5_000
    #: Descriptor documents (§4.1) of the compats whose blocks the holder may transcode for
    #: ``GET ...?codec=n`` (§6.7 "a holder MAY transcode"; holder/transcode.py), loaded from
    #: the files named in the TOML; none: only the stored codec is served.
    descriptors: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    #: Bound on the transcoded containers the holder keeps for later GETs (octets).
    transcode_cache_octets: int = 256 * MiB
    #: The relay sessions' liveness PING period (0: none) and deadline, and the reconnect
    #: backoff after a session is lost (the first wait, doubling up to the max): ms, as
    #: ``[instance.engine]``'s ``moqt_keepalive_s`` ... (pubsub/liveness.py ``Reconnect``).
    moqt_keepalive_ms: int = 5_000
    moqt_liveness_timeout_ms: int = 5_000
    moqt_reconnect_initial_ms: int = 100
    moqt_reconnect_max_ms: int = 5_000

    @property
    def moqt_reconnect(self) -> Reconnect:
        """The liveness probe and reconnect backoff of the relay sessions."""
        return Reconnect(keepalive=self.moqt_keepalive_ms / 1000, liveness_timeout=self.moqt_liveness_timeout_ms / 1000,
                         backoff_initial=self.moqt_reconnect_initial_ms / 1000,
                         backoff_max=self.moqt_reconnect_max_ms / 1000)

    def __post_init__(self) -> None:
        self.store_spec  # validates the store keys (ConfigError names the one at fault)
        if not (self.base_path.startswith("/") and self.base_path.endswith("/")):
            raise ConfigError("holder.base_path", "must start and end with '/'")
        _check_bool("holder", self, "metrics_public")
        relays = self.moqt_relays
        if not isinstance(relays, tuple) or not all(isinstance(u, str) and u.startswith("moqt://") for u in relays):
            raise ConfigError("holder.moqt_relays", "must be an array of moqt:// URLs")
        for name in ("moqt_token", "moqt_ca_file", "records_journal"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"holder.{name}", "must be a string")
        if self.moqt_insecure is not None and not isinstance(self.moqt_insecure, bool):
            raise ConfigError("holder.moqt_insecure", "must be true or false")
        _check_ints("holder", self, (("moqt_timeout_ms", 1), ("moqt_keepalive_ms", 0), ("moqt_liveness_timeout_ms", 1),
                                     ("moqt_reconnect_initial_ms", 1), ("moqt_reconnect_max_ms", 1)))
        if self.moqt_reconnect_initial_ms > self.moqt_reconnect_max_ms:
            raise ConfigError("holder.moqt_reconnect_initial_ms", "must be <= moqt_reconnect_max_ms")
        for name in ("url", "index_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value or not value.endswith("/")):
                raise ConfigError(f"holder.{name}", "must be an absolute URL ending in '/'")
        if self.index_token is not None and not isinstance(self.index_token, str):
            raise ConfigError("holder.index_token", "must be a string")
        for name, minimum in (
            ("record_ttl_ms", 1),
            ("refresh_interval_ms", 0),
            ("withdraw_retry_ms", 1),
            ("withdraw_retry_max_ms", 1),
            ("max_block_octets", 64),
            ("max_body_octets", 1024),
            ("max_lease_ttl_ms", 1),
            ("max_leased_octets", 0),
            ("max_leases", 0),
            ("max_lease_keys", 1),
            ("chunk_octets", 1024),
            ("transcode_cache_octets", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"holder.{name}", f"must be an integer >= {minimum}")
        if not self.tiers:
            raise ConfigError("holder.tiers", "at least one tier is required")

    @property
    def refresh_ms(self) -> int:
        """The refresh period of published records: well before they expire (§6.1)."""
        return self.refresh_interval_ms or max(1, self.record_ttl_ms // 3)


def _check_ints(section: str, obj: object, minimums: tuple[tuple[str, int], ...]) -> None:
    for name, minimum in minimums:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{section}.{name}", f"must be an integer >= {minimum}")


def _check_bool(section: str, obj: object, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        raise ConfigError(f"{section}.{name}", "must be true or false")


def _check_url(section: str, name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or "://" not in value or not value.endswith("/")):
        raise ConfigError(f"{section}.{name}", "must be an absolute URL ending in '/'")


def _check_pc_urls(section: str, config: object) -> None:
    """``pc_urls`` (a TOML array becomes a tuple) and ``pc_failover_ms`` of a PC client."""
    urls = getattr(config, "pc_urls")
    if not isinstance(urls, (list, tuple)) or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"{section}.pc_urls", "must be an array of URLs")
    for url in urls:
        _check_url(section, "pc_urls", url)
    object.__setattr__(config, "pc_urls", tuple(urls))
    _check_ints(section, config, (("pc_failover_ms", 1),))


def pc_targets(pc_url: str | None, pc_urls: tuple[str, ...]) -> tuple[str, ...]:
    """Every PC a client may call: ``pc_url`` first, then ``pc_urls`` (each once)."""
    return tuple(dict.fromkeys(((pc_url,) if pc_url else ()) + pc_urls))


def _check_base_path(section: str, value: object) -> None:
    if not isinstance(value, str) or not (value.startswith("/") and value.endswith("/")):
        raise ConfigError(f"{section}.base_path", "must start and end with '/'")


#: Sleep policies of the PC (§6.3 "The PC answers ... to accept, or ... to refuse").
SLEEP_POLICIES = ("min-active", "always", "never")


@dataclass(frozen=True)
class PcConfig(StoreSettings):
    """Settings of the Placement Controller (§6.3, §6.4, §6.5; docs/http-api.md "Placement Controller")."""

    SECTION: ClassVar[str] = "pc"

    base_path: str = "/"
    #: The IS the PC looks up (§6.2, with targets) and feeds with the statuses it receives.
    index_url: str | None = None
    index_token: str | None = None
    #: Bearer token the PC presents to instances (``PUT state``, ``POST prefetch``).
    instance_token: str | None = None
    #: Bearer token the PC presents to front ends (``POST {fe}sessions/{id}/failed``, §6.8);
    #: its principal there needs the sessions' scopes. None: ``instance_token``.
    front_end_token: str | None = None
    max_status_ttl_ms: int = 60_000
    max_body_octets: int = 1 * MiB
    #: §6.4 ``wait_us = queued * mean service time``: the mean service time, in µs.
    mean_service_us: int = 1_000_000
    #: Acceptable cost (§6.4 "no active instance has acceptable cost"): 0 = any cost.
    max_cost_us: int = 0
    #: Capacity (§6.4): an instance with more queued requests, or a higher kv_utilization, is full.
    max_queued: int = 1_000_000
    max_kv_utilization: float = 1.0
    #: ``min-active`` (accept while another instance stays active), ``always``, ``never``.
    sleep_policy: str = "min-active"
    min_active: int = 1
    #: deadline_ms and lease_ms of the prefetch directives the PC sends (§6.5).
    prefetch_deadline_ms: int = 1_000
    prefetch_lease_ms: int = 5_000
    #: §6.8: sessions the PC tracks, and how often it also looks for failed instances on its
    #: clock (0: only when an active instance reports, on ``POST failures`` and on restarts).
    max_sessions: int = 65_536
    failure_check_ms: int = 0
    #: §6.9: deadline_ms of the reshard plans it sends, unless the request names one.
    reshard_deadline_ms: int = 5_000
    #: Active/standby over a shared (redis://) store: the leader lock's lease; the active PC
    #: renews it every third of it, a standby takes over within about 4/3 of it (pc/leader.py).
    leader_lease_ms: int = 3_000
    #: ``GET {base_path}metrics`` without a bearer token (docs/metrics.md); default: any principal's.
    metrics_public: bool = False

    def __post_init__(self) -> None:
        self.store_spec  # validates the store keys (ConfigError names the one at fault)
        _check_base_path("pc", self.base_path)
        _check_bool("pc", self, "metrics_public")
        _check_url("pc", "index_url", self.index_url)
        for name in ("index_token", "instance_token", "front_end_token"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"pc.{name}", "must be a string")
        _check_ints("pc", self, (
            ("max_status_ttl_ms", 1), ("max_body_octets", 1024), ("mean_service_us", 0), ("max_cost_us", 0),
            ("max_queued", 0), ("min_active", 0), ("prefetch_deadline_ms", 1), ("prefetch_lease_ms", 1),
            ("max_sessions", 1), ("failure_check_ms", 0), ("reshard_deadline_ms", 1), ("leader_lease_ms", 30),
        ))
        if isinstance(self.max_kv_utilization, bool) or not isinstance(self.max_kv_utilization, (int, float)) or not 0 <= self.max_kv_utilization <= 1:
            raise ConfigError("pc.max_kv_utilization", "must be a number in [0, 1]")
        if self.sleep_policy not in SLEEP_POLICIES:
            raise ConfigError("pc.sleep_policy", f"must be one of {', '.join(SLEEP_POLICIES)}")


@dataclass(frozen=True)
class LinkConfig:
    """A link the instance reports (§4.4 ``links``): holder, rate and round-trip time."""

    holder: str
    mbit_per_s: float
    rtt_us: float = 0.0


@dataclass(frozen=True)
class InstanceConfig:
    """Settings of an inference instance (§6.3, §6.5; docs/http-api.md "Inference Instance")."""

    base_path: str = "/"
    #: The instance URL (status records, the holder of its replicas); default: the bound address.
    url: str | None = None
    pc_url: str | None = None
    #: Several PCs (active/standby, pc/leader.py): the client tries them in turn, for up to
    #: pc_failover_ms per call, on a refused connection, a timeout or 503 kvsp-not-leader.
    pc_urls: tuple[str, ...] = ()
    pc_failover_ms: int = 10_000
    index_url: str | None = None
    #: The instance's bearer token at the PC, the IS and the holders.
    token: str | None = None
    #: §6.3: the status record's ttl_ms; reports go out every report_interval_ms (<= ttl/3).
    status_ttl_ms: int = 3_000
    report_interval_ms: int = 0
    #: §6.3 epoch: a file holding a counter incremented at each start; none: start time in ms.
    epoch_file: str | None = None
    #: §6.1: a file listing the Replica Records this instance may have at the IS, so that a
    #: restart withdraws those of the replicas it lost (client/journal.py); none: they stay
    #: listed until their TTL.
    records_journal: str | None = None
    #: §6.3 "MAY ask to sleep": idle (nothing running or queued) this long; 0 = never ask.
    sleep_after_idle_ms: int = 0
    record_ttl_ms: int = 60_000
    max_body_octets: int = 1 * MiB
    max_directives: int = 1024
    #: §6.5 directives running at once; a new one beyond it is refused (429 kvsp-overloaded).
    max_running_directives: int = 64
    #: §6.5: blocks of one prefetch directive retrieved at once (round trips overlap).
    prefetch_blocks_in_flight: int = 4
    max_sessions: int = 1024
    #: What the instance reports of itself (§4.4).
    batch_size: int = 32
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 1_000.0
    links: tuple[LinkConfig, ...] = ()
    tiers: tuple[TierConfig, ...] = (TierConfig("host", 1024 * MiB),)
    #: §6.8 "at least every 64 output tokens": a checkpoint after this many tokens without one.
    checkpoint_every: int = 64
    #: One checkpoint (or ``session_done``) call to the PC gives up after this long; a PC that
    #: does not acknowledge in time is skipped and the session generates on (docs/reliability.md).
    checkpoint_timeout_ms: int = 10_000
    #: How long a session retries a delivery to its front end, and the last checkpoint of a
    #: non-deterministic sampler, with a growing pause (0.1 s doubling to 2 s) before failing.
    delivery_deadline_ms: int = 15_000
    #: ``[instance.engine]``: the reference-model engine serving ``POST generate`` (none: the
    #: instance runs only its control plane). See ``common/engine_config.py``.
    engine: EngineConfig | None = None
    #: Who runs the §6.8 sessions the PC starts and resumes: ``"model"`` — the reference model of
    #: ``[instance.engine]`` (``instance/model_sessions.py``; without an engine, sessions are refused) —
    #: or ``"none"`` (refused with 409). Used by ``kvsp instance`` (``instance/serve.py``).
    session_engine: str = "model"
    #: A model session gives up loading its context's blocks after this long (a hung holder)
    #: and recomputes them instead (``instance/model_sessions.py``).
    session_load_timeout_ms: int = 10_000
    #: HTTP block retrieval (§6.7): a holder silent this long (connecting, or mid-body) fails
    #: that replica, and the next replica is tried (``client.http.HttpBlockFetcher``).
    block_read_timeout_ms: int = 5_000
    #: ``GET {base_path}metrics`` without a bearer token (docs/metrics.md); default: any principal's.
    metrics_public: bool = False
    #: ``[instance.codec_policy]``: the codec prefetch loads blocks in, per scope (lossy codecs
    #: only where configured, ``kvsp/codecs/policy.py``); default: the replica's codec.
    codec_policy: CodecPolicy = field(default_factory=CodecPolicy)

    def __post_init__(self) -> None:
        _check_base_path("instance", self.base_path)
        _check_bool("instance", self, "metrics_public")
        if self.session_engine not in ("model", "none"):
            raise ConfigError("instance.session_engine", 'must be "model" or "none"')
        for name in ("url", "pc_url", "index_url"):
            _check_url("instance", name, getattr(self, name))
        _check_pc_urls("instance", self)
        for name in ("epoch_file", "records_journal"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"instance.{name}", "must be a string (a file path)")
        _check_ints("instance", self, (
            ("status_ttl_ms", 3), ("report_interval_ms", 0), ("sleep_after_idle_ms", 0), ("record_ttl_ms", 1),
            ("max_body_octets", 1024), ("max_directives", 1), ("max_running_directives", 1), ("prefetch_blocks_in_flight", 1), ("max_sessions", 1), ("batch_size", 0),
            ("checkpoint_every", 1), ("session_load_timeout_ms", 1), ("block_read_timeout_ms", 1),
            ("checkpoint_timeout_ms", 1), ("delivery_deadline_ms", 1),
        ))
        if self.checkpoint_every > 64:
            raise ConfigError("instance.checkpoint_every", "must be at most 64 (§6.8 at least every 64 output tokens)")
        if not self.tiers:
            raise ConfigError("instance.tiers", "at least one tier is required")

    @property
    def report_ms(self) -> int:
        """The report period: at most a third of status_ttl_ms (§6.3 MUST-like "no longer than")."""
        third = self.status_ttl_ms // 3
        return min(self.report_interval_ms, third) if self.report_interval_ms else third


@dataclass(frozen=True)
class FrontEndConfig(StoreSettings):
    """Settings of the front end (§6.8; docs/http-api.md "Front end")."""

    SECTION: ClassVar[str] = "frontend"

    base_path: str = "/"
    #: The front end's URL, sent to the PC as where output tokens go; default: the bound address.
    url: str | None = None
    #: The PC that places the sessions clients start, and the token presented to it.
    pc_url: str | None = None
    pc_token: str | None = None
    #: Several PCs (active/standby), as ``[instance] pc_urls``; ``pc_failover_ms`` per call.
    pc_urls: tuple[str, ...] = ()
    pc_failover_ms: int = 10_000
    max_body_octets: int = 1 * MiB
    max_sessions: int = 65_536
    #: Out-of-order tokens buffered per session: an index this far beyond the next one is refused.
    max_ahead: int = 4_096
    #: How long a session's output is kept in a Redis store after its registration (seconds).
    retain_s: int = 24 * 3600
    #: ``GET {base_path}metrics`` without a bearer token (docs/metrics.md); default: any principal's.
    metrics_public: bool = False

    def __post_init__(self) -> None:
        self.store_spec  # validates the store keys (ConfigError names the one at fault)
        _check_base_path("frontend", self.base_path)
        _check_bool("frontend", self, "metrics_public")
        for name in ("url", "pc_url"):
            _check_url("frontend", name, getattr(self, name))
        _check_pc_urls("frontend", self)
        if self.pc_token is not None and not isinstance(self.pc_token, str):
            raise ConfigError("frontend.pc_token", "must be a string")
        _check_ints("frontend", self, (("max_body_octets", 1024), ("max_sessions", 1), ("max_ahead", 1),
                                       ("retain_s", 1)))


@dataclass(frozen=True)
class ControlConfig:
    """A whole configuration file: the principals and each role's section."""

    auth: Authorizer
    index: IndexConfig = IndexConfig()
    holder: HolderConfig = HolderConfig()
    pc: PcConfig = PcConfig()
    instance: InstanceConfig = InstanceConfig()
    frontend: FrontEndConfig = FrontEndConfig()
    #: ``[tls]`` (``common/tls.py``): trust anchors and opt-outs of every client, HTTPS serving.
    tls: TlsConfig = TlsConfig()

    def __post_init__(self) -> None:
        # docs/security.md: no bearer token to a non-loopback http:// URL, nor over unverified MOQT.
        ic, fc = self.instance, self.frontend
        for key, url, token in (
            ("holder.index_url", self.holder.index_url, self.holder.index_token),
            ("pc.index_url", self.pc.index_url, self.pc.index_token),
            ("instance.index_url", ic.index_url, ic.token),
            *((("instance.pc_url" if u == ic.pc_url else "instance.pc_urls"), u, ic.token)
              for u in pc_targets(ic.pc_url, ic.pc_urls)),
            ("instance.engine.holder_url", ic.engine.holder_url if ic.engine else None, ic.token),
            *((("frontend.pc_url" if u == fc.pc_url else "frontend.pc_urls"), u, fc.pc_token)
              for u in pc_targets(fc.pc_url, fc.pc_urls)),
        ):
            self.tls.check_token_url(key, url, token)
        if ic.engine is not None:
            self.tls.check_moqt_token("instance.engine.relay_url", ic.engine.relay_url, ic.token, ic.engine.insecure)
        for url in self.holder.moqt_relays:
            self.tls.check_moqt_token("holder.moqt_relays", url, self.holder.moqt_token, self.holder.moqt_insecure)


def load_config(path: str | Path) -> ControlConfig:
    """Read a TOML configuration; :class:`ConfigError` names the key at fault."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"invalid config {path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config {path}: {exc.strerror or exc}") from None
    return config_from_mapping(doc, base_dir=path.parent)


def config_from_mapping(doc: Mapping[str, Any], *, base_dir: Path | None = None) -> ControlConfig:
    """The same from a decoded mapping; descriptor paths are relative to ``base_dir``."""
    unknown = set(doc) - {"index", "holder", "pc", "instance", "frontend", "principals", "tls",
                          "transport"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown section")
    doc = {name: _resolve_store_password(section, base_dir) if name in STORE_SECTIONS else section
           for name, section in doc.items()}
    auth = Authorizer.from_config(doc.get("principals", []))
    index = _index_config(doc.get("index", {}), base_dir or Path.cwd())
    holder = _holder_config(doc.get("holder", {}), base_dir or Path.cwd())
    pc = _pc_config(doc.get("pc", {}))
    instance = _instance_config(doc.get("instance", {}), base_dir or Path.cwd())
    frontend = FrontEndConfig(**_known(doc.get("frontend", {}), "frontend", FrontEndConfig))
    tls = tls_config_from_mapping(doc.get("tls", {}), base_dir or Path.cwd())
    tls = with_transport_section(tls, doc.get("transport", {}))
    return ControlConfig(auth=auth, index=index, holder=holder, pc=pc, instance=instance, frontend=frontend, tls=tls)


STORE_SECTIONS = ("index", "holder", "pc", "frontend")


def _resolve_store_password(section: object, base_dir: Path | None) -> object:
    """``store_password_file`` relative to the configuration file's folder."""
    if not isinstance(section, dict) or not isinstance(section.get("store_password_file"), str):
        return section
    path = Path(section["store_password_file"])
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    return {**section, "store_password_file": str(path)}


def _known(section: object, name: str, cls: type) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise ConfigError(name, "must be a table")
    unknown = set(section) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"{name}.{sorted(unknown)[0]}", "unknown key")
    return dict(section)


def _pc_config(section: object) -> PcConfig:
    return PcConfig(**_known(section, "pc", PcConfig))


def _instance_config(section: object, base_dir: Path) -> InstanceConfig:
    values = _known(section, "instance", InstanceConfig)
    if "tiers" in values:
        tiers = values["tiers"]
        if not isinstance(tiers, list):
            raise ConfigError("instance.tiers", "must be an array of tables")
        values["tiers"] = tuple(_tier_config(t, f"instance.tiers[{i}]", base_dir) for i, t in enumerate(tiers))
    if "links" in values:
        links = values["links"]
        if not isinstance(links, list):
            raise ConfigError("instance.links", "must be an array of tables")
        values["links"] = tuple(LinkConfig(**_known(l, f"instance.links[{i}]", LinkConfig)) for i, l in enumerate(links))
    for name in ("epoch_file", "records_journal"):
        if isinstance(values.get(name), str):
            values[name] = str(base_dir / values[name])
    if "engine" in values:
        values["engine"] = engine_config_from_mapping(values["engine"], base_dir)
    if "codec_policy" in values:
        if not isinstance(values["codec_policy"], dict):
            raise ConfigError("instance.codec_policy", "must be a table")
        try:
            values["codec_policy"] = CodecPolicy.from_mapping(values["codec_policy"], "instance.codec_policy")
        except RecordError as exc:
            raise ConfigError(exc.member, str(exc).split(": ", 1)[-1]) from None
    return InstanceConfig(**values)


def _holder_config(section: object, base_dir: Path) -> HolderConfig:
    if not isinstance(section, dict):
        raise ConfigError("holder", "must be a table")
    known = {f.name for f in fields(HolderConfig)}
    values = dict(section)
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"holder.{sorted(unknown)[0]}", "unknown key")
    if "base_path" in values and not isinstance(values["base_path"], str):
        raise ConfigError("holder.base_path", "must be a string")
    if "tiers" in values:
        tiers = values["tiers"]
        if not isinstance(tiers, list):
            raise ConfigError("holder.tiers", "must be an array of tables")
        values["tiers"] = tuple(_tier_config(t, f"holder.tiers[{i}]", base_dir) for i, t in enumerate(tiers))
    if isinstance(values.get("moqt_relays"), list):
        values["moqt_relays"] = tuple(values["moqt_relays"])
    for name in ("moqt_ca_file", "records_journal"):
        if isinstance(values.get(name), str):
            values[name] = str(base_dir / values[name])
    if "descriptors" in values:
        files = values["descriptors"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ConfigError("holder.descriptors", "must be an array of file names")
        values["descriptors"] = tuple(_descriptor(base_dir / name, f"holder.descriptors[{i}]") for i, name in enumerate(files))
    return HolderConfig(**values)


def _tier_config(entry: object, key: str, base_dir: Path) -> TierConfig:
    if not isinstance(entry, dict):
        raise ConfigError(key, "must be a table")
    unknown = set(entry) - _TIER_KEYS
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown key")
    values = dict(entry)
    if "kind" not in values or "capacity" not in values:
        raise ConfigError(key, "kind and capacity are required")
    if isinstance(values.get("path"), str):
        values["path"] = str(base_dir / values["path"])
    return TierConfig(**values)


def _index_config(section: object, base_dir: Path) -> IndexConfig:
    if not isinstance(section, dict):
        raise ConfigError("index", "must be a table")
    known = {f.name for f in fields(IndexConfig)}
    values = dict(section)
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"index.{sorted(unknown)[0]}", "unknown key")
    files = values.pop("descriptors", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigError("index.descriptors", "must be an array of file names")
    if "base_path" in values and not isinstance(values["base_path"], str):
        raise ConfigError("index.base_path", "must be a string")
    documents = tuple(_descriptor(base_dir / name, f"index.descriptors[{i}]") for i, name in enumerate(files))
    return IndexConfig(**values, descriptors=documents)


def _descriptor(path: Path, key: str) -> Mapping[str, Any]:
    try:
        document = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(key, f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(key, f"{path}: not valid JSON: {exc}") from None
    try:
        return validate_descriptor(document).document
    except DescriptorError as exc:
        raise ConfigError(key, f"{path}: {exc}") from None
