"""``kvsp container encode``: a codec-raw KVB1 container (kvsp-draft §4.3, docs/container.md)
from numpy ``.npy`` files (or torch ``.pt`` tensors when torch is installed).

Input, one of:

* ``--kv FILE`` — one array shaped ``[layers, 2, tokens, kv_heads, head_dim]`` (K at index 0
  of the second axis, V at 1);
* ``--layer K V`` per layer, in ascending order — arrays shaped ``[tokens, kv_heads, head_dim]``.

The element type is the arrays' (float32 -> fp32, float16 -> fp16, int8, torch bfloat16 /
float8) unless ``--kv-dtype`` names it (bf16 and fp8 travel as uint16 / uint8 bit patterns
in numpy). The container is written to ``-o FILE`` and its inspection report (as ``kvsp
container inspect``) printed on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..kvsp.errors import KvspError
from ..kvsp.layout import Geometry, encode_raw_block
from ..kvsp.registries import ELEMENT_TYPES
from .errors import UsageError

__all__ = ["register_action"]

#: numpy dtypes whose element type is unambiguous.
_BY_NUMPY = {"float32": "fp32", "float16": "fp16", "int8": "int8"}
#: torch dtypes that numpy cannot hold, and the unsigned type of their bit patterns.
_TORCH_BITS = {"bfloat16": ("bf16", "int16", np.uint16), "float8_e4m3fn": ("fp8-e4m3", "uint8", np.uint8),
               "float8_e5m2": ("fp8-e5m2", "uint8", np.uint8)}


def _load(path: str) -> tuple[np.ndarray, str | None]:
    """The array in ``path`` and the element type its dtype implies (None: ambiguous)."""
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file")
    if path.endswith((".pt", ".pth")):
        return _load_torch(path)
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise UsageError(f"{path}: not a .npy array ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise UsageError(f"{path}: holds several arrays (.npz); give one .npy per array")
    return array, _BY_NUMPY.get(array.dtype.name)


def _load_torch(path: str) -> tuple[np.ndarray, str | None]:
    try:
        import torch
    except ImportError:
        raise UsageError(f"{path}: reading .pt files needs torch; save the tensor with numpy.save") from None
    tensor = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise UsageError(f"{path}: does not hold one tensor")
    name = str(tensor.dtype).removeprefix("torch.")
    if name in _TORCH_BITS:
        kind, view, storage = _TORCH_BITS[name]
        bits = tensor.contiguous().view(getattr(torch, view)).numpy().view(storage)
        return bits, kind
    return tensor.contiguous().numpy(), _BY_NUMPY.get(name)


def _layers(args: argparse.Namespace) -> tuple[list[tuple[np.ndarray, np.ndarray]], set[str | None]]:
    if bool(args.kv) == bool(args.layer):
        raise UsageError("give --kv FILE or one --layer K V per layer")
    if args.kv:
        array, kind = _load(args.kv)
        if array.ndim != 5 or array.shape[1] != 2:
            raise UsageError(f"{args.kv}: --kv wants shape [layers, 2, tokens, kv_heads, head_dim], "
                             f"got {list(array.shape)}")
        return [(array[i, 0], array[i, 1]) for i in range(array.shape[0])], {kind}
    layers = []
    kinds = set()
    for k_path, v_path in args.layer:
        (k, k_kind), (v, v_kind) = _load(k_path), _load(v_path)
        for path, a in ((k_path, k), (v_path, v)):
            if a.ndim != 3:
                raise UsageError(f"{path}: --layer wants shape [tokens, kv_heads, head_dim], got {list(a.shape)}")
        layers.append((k, v))
        kinds |= {k_kind, v_kind}
    return layers, kinds


def _element_type(args: argparse.Namespace, kinds: set[str | None]) -> str:
    if args.kv_dtype:
        return str(args.kv_dtype)
    if len(kinds) != 1 or None in kinds:
        raise UsageError("the arrays' dtype does not say the element type: give --kv-dtype "
                         f"({', '.join(ELEMENT_TYPES)})")
    return str(next(iter(kinds)))


def cmd_container_encode(args: argparse.Namespace,
                         inspect: Callable[[str], dict[str, Any] | str]) -> int:
    layers, kinds = _layers(args)
    kind = _element_type(args, kinds)
    _, kv_heads, head_dim = layers[0][0].shape
    try:
        geometry = Geometry(kv_heads, head_dim, ELEMENT_TYPES[kind])
        data = encode_raw_block([(np.ascontiguousarray(k), np.ascontiguousarray(v)) for k, v in layers],
                                geometry, first_layer=args.first_layer)
    except KvspError as exc:
        raise UsageError(f"cannot encode: {exc}") from None
    tmp = f"{args.output}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, args.output)  # a reader never sees half a container
    report = inspect(args.output)
    if isinstance(report, str):  # pragma: no cover - the encoder wrote it
        raise UsageError(f"{args.output}: {report}")
    print(json.dumps({"file": args.output, "kv_dtype": kind, "kv_heads": kv_heads,
                      "head_dim": head_dim, **report}, indent=2))
    return 0


def register_action(csub: "argparse._SubParsersAction[argparse.ArgumentParser]",
                    inspect: Callable[[str], dict[str, Any] | str]) -> None:
    """Add ``encode`` to ``kvsp container``; ``inspect`` makes the report of the written file."""
    q = csub.add_parser("encode", help="build a codec-raw container from .npy (or .pt) arrays",
                        description="Build a codec-raw KVB1 container (§4.3) from arrays and "
                                    "print its inspection report (docs/cli.md)")
    q.add_argument("-o", "--output", required=True, metavar="FILE", help="the container to write")
    q.add_argument("--kv", metavar="FILE",
                   help="one array [layers, 2, tokens, kv_heads, head_dim] (.npy, or .pt with torch)")
    q.add_argument("--layer", nargs=2, action="append", default=[], metavar=("K", "V"),
                   help="one layer's K and V arrays [tokens, kv_heads, head_dim] (repeat per layer)")
    q.add_argument("--first-layer", type=int, default=0, metavar="L",
                   help="absolute index of the first layer (a layer-range container)")
    q.add_argument("--kv-dtype", choices=sorted(ELEMENT_TYPES), metavar="NAME",
                   help=f"element type ({', '.join(ELEMENT_TYPES)}); default: the arrays' dtype")
    q.set_defaults(handler=lambda args: cmd_container_encode(args, inspect))
