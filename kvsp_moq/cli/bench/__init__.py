"""``kvsp bench ...``: run a benchmark and print its figures (kvsp_moq.bench.report).

The benchmarks that need only the layers below the control plane are in ``kvsp_moq.bench``;
those that start control-plane servers or the relay are here: :mod:`.index` (``kvsp bench
index``), :mod:`.kv` (``kvsp bench kv``: holder and loader processes) and :mod:`.wan`
(``kvsp bench wan``: the same across a shaped link between network namespaces) and :mod:`.vllm`
(``kvsp bench vllm``: vLLM engine processes, docs/vllm.md).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ...bench import report
from ..errors import UsageError
from .backend import default_backend
from ..progress import Ticker, add_progress_option, wanted


def _keys(args: argparse.Namespace) -> int:
    from ...bench import keys

    report.emit(keys.run(tokens=args.tokens, block_tokens=args.block_tokens, repeat=args.repeat))
    return 0


def _container(args: argparse.Namespace) -> int:
    from ...bench import container

    report.emit(container.run(layers=args.layers, layer_bytes=args.layer_mib << 20, repeat=args.repeat))
    return 0


def _codec(args: argparse.Namespace) -> int:
    from ...bench import codec

    if min(args.prompts, args.prompt_blocks, args.block_tokens, args.steps, args.new_tokens,
           args.speed_blocks, args.repeat) < 1 or args.link_mbit <= 0 or args.outlier_scale <= 0:
        raise UsageError("counts, --link-mbit and --outlier-scale must be positive")
    report.emit(codec.run(prompt_count=args.prompts, prompt_blocks=args.prompt_blocks,
                          block_tokens=args.block_tokens, steps=args.steps, new_tokens=args.new_tokens,
                          speed_blocks=args.speed_blocks, repeat=args.repeat, link_mbit=args.link_mbit,
                          outlier_scale=args.outlier_scale))
    return 0


def _moqt(args: argparse.Namespace) -> int:
    from ...bench import moqt

    sizes = tuple(args.datagram_size) if args.datagram_size else moqt.DATAGRAM_SIZES
    try:
        moqt.listen_url(args.url)
    except ValueError as exc:
        raise UsageError(f"--url: {exc}") from None
    report.emit(moqt.run(block_bytes=args.block_mib << 20, datagram_sizes=sizes, repeat=args.repeat,
                         url=args.url))
    return 0


def _relay(args: argparse.Namespace) -> int:
    from ...bench.relay import driver
    from ...transport.config import BACKEND_ENV
    from .backend import check_backend

    check_backend(args.backend)  # one this build cannot run: exit 2, saying why
    # The publisher, the relay and the subscribers all take the backend from the environment
    # (TransportConfig's default), the relay too when it runs in its own process.
    os.environ[BACKEND_ENV] = args.backend
    report.emit(driver.run(run_bytes=args.run_mib << 20, object_size=args.object_kib << 10,
                           datagram_size=args.datagram_size, repeat=args.repeat,
                           subscriber_processes=args.subscriber_processes,
                           relay_workers=args.relay_workers))
    return 0


def _kv(args: argparse.Namespace) -> int:
    from .kv import driver

    if args.prefetch_only:
        from .kv.prefetch import prefetch_figures

        report.emit(prefetch_figures(window=args.prefetch_window, datagram_size=max(args.datagram_size),
                                     backend=args.backend[0], repeat=args.repeat))
        return 0
    report.emit(driver.run(layers=args.layers, layer_bytes=args.layer_mib << 20,
                           datagram_sizes=args.datagram_size, backends=args.backend,
                           repeat=args.repeat, http=not args.no_http, relay=not args.no_relay,
                           parallel=args.parallel, workers=args.workers,
                           device=args.device, holders=args.holders,
                           prefetch_window=None if args.no_prefetch else args.prefetch_window,
                           mooncake=not args.no_mooncake))
    return 0


def _live(args: argparse.Namespace) -> int:
    from ...bench import live_publish
    from ...transport import native

    if not native.available():
        raise UsageError(f"kvsp bench live needs the native backend: {native.unavailable_reason()}")
    if args.layers < 1 or args.repeat < 1:
        raise UsageError("--layers and --repeat must be >= 1")
    live_publish.main(["--layers", str(args.layers), "--repeat", str(args.repeat)])
    return 0


def _wan(args: argparse.Namespace) -> int:
    from .wan import driver

    figures = driver.run(layers=args.layers, layer_bytes=args.layer_mib << 20,
                         datagram_size=args.datagram_size, backend=args.backend,
                         delay_ms=args.delay_ms, loss_pct=args.loss, repeat=args.repeat,
                         shaper=args.shaper, seed=args.seed, tcp_cc=args.tcp_cc,
                         sink=args.sink, congestion_controls=args.congestion_control,
                         codecs=args.codec)
    report.emit(figures)
    return 0


def _csv(kind: type[int] | type[float] | type[str]) -> "Callable[[str], tuple[Any, ...]]":
    def parse(text: str) -> tuple[Any, ...]:
        items = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items
    return parse


def _index(args: argparse.Namespace) -> int:
    from ..core import UsageError
    from . import index

    if args.records < args.prompt_blocks or args.prompt_blocks < 1:
        raise UsageError(f"--records {args.records} must hold at least one prompt of --prompt-blocks {args.prompt_blocks}")
    if args.refresh_records < 1 or args.single_puts < 1:
        raise UsageError("--refresh-records and --single-puts must be >= 1")
    if args.redis_url is not None and args.store == "memory":
        raise UsageError("--redis-url needs --store redis or cluster")
    if args.block_layers < 1 or args.layer_digests < 1 or args.lookups < 1 or args.repeat < 1 \
            or (args.block_mib << 20) // args.block_layers < 2:
        raise UsageError("--block-layers, --layer-digests, --lookups, --repeat must be >= 1 and "
                         "--block-mib large enough for two octets per layer")
    report.emit(index.run(records=args.records, prompt_blocks=args.prompt_blocks,
                          layers=args.layer_digests, lookups=args.lookups,
                          block_layers=args.block_layers,
                          layer_bytes=(args.block_mib << 20) // args.block_layers,
                          repeat=args.repeat, store=args.store, redis_url=args.redis_url,
                          refresh_records=args.refresh_records, single_puts=args.single_puts))
    return 0


def _vllm(args: argparse.Namespace) -> int:
    from . import vllm

    return vllm.cmd(args)


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("bench", help="benchmarks: JSON figures on stdout, a table on stderr")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    q = bsub.add_parser("keys", help="Block Keys/s vs a bare HMAC loop")
    q.add_argument("--tokens", type=int, default=131072)
    q.add_argument("--block-tokens", type=int, default=16)
    q.add_argument("--repeat", type=int, default=5)
    q.set_defaults(handler=_keys)
    q = bsub.add_parser("container", help="KVB1 decode + digests GB/s vs hashlib SHA-256 alone")
    q.add_argument("--layers", type=int, default=32)
    q.add_argument("--layer-mib", type=int, default=1)
    q.add_argument("--repeat", type=int, default=5)
    q.set_defaults(handler=_container)
    q = bsub.add_parser("codec", help="per codec: compression ratio, encode/decode MB/s per core, and "
                                      "accuracy on the reference model (also with outlier K channels), "
                                      "each vs codec raw")
    q.add_argument("--prompts", type=int, default=32, help="prompts of the greedy-output figure")
    q.add_argument("--prompt-blocks", type=int, default=2, help="coded blocks per prompt")
    q.add_argument("--block-tokens", type=int, default=64)
    q.add_argument("--steps", type=int, default=256, help="decode steps of the logit and top-1 figures")
    q.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    q.add_argument("--speed-blocks", type=int, default=4, help="blocks of the ratio and MB/s sample")
    q.add_argument("--repeat", type=int, default=3, help="timed runs per MB/s figure; the best is kept")
    q.add_argument("--link-mbit", type=float, default=1000.0,
                   help="the WAN link rate the MB/s figures' params compare with (Mbit/s)")
    q.add_argument("--outlier-scale", type=float, default=16.0,
                   help="how much larger the outlier model's K outlier channels are")
    q.set_defaults(handler=_codec)
    q = bsub.add_parser("moqt", help="MOQT publisher -> subscriber MB/s and first-object time vs TCP")
    q.add_argument("--block-mib", type=int, default=32)
    q.add_argument("--datagram-size", type=int, action="append", metavar="BYTES",
                   help="QUIC max datagram size (repeatable; default 1200 1452 8952 16384)")
    q.add_argument("--repeat", type=int, default=1)
    q.add_argument("--url", default="moqt://127.0.0.1:0/bench", metavar="URL",
                   help="where the bench's server listens (port 0: any); https://...: also MOQT "
                        "over WebTransport to it, alternated with raw QUIC (moqt_wt_* figures, "
                        "baseline the raw-QUIC figure of the same run)")
    q.set_defaults(handler=_moqt)
    q = bsub.add_parser("relay", help="publisher -> relay -> 1/4/8 subscribers MB/s vs direct; "
                                      "FETCH warm vs cold cache")
    q.add_argument("--run-mib", type=int, default=8)
    q.add_argument("--object-kib", type=int, default=256)
    q.add_argument("--datagram-size", type=int, default=16384)
    q.add_argument("--backend", default=default_backend(),
                   help="QUIC backend of every endpoint (aioquic, qh3, native where it is built; "
                        "default $KVSP_QUIC_BACKEND or aioquic)")
    q.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    q.add_argument("--subscriber-processes", action="store_true",
                   help="each subscriber in its own process (as instances are deployed); "
                        "default: all in the bench process")
    q.add_argument("--relay-workers", type=int, default=1, metavar="W",
                   help="run the relay as W worker processes under one hub (python -m relay "
                        "--workers W; docs/relay.md Cores); figures named ..._workersW")
    q.set_defaults(handler=_relay)
    q = bsub.add_parser("kv", help="one KV block into a layer sink: MOQT direct, relay cold/warm, "
                                   "HTTP GET; first layer and whole block vs TCP")
    q.add_argument("--layers", type=int, default=32)
    q.add_argument("--layer-mib", type=int, default=1)
    q.add_argument("--datagram-size", type=_csv(int), default=(16384,), metavar="N[,N...]",
                   help="QUIC max datagram sizes, comma-separated (default 16384)")
    q.add_argument("--backend", type=_csv(str), default=(default_backend(),), metavar="B[,B...]",
                   help="transport backends, comma-separated (aioquic, qh3 where the transport "
                        "has it; default $KVSP_QUIC_BACKEND or aioquic)")
    q.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    q.add_argument("--no-http", action="store_true", help="skip the HTTP GET figure")
    q.add_argument("--no-relay", action="store_true", help="skip the relay figures")
    q.add_argument("--parallel", type=_csv(int), default=(), metavar="N[,N...]",
                   help="also load the block in N layer ranges at once, one QUIC connection "
                        "each (N = 1 is added as the baseline)")
    q.add_argument("--workers", type=_csv(str), default=("connections",), metavar="KIND[,KIND]",
                   help="with --parallel: connections (in-process) and/or processes "
                        "(N worker processes into shared memory)")
    q.add_argument("--holders", type=int, default=1, metavar="H",
                   help="with --parallel: H holder processes serving replicas of the block; "
                        "range i is read from replica i mod H (default 1)")
    q.add_argument("--device", default="cpu",
                   help="torch device of the direct MOQT loads' sink: cpu (default) or "
                        "cuda[:i] (pinned staging, then a copy to the GPU, timed to its end)")
    q.add_argument("--no-prefetch", action="store_true",
                   help="skip the prefetch rows (12 blocks of 4 x 32 KiB through a relay, "
                        "landed in a store vs through a container; kv/prefetch.py)")
    q.add_argument("--prefetch-only", action="store_true", help="only the prefetch rows")
    q.add_argument("--no-mooncake", action="store_true",
                   help="skip the Mooncake Transfer Engine row (measured where its package imports)")
    q.add_argument("--prefetch-window", type=int, default=4, metavar="W",
                   help="blocks in flight in the prefetch rows (default 4, the instance's "
                        "prefetch_blocks_in_flight)")
    q.set_defaults(handler=_kv)
    q = bsub.add_parser("live", help="holder CPU per GiB for a SUBSCRIBEd block on native, sent from "
                        "the store (no copy) vs copied, same run")
    q.add_argument("--layers", type=int, default=32, help="layers of 1 MiB per block")
    q.add_argument("--repeat", type=int, default=3, help="runs of each kind; the best is kept")
    q.set_defaults(handler=_live)
    q = bsub.add_parser("wan", help="MOQT vs HTTP block load across two network namespaces "
                                    "joined by a shaped link: tc netem on a veth pair, or a "
                                    "userspace TUN shaper (root + iproute2)")
    q.add_argument("--layers", type=int, default=32)
    q.add_argument("--layer-mib", type=int, default=1)
    q.add_argument("--datagram-size", type=int, default=1452)
    q.add_argument("--backend", default=default_backend())
    q.add_argument("--delay-ms", type=float, default=20.0, help="netem delay on each direction")
    q.add_argument("--loss", type=_csv(float), default=(0.5,), metavar="PCT[,PCT...]",
                   help="netem loss, percent, each direction; several: one path each, in turn "
                        "(default 0.5)")
    q.add_argument("--congestion-control", type=_csv(str), default=(None,), metavar="CC[,CC...]",
                   help="the MOQT endpoints' QUIC congestion control, one load each on every "
                        "path (aioquic: reno, cubic, bbr; default: the backend's)")
    q.add_argument("--shaper", default="auto", choices=("auto", "netem", "tun"),
                   help="tc netem on a veth pair, the userspace TUN shaper (same delay, loss "
                        "and limit per direction), or auto: netem where the kernel has it")
    q.add_argument("--seed", type=int, default=1, help="seed of the TUN shaper's loss draws")
    q.add_argument("--sink", default="torch", choices=("torch", "numpy"),
                   help="the loader's layer sink (numpy where torch is not installed)")
    q.add_argument("--tcp-cc", default=None,
                   help="TCP congestion control in the namespaces (the HTTP baseline), e.g. "
                        "cubic or reno; default: the host's (net.ipv4.tcp_congestion_control)")
    q.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    q.add_argument("--codec", type=_csv(str), default=(), metavar="C[,C...]",
                   help="also the effective KV rate of each codec (HTTP codec=n from a "
                        "transcoding holder, decoded) beside raw HTTP: wan_codec_<C>_rate; and "
                        "over MOQT on --backend through a transcoding relay: wan_moqt_codec_<C>_rate")
    q.set_defaults(handler=_wan)
    q = bsub.add_parser("index", help="IS lookups/s over HTTP vs in-process; holder block GET "
                                      "MB/s (plain and verified) vs TCP")
    q.add_argument("--records", type=int, default=100_000, help="Replica Records at the IS")
    q.add_argument("--prompt-blocks", type=int, default=64, help="Block Keys per lookup")
    q.add_argument("--layer-digests", type=int, default=32, help="layer digests per record")
    q.add_argument("--lookups", type=int, default=200, help="lookups per timed run")
    q.add_argument("--block-mib", type=int, default=32, help="block size for the GET figures")
    q.add_argument("--block-layers", type=int, default=32)
    q.add_argument("--repeat", type=int, default=3, help="timed runs per figure; the best is kept")
    q.add_argument("--store", choices=("memory", "redis", "cluster"), default="memory",
                   help="redis: also lookups on a Redis store and the batched record refresh; "
                        "cluster: the same on a Redis Cluster (3 primaries, 3 replicas), with p50/p99")
    q.add_argument("--redis-url", help="the Redis (redis://) or cluster (redis+cluster://) to use "
                                       "(default: one of its own)")
    q.add_argument("--refresh-records", type=int, default=100_000, help="records refreshed (--store redis)")
    q.add_argument("--single-puts", type=int, default=5_000, help="records of the single-PUT baseline")
    q.set_defaults(handler=_index)
    q = bsub.add_parser("vllm", help="vLLM engine B's time to first token for an N-token shared prefix: KVSP "
                                     "over MOQT vs recomputing vs vLLM's ExampleConnector (the vllm extra)")
    from .vllm import register_arguments as vllm_arguments

    vllm_arguments(q)
    q.set_defaults(handler=_vllm)
    for name, parser in bsub.choices.items():
        add_progress_option(parser)
        parser.set_defaults(handler=_with_progress(name, parser.get_default("handler")))


def _with_progress(name: str, handler: Callable[[argparse.Namespace], int]
                   ) -> Callable[[argparse.Namespace], int]:
    """``handler`` with an elapsed-time line on stderr while it runs (cli/progress.py)."""
    def run(args: argparse.Namespace) -> int:
        with Ticker(f"[bench {name}] running:", enabled=wanted(args.progress)):
            return handler(args)
    return run
