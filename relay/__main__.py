"""``python -m relay --listen HOST:PORT [--upstream URL] [--cert PEM --key PEM]
[--upstream-ca PEM | --insecure-upstream] [--config AUTH.toml] [--metrics [HOST:]PORT] [--log-format json]
[--transcode-descriptor FILE ...]``

With ``--transcode-descriptor`` the relay makes other codecs of the replicas of those
descriptors' compats at its edge (relay/transcode/edge.py, docs/relay.md "Transcoding"), through the
``--transcoder`` plugin (default ``kvsp_moq.bridge.transcoding:from_descriptor_files``).

Without ``--cert``/``--key`` a self-signed certificate (EC P-256, 13 days) is made for the
listen host. The port takes raw QUIC (ALPN ``moqt-NN``) and WebTransport (ALPN ``h3``,
``https://HOST:PORT/moq``; ``--no-webtransport`` turns it off), and prints ``relay
webtransport on https://HOST:PORT/moq (certificate sha-256 HEX)``: a browser connects with
``serverCertificateHashes`` naming that hash (any ECDSA certificate valid at most 14 days
given with ``--cert/--key`` works the same; docs/relay.md "WebTransport"). The
upstream relay's certificate is verified (against ``--upstream-ca``, else the system trust
store); ``--insecure-upstream`` turns that off, with a warning logged. Prints
``relay listening on moqt://HOST:PORT/moq`` once bound (port 0 picks one). On SIGTERM or
SIGINT: GOAWAY to every session, wait for them to leave (``--drain-timeout``), exit 0.
A bad ``--config`` file: one line naming the file and key on stderr (not the usage), exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys

from kvsp_moq.transport import TransportConfig, run
from kvsp_moq.transport.tls import (
    WEBTRANSPORT_HASH_MAX_DAYS,
    certificate_sha256,
    make_self_signed,
    warn_unverified,
)

from .ops.auth import AuthConfigError, load_auth_config
from .ops.config import MiB, RelayConfig
from .core import Relay
from .ops.logs import configure_logging
from .ops.names import parse_namespace
from .transcode.transcoder import Transcoder


#: Validity of the self-signed certificate made without ``--cert``: short enough for a
#: browser to accept it by its hash (WebTransport ``serverCertificateHashes``).
SELF_SIGNED_DAYS = WEBTRANSPORT_HASH_MAX_DAYS - 1


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _metrics_addr(text: str) -> tuple[str, int]:
    """``PORT`` (on 127.0.0.1) or ``HOST:PORT``."""
    if text.isdigit():
        return "127.0.0.1", int(text)
    return _host_port(text)


def _namespace(text: str) -> tuple[bytes, ...]:
    try:
        return parse_namespace(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, (), []) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None, prog: str = "python -m relay") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="MOQT relay (docs/relay.md)",
                                formatter_class=_HelpFormatter)
    p.add_argument("--listen", type=_host_port, default="127.0.0.1:4443",
                   help="HOST:PORT to listen on (port 0: any free port)")
    p.add_argument("--upstream", help="moqt:// (raw QUIC) or https:// (WebTransport) URL of the "
                        "relay to ask when no route matches (local namespaces are announced "
                        "to it, namespace interest forwarded)")
    p.add_argument("--cert", help="certificate PEM file (default: self-signed, EC P-256, valid "
                                  f"{SELF_SIGNED_DAYS} days: usable by a browser's WebTransport "
                                  "serverCertificateHashes)")
    p.add_argument("--key", help="private key PEM file")
    p.add_argument("--upstream-ca", metavar="PEM",
                   help="trust anchors (PEM) for the upstream relay's certificate "
                        "(default: the system trust store)")
    p.add_argument("--insecure-upstream", action="store_true",
                   help="do not verify the upstream relay's certificate (dev only; logged)")
    p.add_argument("--webtransport", action=argparse.BooleanOptionalAction, default=True,
                   help="also accept MOQT over WebTransport (ALPN h3, https://HOST:PORT/moq) on "
                        "the listen port, beside raw QUIC (ALPN moqt-NN)")
    p.add_argument("--cache-mib", type=int, default=256, help="object cache budget (MiB)")
    p.add_argument("--subscriber-queue-mib", type=float, default=8,
                   help="per-subscriber queue bound before TOO_FAR_BEHIND (MiB)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds to wait for sessions after GOAWAY on SIGTERM")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds an upstream request may wait for its answer (a FETCH: "
                        "between objects) before it is cancelled and answered TIMEOUT")
    p.add_argument("--upstream-keepalive", type=float, default=5.0, metavar="S",
                   help="seconds between liveness PINGs on the upstream session (0: none)")
    p.add_argument("--upstream-liveness-timeout", type=float, default=5.0, metavar="S",
                   help="a PING not acknowledged within this many seconds closes the upstream "
                        "session as lost (a killed or restarted upstream relay)")
    p.add_argument("--upstream-reconnect-initial", type=float, default=0.1, metavar="S",
                   help="first wait before reconnecting a lost upstream session")
    p.add_argument("--upstream-reconnect-max", type=float, default=5.0, metavar="S",
                   help="longest wait between reconnect attempts (the wait doubles per failure)")
    p.add_argument("--goaway-uri", default="", metavar="URL",
                   help="New Session URI sent in GOAWAY on SIGTERM (default: none, clients "
                        "reconnect to the same URL)")
    p.add_argument("--max-requests-per-session", type=int, default=4096,
                   help="open requests one downstream session may have (beyond: "
                        "REQUEST_ERROR EXCESSIVE_LOAD)")
    p.add_argument("--max-datagram-size", type=int, default=1200,
                   help="largest UDP payload sent (same value on both ends)")
    p.add_argument("--congestion-control", metavar="NAME",
                   help="QUIC congestion control of every connection, downstream and upstream "
                        "(aioquic: reno, cubic, bbr; default: the backend's, bbr on aioquic; "
                        "docs/transport.md)")
    p.add_argument("--config", metavar="FILE",
                   help="authorization config (TOML: [[principals]] tokens -> publish / "
                        "subscribe namespace prefixes; docs/relay.md). Without it the relay "
                        "is open to everyone")
    p.add_argument("--metrics", type=_metrics_addr, metavar="[HOST:]PORT",
                   help="serve Prometheus text metrics at http://HOST:PORT/metrics "
                        "(default off; a bare PORT listens on 127.0.0.1 only)")
    p.add_argument("--solicit-namespaces", action=argparse.BooleanOptionalAction, default=True,
                   help="send SUBSCRIBE_NAMESPACE to every downstream session allowed to "
                        "publish after SETUP and route its NAMESPACE answers like "
                        "PUBLISH_NAMESPACE (the moq-relay ingest model; default on)")
    p.add_argument("--solicit-prefix", type=_namespace, default=(), metavar="PREFIX",
                   help="namespace prefix to solicit (fields joined by '/', as in --config; "
                        "default: the empty prefix)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="stderr log format; json: one object per line with session, "
                        "request, cache and upstream events (level INFO unless --log-level)")
    p.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="log level (default: WARNING; INFO with -v or --log-format json)")
    p.add_argument("--qlog", metavar="DIR",
                   help="write one qlog file per QUIC connection (downstream and upstream) into "
                        "DIR, {ODCID}_{client|server}.qlog (docs/tracing.md; default off)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="run N relay processes on the --listen port (SO_REUSEPORT) under one "
                        "hub relay that holds the upstream side (relay/workers.py; "
                        "docs/relay.md Cores)")
    p.add_argument("--transcode-descriptor", action="append", default=[], metavar="FILE",
                   help="a Compatibility Descriptor (JSON) whose blocks' other codecs the relay "
                        "makes at its edge, once per replica and codec (relay/transcode/edge.py; "
                        "docs/relay.md Transcoding); repeatable")
    p.add_argument("--transcoder", default="kvsp_moq.bridge.transcoding:from_descriptor_files",
                   metavar="MODULE:FACTORY",
                   help="what makes the transcoder from the --transcode-descriptor files (a "
                        "plugin: the relay itself never imports KVSP)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.transcode_descriptor and args.workers > 1:
        p.error("--transcode-descriptor runs with --workers 1 only (the workers' caches are their own)")
    if bool(args.cert) != bool(args.key):
        p.error("--cert and --key go together")
    if args.upstream_ca and args.insecure_upstream:
        p.error("--upstream-ca and --insecure-upstream exclude each other")
    args.auth = None
    if args.config:
        try:
            args.auth = load_auth_config(args.config)
        except AuthConfigError as exc:  # one line, exit status 2: the usage would bury it
            p.exit(2, f"{p.prog}: error: {exc}\n")
    try:  # a bad descriptor file or plugin: one line, exit status 2, as for --config
        args.transcoder_made = _transcoder(args.transcoder, args.transcode_descriptor)
    except (OSError, ValueError, ImportError, AttributeError, TypeError) as exc:
        p.exit(2, f"{p.prog}: error: --transcode-descriptor / --transcoder: {exc}\n")
    return args


def build_config(args: argparse.Namespace) -> RelayConfig:
    host, port = args.listen
    wt = getattr(args, "webtransport", True)
    if args.cert:
        server = TransportConfig(certificate_file=args.cert, private_key_file=args.key,
                                 max_datagram_size=args.max_datagram_size, webtransport=wt)
    else:
        cert = make_self_signed(("localhost", host), days=SELF_SIGNED_DAYS) if _is_name(host) \
            else make_self_signed(ip_addresses=tuple(dict.fromkeys(("127.0.0.1", "::1", host))),
                                  days=SELF_SIGNED_DAYS)
        server = TransportConfig(certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem,
                                 max_datagram_size=args.max_datagram_size, webtransport=wt)
    if args.insecure_upstream and args.upstream:
        warn_unverified(f"the upstream relay {args.upstream} (--insecure-upstream)")
    upstream = TransportConfig(insecure=args.insecure_upstream, ca_file=getattr(args, "upstream_ca", None),
                               max_datagram_size=args.max_datagram_size)
    qlog = getattr(args, "qlog", None)
    if qlog is not None:
        server, upstream = server.replace(qlog_dir=qlog), upstream.replace(qlog_dir=qlog)
    cc = getattr(args, "congestion_control", None)
    if cc is not None:
        server = server.replace(congestion_control_algorithm=cc)
        upstream = upstream.replace(congestion_control_algorithm=cc)
    return RelayConfig(host=host, port=port, server_transport=server, upstream=args.upstream,
                       upstream_transport=upstream, cache_bytes=args.cache_mib * MiB,
                       subscriber_queue_bytes=int(args.subscriber_queue_mib * MiB),
                       drain_timeout=args.drain_timeout, auth=getattr(args, "auth", None),
                       request_timeout=getattr(args, "request_timeout", 30.0),
                       max_requests_per_session=getattr(args, "max_requests_per_session", 4096),
                       metrics=getattr(args, "metrics", None),
                       solicit_namespaces=getattr(args, "solicit_namespaces", True),
                       solicit_prefix=getattr(args, "solicit_prefix", ()),
                       upstream_keepalive=getattr(args, "upstream_keepalive", 5.0),
                       upstream_liveness_timeout=getattr(args, "upstream_liveness_timeout", 5.0),
                       upstream_reconnect_initial=getattr(args, "upstream_reconnect_initial", 0.1),
                       upstream_reconnect_max=getattr(args, "upstream_reconnect_max", 5.0),
                       goaway_uri=getattr(args, "goaway_uri", ""),
                       transcoder=getattr(args, "transcoder_made", None))


def _transcoder(factory: str, files: list[str]) -> Transcoder | None:
    """``MODULE:FACTORY`` called with the descriptor files (None without files)."""
    if not files:
        return None
    module, _, name = factory.partition(":")
    made: Transcoder = getattr(importlib.import_module(module), name)(files)
    return made


def _is_name(host: str) -> bool:
    return bool(host) and not host.replace(".", "").isdigit() and ":" not in host


async def serve(config: RelayConfig) -> int:
    relay = await Relay(config).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"relay listening on moqt://{config.host}:{relay.port}/moq", flush=True)
    if config.server_transport.webtransport:
        digest = certificate_sha256(config.server_transport)
        print(f"relay webtransport on https://{config.host}:{relay.port}/moq"
              + (f" (certificate sha-256 {digest})" if digest else ""), flush=True)
    if relay.metrics is not None:
        host = config.metrics[0] if config.metrics else "127.0.0.1"
        print(f"relay metrics on http://{host}:{relay.metrics.port}/metrics", flush=True)
    await stop.wait()
    clean = await relay.shutdown()
    logging.getLogger("relay").info("relay stopped (%s); stats %s",
                                    "drained" if clean else "drain timeout",
                                    relay.stats.snapshot())
    print("relay stopped", flush=True)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m relay") -> int:
    args = parse_args(argv, prog)
    level = args.log_level or ("INFO" if args.verbose or args.log_format == "json"
                               else "WARNING")
    configure_logging(args.log_format, getattr(logging, level))
    if args.workers > 1:
        from .workers import serve_workers

        return run(serve_workers(build_config(args), args.workers, args.log_format,
                                 getattr(logging, level)))
    return run(serve(build_config(args)))


if __name__ == "__main__":
    sys.exit(main())
