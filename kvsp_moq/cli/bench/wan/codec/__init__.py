"""``kvsp bench wan --codec C[,C...]``: the effective KV rate of each codec over the shaped path.

On the path the driver built, :mod:`.holder` (holder namespace) serves one block of real
KV, raw, transcoded once per codec by the holder (kvsp-draft §6.7 ``codec=n``), and
:mod:`.loader` (loader namespace) loads it over HTTP/TCP raw and in each codec, every
layer verified and decoded to bf16 as it arrives. Figures, per codec:

``wan_codec_<codec>_rate`` (MB/s): raw KV octets delivered (decoded) per second, beside
``wan_http_rate``: the same block raw over the same HTTP/TCP path in the same run (TCP's
congestion control is the path's, ``--tcp-cc``; the issue's baseline is BBR). The params give
the octets on the wire, the ratio, and the holder's one-time transcoding seconds.

``wan_moqt_codec_<codec>_rate`` (MB/s): the same over MOQT on ``--backend`` (its congestion
control, ``--congestion-control`` or the backend's default): the codec's track FETCHed
through a transcoding relay at the holder's end of the path (:mod:`.moqt`), beside the same
``wan_http_rate``; the params give the raw track's MOQT rate through that relay too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from .....bench.report import Figure
from .....kvsp.codecs import layer_codec
from ....core import UsageError
from ...kv.relayed import stop_process
from .holder import CodecHolderInfo
from ..path import HOLDER_IP, WanPath

__all__ = ["check_codecs", "codec_figures", "load_codecs"]


def check_codecs(codecs: Sequence[str]) -> None:
    """UsageError for a name that is not a registered codec other than raw."""
    for name in codecs:
        try:
            layer_codec(name)
        except Exception:
            raise UsageError(f"--codec {name!r}: not a registered codec") from None
        if name == "raw":
            raise UsageError("--codec raw: raw is the baseline, always measured")


def load_codecs(path: WanPath, layers: int, layer_bytes: int, codecs: Sequence[str],
                repeat: int, moqt: tuple[str, int, str | None] | None = None
                ) -> tuple[CodecHolderInfo, dict[str, list[float]]]:
    """Run the codec holder and loader across ``path``; their info and the loader's timings.
    ``moqt``: (backend, datagram size, congestion control or None) of the MOQT rows (the
    coded tracks through a transcoding relay at the holder's end, :mod:`.moqt`); None: HTTP only."""
    joined = ",".join(codecs)
    over_moqt: list[str] = []
    if moqt is not None:
        over_moqt = ["--moqt-backend", moqt[0], "--datagram-size", str(moqt[1]),
                     *(("--congestion-control", moqt[2]) if moqt[2] else ())]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", path.holder_ns, sys.executable, "-m", "kvsp_moq.cli.bench.wan.codec.holder",
         "--host", HOLDER_IP, "--layers", str(layers), "--layer-mib", str(layer_bytes >> 20), "--codec", joined,
         *over_moqt],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"the codec holder did not start (exit {proc.poll()})")
        info = CodecHolderInfo.from_line(line)
        done = subprocess.run(
            ["ip", "netns", "exec", path.loader_ns, sys.executable, "-m", "kvsp_moq.cli.bench.wan.codec.loader",
             "--info", line.strip(), "--host", HOLDER_IP, "--codec", joined, "--repeat", str(repeat), *over_moqt],
            stdout=subprocess.PIPE, text=True, check=True)
    finally:
        stop_process(proc)
    got: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return info, got


def codec_figures(info: CodecHolderInfo, got: dict[str, list[float]], codecs: Sequence[str],
                  base: dict[str, object], moqt: dict[str, object] | None = None) -> list[Figure]:
    """``wan_codec_<codec>_rate`` (HTTP) and, where the loader loaded them, ``wan_moqt_codec_
    <codec>_rate`` (MOQT through the transcoding relay; ``moqt``: their params, the backend and
    its congestion control), each beside ``wan_http_rate`` (raw, same path, same run)."""
    raw_s, raw_octets = got["raw"]
    figures = []
    for name in codecs:
        seconds, octets = got[name]
        params = {**base, "raw_bytes": info.raw_bytes, "wire_octets": int(octets),
                  "raw_wire_octets": int(raw_octets), "ratio_on_wire": round(raw_octets / octets, 4),
                  "holder_transcode_s_once": round(info.transcode_s[name], 4),
                  "holder_transcode_MBps": round(info.raw_bytes / info.transcode_s[name] / 1e6, 1),
                  "verified": "Repr-Digest (raw: + layer and replica digests)", "decoded_to": "bf16"}
        figures.append(Figure(f"wan_codec_{name}_rate", "MB/s", info.raw_bytes / seconds / 1e6,
                              "wan_http_rate", info.raw_bytes / raw_s / 1e6, params=params))
    if "moqt:raw" not in got:
        return figures
    moqt_raw_s, moqt_raw_octets = got["moqt:raw"]
    for name in codecs:
        if f"moqt:{name}" not in got:
            continue  # a codec whose section size the content decides: the relay does not make it
        seconds, octets = got[f"moqt:{name}"]
        params = {**base, **(moqt or {}), "raw_bytes": info.raw_bytes, "wire_octets": int(octets),
                  "ratio_on_wire": round(moqt_raw_octets / octets, 4),
                  "moqt_raw_rate": round(info.raw_bytes / moqt_raw_s / 1e6, 2),
                  "path": "holder -> transcoding relay (holder's end) -> WAN -> loader",
                  "verified": "the relay's coded LAYER_DIGESTS and each object's LAYER_DIGEST",
                  "decoded_to": "bf16"}
        figures.append(Figure(f"wan_moqt_codec_{name}_rate", "MB/s", info.raw_bytes / seconds / 1e6,
                              "wan_http_rate", info.raw_bytes / raw_s / 1e6, params=params))
    return figures
