"""The holder side of ``kvsp bench wan --codec``, in the holder's network namespace.

``python -m kvsp_moq.cli.bench.wan.codec.holder --host H --layers N --layer-mib M --codec
C[,C...]`` computes one block of real KV (bf16, 8 KV heads x 128 dims: the codec bench's
model, ``bench/codec/speed.py``), stores it raw, serves it with the control plane's holder
(``serve_holder``, kvsp-draft §6.7) configured with the block's descriptor so that it
transcodes (``GET ...?codec=n``, ``control/holder/transcode.py``), transcodes it once into
each codec before serving (as the first GET would: every later GET is served from the
holder's cache; the seconds it took are reported), with ``--moqt-backend`` also publishes it
through a transcoding relay (:mod:`.moqt`), prints one JSON line (:class:`CodecHolderInfo`)
and serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from .....control.common.auth import Authorizer, Grant, Principal
from .....control.common.config import ControlConfig, HolderConfig, IndexConfig, TierConfig
from .....control.holder.serve import HOLDER_SERVICE, serve_holder
from .....kvsp.codecs import layer_codec
from .....kvsp.compat import compat_id, make_descriptor
from .....kvsp.layout import LAYOUT
from .....storage import BlockStore, HostTier, RecordKey
from ...kv.holder import BENCH_TOKEN, freeze_heap, serve_until_stdin_closes
from .moqt import serve_through_relay

__all__ = ["CodecHolderInfo", "descriptor", "main"]

SCOPE = b"\x02" * 16
BLOCK_KEY = b"\x05" * 32
#: The codec bench's model geometry (``bench/codec/speed.py`` SPEED_CONFIG: torch is imported
#: only where the KV is computed, so the driver, which reads the info line, needs none).
MODEL, KV_HEADS, HEAD_DIM, MODEL_LAYERS = "kvsp-bench-codec-wide", 8, 128, 4


def descriptor(layers: int, block_tokens: int) -> dict[str, Any]:
    """The bench block's Compatibility Descriptor (§4.1): the codec bench's model geometry."""
    return make_descriptor(
        model=MODEL, model_digest="sha-256:" + "00" * 32, tokenizer_digest="sha-256:" + "00" * 32,
        layers=layers, kv_heads=KV_HEADS, head_dim=HEAD_DIM, kv_dtype="bf16",
        positional="rope", block_tokens=block_tokens, layout=LAYOUT)


@dataclass(frozen=True)
class CodecHolderInfo:
    """What the loader needs: the raw replica's record, the block path, sizes and the
    holder's one-time transcoding (seconds and octets per codec)."""

    record: dict[str, Any]
    http_port: int
    http_path: str
    raw_bytes: int  # K and V octets of every layer, raw (what a consumer gets decoded)
    tokens: int
    transcode_s: dict[str, float]
    coded_octets: dict[str, int]
    #: The raw replica's record through the transcoding relay (``--moqt``, :mod:`.moqt`), or None.
    moqt_record: dict[str, Any] | None = None

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> CodecHolderInfo:
        return cls(**json.loads(line))


async def serve(host: str, layers: int, layer_bytes: int, codecs: list[str], stop: asyncio.Future[None],
                moqt: tuple[str, int, str | None] | None = None) -> None:
    """``moqt``: (backend, datagram size, congestion control) of the transcoding relay the
    block is also served through (:func:`.moqt.serve_through_relay`), or None."""
    from .....bench.codec.speed import SPEED_CONFIG, sample_layers  # torch: only here

    assert (SPEED_CONFIG.name, SPEED_CONFIG.kv_heads, SPEED_CONFIG.head_dim, SPEED_CONFIG.layers) == (
        MODEL, KV_HEADS, HEAD_DIM, MODEL_LAYERS)
    geometry_tokens = layer_bytes // (2 * KV_HEADS * HEAD_DIM * 2)
    sample, geometry = sample_layers(-(-layers // MODEL_LAYERS), geometry_tokens)
    arrays = sample[:layers]
    doc = descriptor(layers, geometry_tokens)
    key = RecordKey(compat_id(doc), SCOPE, BLOCK_KEY)
    store = BlockStore([HostTier(4 * layers * layer_bytes)])
    store.put_layers(key, arrays, token_count=geometry_tokens, geometry=geometry)
    principal = Principal("bench", scopes=Grant(everything=True), holders=Grant(everything=True))
    config = ControlConfig(auth=Authorizer.from_tokens({BENCH_TOKEN: principal}),
                           index=IndexConfig(purge_interval_ms=0),
                           holder=HolderConfig(tiers=(TierConfig("host", 1 << 30),), descriptors=(doc,),
                                               transcode_cache_octets=1 << 30))
    http = await serve_holder(config, host, 0, store=store)
    relayed = None
    try:
        if moqt is not None:
            relayed = await serve_through_relay(store, key, doc, host, *moqt, cache_bytes=4 * layers * layer_bytes)
        service = http.app[HOLDER_SERVICE]
        info = store.get(key)
        assert info is not None and service.transcoder is not None
        transcode_s, coded = {}, {}
        for name in codecs:  # once per replica and codec, as the first GET would
            read = service.open_block(principal, key, None, layer_codec(name).codec.value)
            start = time.perf_counter()
            got = await service.transcoded(read)
            transcode_s[name] = time.perf_counter() - start
            coded[name] = len(got.body)
        out = CodecHolderInfo(info.replica_record(http.url, 600_000).to_json(), http.port,
                              f"{http.base_path.rstrip('/')}/blocks/{key.path}",
                              sum(k.nbytes + v.nbytes for k, v in arrays), geometry_tokens, transcode_s, coded,
                              None if relayed is None else relayed.record.to_json())
        freeze_heap()
        print(out.to_line(), flush=True)
        await stop
    finally:
        if relayed is not None:
            await relayed.close()
        await http.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.cli.bench.wan.codec.holder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-mib", type=int, default=1)
    p.add_argument("--codec", default="fp8-e4m3", help="codecs to transcode into, comma-separated")
    p.add_argument("--moqt-backend", default=None, help="also serve through a transcoding relay on this backend")
    p.add_argument("--datagram-size", type=int, default=1452)
    p.add_argument("--congestion-control", default=None, help="the relay's (the sender's); default: the backend's")
    args = p.parse_args(argv)
    codecs = [c for c in args.codec.split(",") if c]
    moqt = None if args.moqt_backend is None else (args.moqt_backend, args.datagram_size, args.congestion_control)
    return serve_until_stdin_closes(lambda stop: serve(args.host, args.layers, args.layer_mib << 20, codecs, stop,
                                                       moqt))


if __name__ == "__main__":
    raise SystemExit(main())
