"""kvsp_moq.bridge — KVSP over MOQT, binding v1 (DESIGN.md §2, §4; docs/binding.md).

Holder side: :class:`MoqtHolder` publishes a BlockStore's replicas (FETCH from the tier
buffers, SUBSCRIBE for blocks still being computed) and issues ``moqt://`` Replica Records.
Instance side: :func:`load_block` (FETCH a layer range into a layer sink, verify, fall back
source by source, report what to recompute), :func:`subscribe_block` (prefill streaming),
:func:`load_by_namespace` (verify against the Track Properties), :func:`load_block_parallel`
(N layer ranges at once over N connections, in-process or in worker processes).
"""

from .binding import (
    FIRST_LAYER,
    LAYER_COUNT,
    LAYER_DIGEST,
    LAYER_DIGESTS,
    MAX_CACHE_DURATION,
    TOKEN_COUNT,
    BindingError,
    TrackInfo,
)
from .holder import MoqtHolder
from .instance import block_info, load_block, load_by_namespace, subscribe_block
from .load import Attempt, BlockLoad, LoadResult, Source, fetch_into, sink_for_record
from .parallel import ConnectionWorkers, ParallelLoad, load_block_parallel
from .pool import MoqtPool
from .ranges import ParallelLoadError, split_layers
from .track import BlockTrack
from ._workers import ProcessWorkers

__all__ = [
    "FIRST_LAYER",
    "LAYER_COUNT",
    "LAYER_DIGEST",
    "LAYER_DIGESTS",
    "MAX_CACHE_DURATION",
    "TOKEN_COUNT",
    "Attempt",
    "BindingError",
    "BlockLoad",
    "BlockTrack",
    "ConnectionWorkers",
    "LoadResult",
    "MoqtHolder",
    "MoqtPool",
    "ParallelLoad",
    "ParallelLoadError",
    "ProcessWorkers",
    "Source",
    "TrackInfo",
    "block_info",
    "fetch_into",
    "load_block",
    "load_block_parallel",
    "load_by_namespace",
    "sink_for_record",
    "split_layers",
    "subscribe_block",
]
