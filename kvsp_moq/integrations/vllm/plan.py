"""What the scheduler side tells the worker side each step, and what comes back.

vLLM's connector roles talk only through the metadata built each step
(``build_connector_meta`` -> ``bind_connector_metadata``, and back through
``build_connector_worker_meta`` -> ``update_connector_output``); the scheduler and the
workers may be separate processes, so these are plain picklable dataclasses. Replica Records
travel as their JSON objects (§4.4) and are parsed, hence checked, again on the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["BlockLoad", "BlockSave", "COUNTERS", "RequestLoad", "RequestSave", "StepPlan", "merge_counts", "merge_marks"]

#: The per-request counters the worker reports (docs/vllm.md "Counters").
COUNTERS = ("blocks_moqt", "blocks_http", "blocks_failed", "bytes_moqt", "bytes_http",
            "blocks_published", "publish_errors", "publish_dropped", "blocks_coded", "coded_bytes_moqt",
            "coded_bytes_http")


@dataclass(frozen=True)
class BlockLoad:
    """One external KVSP block: where vLLM allocated the pages it fills and, per tensor-parallel
    rank (index = rank), its Block Key and the records of its replicas (each rank's shard is a
    block of its own, docs/binding.md "Tensor parallelism").

    A KVSP block is m of vLLM's blocks (pages, ``block_tokens`` in docs/vllm.md); ``pages``
    lists (page within the block, vLLM's block id) of those to fill: all m, or the last ones
    when vLLM's own prefix cache holds the first."""

    index: int  # the block's position in the prompt
    pages: tuple[tuple[int, int], ...]
    block_keys: tuple[bytes, ...]
    records: tuple[tuple[Mapping[str, object], ...], ...]
    #: Streamed from the request's prefill engine (:mod:`.stream`: SUBSCRIBE to the replica
    #: named by the stream id) rather than FETCHed from a recorded replica.
    streamed: bool = False

    @property
    def block_ids(self) -> tuple[int, ...]:
        """vLLM's block ids the load fills (reported failed together)."""
        return tuple(bid for _, bid in self.pages)


@dataclass(frozen=True)
class RequestLoad:
    req_id: str
    scope_id: bytes
    #: The request's Compatibility ID per rank (its adapters included, §4.1).
    compat_ids: tuple[bytes, ...]
    blocks: tuple[BlockLoad, ...]
    #: Asynchronous (the request waits outside the batch until ``get_finished`` reports it) or
    #: layer-wise during this step's forward pass.
    asynchronous: bool = True
    #: The request's stream id (:mod:`.stream`): the Replica ID of its streamed blocks.
    stream_id: bytes | None = None
    #: The codec the operator's ``codec_policy`` names for the request (its registry name,
    #: ``ConnectorSettings.codec_of``); None: raw, bit-exact.
    codec: str | None = None


@dataclass(frozen=True)
class BlockSave:
    """A prompt block that becomes complete in this step (computed by this engine): vLLM's
    block ids of its pages, in order, and its Block Key per rank."""

    index: int
    block_ids: tuple[int, ...]
    block_keys: tuple[bytes, ...]


@dataclass(frozen=True)
class RequestSave:
    req_id: str
    scope_id: bytes
    compat_ids: tuple[bytes, ...]
    blocks: tuple[BlockSave, ...]
    #: The stream the request produces (:mod:`.stream`): each block's Replica ID is derived
    #: from it; None: fresh random ones.
    stream_id: bytes | None = None


@dataclass
class StepPlan:
    """The loads and saves of one engine step."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
    #: The requests of this step that produce a stream (:mod:`.stream`): the workers mark the
    #: end of the step's forward pass for each.
    producing: list[str] = field(default_factory=list)


def merge_counts(into: dict[str, dict[str, int]], other: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Add ``other``'s per-request counters to ``into`` (returned)."""
    for req, counts in other.items():
        mine = into.setdefault(req, {})
        for name, value in counts.items():
            mine[name] = mine.get(name, 0) + value
    return into


def merge_marks(into: dict[str, dict[str, list[int]]],
                other: Mapping[str, Mapping[str, list[int]]]) -> dict[str, dict[str, list[int]]]:
    """Add ``other``'s per-request time marks (monotonic ns lists) to ``into`` (returned)."""
    for req, marks in other.items():
        mine = into.setdefault(req, {})
        for name, values in marks.items():
            mine.setdefault(name, []).extend(values)
    return into
