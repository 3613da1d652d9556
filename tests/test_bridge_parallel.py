"""Parallel block loads (issue 9; kvsp_moq/bridge/parallel.py, _workers.py; docs/binding.md
§12): one block's layers split into N contiguous layer ranges (object ranges, binding §5),
each FETCHed over its own QUIC connection, in-process or in worker processes that receive
straight into the caller's shared-memory torch buffer.

Everything is real: a MoqtHolder on loopback QUIC, a real tampering publisher, real worker
processes (spawned), real shared memory. No mocks, no sleeps: waits are on protocol, sink or
process events (``within`` only turns a hang into a failure); a stuck range is made with a
source whose UDP port, the test's own, nobody answers (its connect hangs until cancelled).

Nothing outlives a load: the shared memory (fd-passed torch segments, named ``torch_<pid>_...``
by the process that made them, unlinked at once) is freed when the sink and the workers are
gone, also when a worker was killed, and the workers leave nothing in their ``TMPDIR``. Only
what the test's own processes made is counted (tests/leftovers_support.py): other processes on
the machine have segments of their own."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge_support import (
    HolderNode,
    TamperingPublisher,
    client_config,
    make_key,
    make_layers,
    record_at,
    within,
)
from kvsp_moq.bridge import (
    ConnectionWorkers,
    ParallelLoad,
    ParallelLoadError,
    ProcessWorkers,
    Source,
    load_block,
    load_block_parallel,
    sink_for_record,
    split_layers,
)
from kvsp_moq.sinks import LayerFailed, LayerState
from leftovers_support import left_in, own_segments, shm_mappings as mapped_by
from receive_path_support import lands_natively

torch = pytest.importorskip("torch")

LAYERS = 8
GUARD = 120.0  # worker processes import torch and aioquic when they start


def tensor_octets(sink, layer: int) -> bytes:
    k, v = sink.layer(layer)
    return (k.contiguous().view(torch.uint8).numpy().tobytes()
            + v.contiguous().view(torch.uint8).numpy().tobytes())


def shm_mappings(pid: int | str = "self") -> list[str]:
    """Shared-memory mappings of torch's segments in a process (``/proc/PID/maps``)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [line for line in maps.splitlines() if "/torch_" in line]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
async def holder():
    node = await HolderNode().start()
    try:
        yield node
    finally:
        await node.close()


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A moqt:// URL on a UDP port this test holds and never reads: a connect to it hangs, and
    no other process on the machine can take the port meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"moqt://127.0.0.1:{s.getsockname()[1]}/moq"


def test_split_layers() -> None:
    assert split_layers(range(8), 3) == [(0, 2), (3, 5), (6, 7)]
    assert split_layers(range(8), 1) == [(0, 7)]
    assert split_layers([2, 3], 4) == [(2, 2), (3, 3)]  # never more ranges than layers
    assert split_layers([0, 1, 5, 6], 2) == [(0, 1), (5, 6)]  # ranges over what is missing
    assert split_layers([], 2) == []
    with pytest.raises(ValueError):
        split_layers(range(4), 0)


async def sequential(record, layers) -> dict[int, bytes]:
    sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
    result = await within(load_block(record, sink, config=client_config()))
    assert result.complete
    return {layer: tensor_octets(sink, layer) for layer in range(LAYERS)}


@pytest.mark.parametrize("parallel", [1, 2, 3])
async def test_connections_bit_identical_to_sequential(holder: HolderNode, parallel: int) -> None:
    key, layers = make_key(40 + parallel), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    expected = await sequential(record, layers)
    sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
    async with ConnectionWorkers(parallel, client_config()) as workers:
        load = ParallelLoad(sink, [Source.from_record(record)], workers)
        seen: list[int] = []

        async def consumer() -> None:  # layer-wise, ascending, while the load runs
            async for layer, _kv in load.ascending():
                seen.append(layer)
                assert all(sink.state(x) is LayerState.READY for x in range(layer + 1))

        result, _ = await within(asyncio.gather(load.run(), consumer()))
        # One QUIC connection per range: each pool holds its own session to the holder.
        sessions = {id(await p.get(holder.url)) for p in workers.pools}
        assert len(sessions) == parallel
    assert result.complete and result.verified == tuple(range(LAYERS))
    assert [a.layers for a in result.attempts] == split_layers(range(LAYERS), parallel)
    assert seen == list(range(LAYERS))
    for layer in range(LAYERS):
        assert tensor_octets(sink, layer) == expected[layer] == holder.payload(key, layer)


async def test_processes_bit_identical_and_release_shared_memory(holder: HolderNode) -> None:
    """N = 1, 2, 3 worker processes (one set of three, reused); layers land in the caller's
    shared buffer, bit for bit as the sequential path; nothing of the shared memory remains
    in the workers after each load, nor in /dev/shm after close."""
    key, layers = make_key(50), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    expected = await sequential(record, layers)
    workers = await within(ProcessWorkers(3, client_config()).start(), GUARD)
    pids = workers.pids
    seen: set[int] = set()  # inodes of what the workers map in /dev/shm
    try:
        assert len(set(pids)) == 3 and os.getpid() not in pids
        await within(workers.warm([holder.url]))
        for parallel in (1, 2, 3):
            sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch",
                                   shared_memory=True)
            load = ParallelLoad(sink, [Source.from_record(record)], workers, parallel=parallel)
            order: list[int] = []

            async def consumer() -> None:
                async for layer, _kv in load.ascending():
                    order.append(layer)

            result, _ = await within(asyncio.gather(load.run(), consumer()))
            assert result.complete and result.verified == tuple(range(LAYERS))
            assert [a.layers for a in result.attempts] == split_layers(range(LAYERS), parallel)
            assert order == list(range(LAYERS))
            for layer in range(LAYERS):
                assert tensor_octets(sink, layer) == expected[layer]
            seen |= mapped_by(pids).keys()
            # Each worker dropped its mapping of our buffer before it reported "done".
            for pid in pids:
                assert shm_mappings(pid) == []
            del sink, load
        # load_block(parallel=, workers=) on the same set; a sink not yet shared is moved.
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
        result = await within(load_block(record, sink, parallel=2, workers=workers))
        assert result.complete and sink.is_shared
        assert all(tensor_octets(sink, x) == expected[x] for x in range(LAYERS))
        del sink
    finally:
        await within(workers.close())
    assert all(gone(pid) for pid in pids)
    gc.collect()
    assert shm_mappings() == []  # our sinks are gone: so is their shared memory
    assert own_segments([os.getpid(), *pids], seen) == set()  # fd-passed: never had a name to leak


@pytest.mark.parametrize("workers", ["connections", "processes"])
async def test_tampered_layer_detected_and_reported(holder: HolderNode, workers: str) -> None:
    """A real publisher serving the replica with one flipped byte in layer 4: the range
    holding it verifies the layers before it, reports layer 4's digest mismatch, and (no other
    source) lists 4 to recompute, with the rest of its range where the receive path stops at
    the first bad layer (the Python path; the native data plane verifies layer 5 as it
    lands); the other ranges are complete. Never exposed."""
    key, layers = make_key(60), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    payloads = {layer: holder.payload(key, layer) for layer in range(LAYERS)}
    liar = await TamperingPublisher().start(record.block_name(), payloads,
                                            list(record.layer_digests), bad_layer=4)
    try:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch")
        result = await within(load_block_parallel(record_at(record, liar.url), sink,
                                                  parallel=3, workers=workers,
                                                  config=client_config()), GUARD)
    finally:
        await liar.close()
    # Ranges (0,2) (3,5) (6,7): the second one fails at layer 4.
    after = (5,) if lands_natively(sink) else ()
    assert result.recompute == ((4,) if after else (4, 5))
    assert result.verified == (0, 1, 2, 3, *after, 6, 7)
    bad = [a for a in result.attempts if a.error is not None]
    assert len(bad) == 1 and bad[0].layers == (3, 5) and bad[0].verified == (3, *after)
    assert "layer 4" in bad[0].error and "digest mismatch" in bad[0].error
    assert sink.state(4) is LayerState.FAILED
    with pytest.raises(LayerFailed):
        sink.layer(4)
    for layer in result.verified:
        assert tensor_octets(sink, layer) == payloads[layer]
    del sink
    gc.collect()
    assert shm_mappings() == [] and own_segments([os.getpid()]) == set()


async def test_processes_tampered_range_falls_back_to_the_next_source(holder: HolderNode) -> None:
    """Two sources, three ranges: range i tries source i mod 2 first (striping across
    replicas), so ranges 0 and 2 start at the liar; layer 1's mismatch sends what range 0
    still misses to the holder: 1..2 where the receive path stops at the first bad layer (the
    Python path), 1 alone where the native data plane verified 2 as it landed. The load
    completes with the holder's bytes."""
    key, layers = make_key(61), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    payloads = {layer: holder.payload(key, layer) for layer in range(LAYERS)}
    liar = await TamperingPublisher().start(record.block_name(), payloads,
                                            list(record.layer_digests), bad_layer=1)
    try:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch",
                               shared_memory=True)
        result = await within(load_block_parallel([record_at(record, liar.url), record], sink,
                                                  parallel=3, workers="processes",
                                                  config=client_config()), GUARD)
    finally:
        await liar.close()
    assert result.complete
    after = (2,) if lands_natively(sink) else ()
    urls = [(a.url, a.layers, a.verified, a.error is None) for a in result.attempts]
    assert urls == [(liar.url, (0, 2), (0, *after), False),
                    (holder.url, (1, 1) if after else (1, 2), (1,) if after else (1, 2), True),
                    (holder.url, (3, 5), (3, 4, 5), True), (liar.url, (6, 7), (6, 7), True)]
    assert "layer 1" in (result.attempts[0].error or "")
    assert "digest mismatch" in (result.attempts[0].error or "")
    assert all(tensor_octets(sink, x) == payloads[x] for x in range(LAYERS))


async def stuck_second_range(holder: HolderNode, seed: int, silent_url: str):
    """A block whose range 1 (of 2) is stuck: it tries a source nobody answers first."""
    key, layers = make_key(seed), make_layers(LAYERS)
    holder.put(key, layers)
    record = holder.holder.replica_record(key)
    sources = [Source.from_record(record), Source.from_record(record_at(record, silent_url))]
    return key, layers, record, sources


async def test_worker_killed_mid_load_its_range_is_reported(
        holder: HolderNode, silent_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL to the worker of the stuck range, mapping the caller's buffer: its range is
    reported, and nothing of the load outlives it and the sink: no segment of the test's
    processes in /dev/shm, no mapping left in the caller, nothing in the workers' TMPDIR."""
    key, layers, record, sources = await stuck_second_range(holder, 62, silent_url)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.gettempdir())  # this process keeps its own
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' (spawned with this environment)
    workers = await within(ProcessWorkers(2, client_config(), connect_timeout=60.0).start(), GUARD)
    pids = workers.pids
    try:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch",
                               shared_memory=True)
        load = ParallelLoad(sink, sources, workers)
        run = asyncio.ensure_future(load.run())
        await within(sink.wait_for_layer(3))  # range 0 (0..3) is in; range 1 hangs connecting
        assert shm_mappings(pids[1]) != []  # it is killed while it maps our buffer
        seen = set(mapped_by(pids))
        os.kill(pids[1], signal.SIGKILL)
        result = await within(run)
        assert result.verified == (0, 1, 2, 3) and result.recompute == (4, 5, 6, 7)
        assert any(a.layers == (4, 7) and "exited" in (a.error or "") for a in result.attempts)
        with pytest.raises(LayerFailed, match="exited"):
            await load.wait_for_layer(4)
        # A set with a dead worker refuses further loads with a clear error.
        with pytest.raises(ParallelLoadError, match="start a new ProcessWorkers"):
            await load_block_parallel(sources, sink, workers=workers)
        assert sink.state(4) is LayerState.FAILED  # still listed to recompute
    finally:
        await within(workers.close())
    assert all(gone(pid) for pid in pids)
    del sink, load, run
    gc.collect()
    assert shm_mappings() == []
    assert own_segments([os.getpid(), *pids], seen) == set()
    assert left_in(tmp_path) == []


@pytest.mark.parametrize("kind", ["connections", "processes"])
async def test_cancel_stops_every_range_and_workers_stay_usable(holder: HolderNode, silent_url: str,
                                                                kind: str) -> None:
    key, layers, record, sources = await stuck_second_range(holder, 63, silent_url)
    workers = (ConnectionWorkers(2, client_config(), connect_timeout=60.0) if kind == "connections"
               else ProcessWorkers(2, client_config(), connect_timeout=60.0))
    await within(workers.start(), GUARD)
    pids = getattr(workers, "pids", ())
    try:
        sink = sink_for_record(record, layers.geometry, layers.tokens, backend="torch",
                               shared_memory=kind == "processes")
        load = ParallelLoad(sink, sources, workers)
        run = asyncio.ensure_future(load.run())
        await within(sink.wait_for_layer(3))
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(run)
        # Acknowledged: nothing is in flight any more; the stuck range failed "cancelled".
        assert sink.ready_layers == (0, 1, 2, 3)
        assert all(sink.state(x) is LayerState.FAILED for x in range(4, LAYERS))
        assert "cancelled" in (sink.failure_reason(4) or "")
        # The same workers load the rest from the holder (failed layers are retried).
        result = await within(ParallelLoad(sink, sources[:1], workers).run())
        assert result.complete
        assert all(tensor_octets(sink, x) == holder.payload(key, x) for x in range(LAYERS))
    finally:
        await within(workers.close())
    assert all(gone(pid) for pid in pids)


async def test_clear_errors() -> None:
    layers = make_layers(2)
    from kvsp_moq.sinks import make_sink
    digests = [b"\x00" * 32] * 2
    with pytest.raises(ParallelLoadError, match="parallel"):
        ConnectionWorkers(0)
    async with ConnectionWorkers(2) as workers:
        sink = make_sink(layers.geometry, layers.tokens, (0, 1), digests, backend="torch")
        with pytest.raises(ParallelLoadError, match="1..2"):
            ParallelLoad(sink, [], workers, parallel=3)
    with pytest.raises(ParallelLoadError, match="parallel= is needed"):
        await load_block_parallel([], sink, workers="processes")
    with pytest.raises(ParallelLoadError, match="unknown workers"):
        await load_block_parallel([], sink, parallel=2, workers="threads")  # type: ignore[arg-type]
    numpy_sink = make_sink(layers.geometry, layers.tokens, (0, 1), digests, backend="numpy")
    unstarted = ProcessWorkers(1)
    with pytest.raises(ParallelLoadError, match="needs a CPU TorchSink"):
        await unstarted.load_ranges(numpy_sink, [], [(0, 1)], 1.0, [None])
    with pytest.raises(ParallelLoadError, match="not started"):
        await unstarted.load_ranges(sink, [], [(0, 1)], 1.0, [None])
