"""``kvsp bench vllm``'s figures and its per-round checks, without vLLM (the bench itself needs
three or four engine processes, minutes on CI's 2 cores: it is run by hand, docs/benchmarks.md),
its refusals of bad arguments (exit 2) before anything starts (a ``--backend`` this build cannot
run included), the QUIC backend the bench gives the processes it starts (real child processes),
the geometries' KV octets, and
the LMCache server's failure path and log reading (without lmcache), and, where lmcache is
installed, the real LMCache server with its Redis L2 (a real redis-server), started and stopped
without an engine."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from redis_support import REDIS_SERVER
from system_programs import require

from kvsp_moq.cli import main
from kvsp_moq.cli.bench.vllm import Samples, check_round, figures, kv_bytes_per_token_layer
from kvsp_moq.cli.bench.vllm.direct import TOKEN_BYTES, DirectRate, direct_rate
from kvsp_moq.cli.bench.vllm.lmcache import (
    LmcacheServer,
    check_lmcache,
    check_redis_load,
    chunk_tokens,
    lmcache_missing,
    redis_missing,
)
from kvsp_moq.cli.bench.vllm.quic_backend import check_processes, on_backend, process_backend, quic_backend_env
from kvsp_moq.cli.errors import UsageError
from kvsp_moq.integrations.vllm.engine_process import EngineSpec
from kvsp_moq.integrations.vllm.tiny_model import LLAMA3_8B_LAYERS, TinyLlama
from kvsp_moq.transport import available_backends
from kvsp_moq.transport.config import BACKEND_ENV

N = 256  # 8 blocks of 32
KV = N * 4 * 512  # the tiny Llama in fp32: 4 layers x 2 KV heads x 32 x (K, V) x 4 octets


def _answer(first: int, **kvsp: int) -> dict[str, Any]:
    return {"token_ids": [first], "elapsed_s": 0.01, "kv_transfer_params": {"kvsp": kvsp} if kvsp else None}


def _round(**changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    loaded = {"external_tokens": N, "blocks_moqt": N // 32, "bytes_moqt": KV}
    answers = {"publish": _answer(7, blocks_published=N // 32), "kvsp": _answer(7, external_tokens=N),
               "kvsp_warm_relay": _answer(7, **loaded), "local_hit": _answer(7, external_tokens=0, local_tokens=N),
               "recompute": _answer(7), "example_connector_store": _answer(7), "example_connector": _answer(7)}
    answers.update(changes)
    return answers


RELAY = {"kvsp": {"relay_fetches_total": 8.0, "relay_upstream_fetches_total": 8.0},
         "kvsp_warm_relay": {"relay_fetches_total": 8.0, "relay_upstream_fetches_total": 0.0}}


def _samples(rounds: dict[str, tuple[float, ...]], **fields: Any) -> Samples:
    samples = Samples(N, **fields)
    for way, seconds in rounds.items():
        for s in seconds:
            samples.add(way, {"elapsed_s": s})
    return samples


ROUNDS = {"kvsp": (0.030, 0.020), "kvsp_warm_relay": (0.012, 0.015), "local_hit": (0.004, 0.005),
          "recompute": (0.060, 0.020), "example_connector": (0.015, 0.040), "example_connector_store": (0.070, 0.080)}


def _by_names(figs: list[Any]) -> dict[tuple[str, str], dict[str, Any]]:
    lines = [json.loads(f.json_line()) for f in figs]
    return {(d["name"], d["baseline_name"]): d for d in lines}


def test_each_way_beside_recomputing_and_kvsp_beside_vllm_s_own_connector() -> None:
    by = _by_names(figures(_samples(ROUNDS), {"model": "tiny-llama"}))
    # no LMCache samples, no direct rate: no rows for them
    assert set(by) == {
        ("vllm_ttft_kvsp_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_kvsp_warm_relay_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_local_hit_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_example_connector_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_kvsp_vs_example_connector_prefix256", "vllm_ttft_example_connector_prefix256"),
    }
    kvsp = by[("vllm_ttft_kvsp_prefix256", "vllm_ttft_recompute_prefix256")]
    # the best of the rounds, each way on its own; every sample kept
    assert kvsp["value"] == 20.0 and kvsp["baseline_value"] == 20.0 and kvsp["ratio"] == 1.0
    assert kvsp["unit"] == "ms" and kvsp["params"]["rounds"] == 2 and kvsp["params"]["prefix_tokens"] == N
    assert kvsp["params"]["samples_ms"]["recompute"] == [60.0, 20.0]
    assert "lmcache" not in kvsp["params"]["samples_ms"]
    vs = by[("vllm_ttft_kvsp_vs_example_connector_prefix256", "vllm_ttft_example_connector_prefix256")]
    assert vs["value"] == 20.0 and vs["baseline_value"] == 15.0
    assert by[("vllm_ttft_local_hit_prefix256", "vllm_ttft_recompute_prefix256")]["value"] == 4.0


def test_load_rates_are_kv_octets_over_the_time_the_load_added_beside_the_direct_rate() -> None:
    direct = DirectRate(layers=4, layer_bytes=KV // 4, block_s=0.002, first_layer_s=0.001, repeat=3)
    samples = _samples(ROUNDS, kv_bytes=KV, direct=direct)
    by = _by_names(figures(samples, {"model": "tiny-llama"}))
    cold = by[("vllm_kvsp_load_rate_prefix256", "kv_aioquic_dgram16384_rate")]
    warm = by[("vllm_kvsp_warm_relay_load_rate_prefix256", "kv_aioquic_dgram16384_rate")]
    # best KVSP 20 ms (cold) / 12 ms (warm), best local hit 4 ms: the load added 16 / 8 ms
    assert cold["unit"] == "MB/s" and cold["value"] == pytest.approx(KV / 0.016 / 1e6, rel=1e-5)
    assert warm["value"] == pytest.approx(KV / 0.008 / 1e6, rel=1e-5)
    assert cold["baseline_value"] == pytest.approx(KV / 0.002 / 1e6, rel=1e-5) == direct.mb_s
    p = cold["params"]
    assert p["kv_bytes"] == KV and p["load_ms"] == 16.0 and p["ttft_ms"] == 20.0 and p["local_hit_ttft_ms"] == 4.0
    assert p["rate_over_ttft_mb_s"] == pytest.approx(KV / 0.020 / 1e6, rel=1e-3)
    assert p["direct_layers"] == 4 and p["direct_layer_bytes"] == KV // 4 and p["direct_block_ms"] == 2.0
    assert p["relay"].startswith("cold") and warm["params"]["relay"].startswith("warm")
    # a load that added no time has no rate (NaN), not an infinite one
    slow_floor = _samples({**ROUNDS, "local_hit": (0.030, 0.025)}, kv_bytes=KV, direct=direct)
    rate = figures(slow_floor, {})[-2]
    assert rate.name == "vllm_kvsp_load_rate_prefix256" and math.isnan(rate.value)


def test_lmcache_rows_only_where_every_round_measured_it() -> None:
    rounds = {**ROUNDS, "lmcache": (0.010, 0.008), "lmcache_store": (0.07, 0.06)}
    by = _by_names(figures(_samples(rounds), {"lmcache": "LMCacheMPConnector"}))
    assert by[("vllm_ttft_lmcache_prefix256", "vllm_ttft_recompute_prefix256")]["value"] == 8.0
    assert by[("vllm_ttft_kvsp_vs_lmcache_prefix256", "vllm_ttft_lmcache_prefix256")]["value"] == 20.0
    warm = by[("vllm_ttft_kvsp_warm_relay_vs_lmcache_prefix256", "vllm_ttft_lmcache_prefix256")]
    assert warm["value"] == 12.0 and warm["baseline_value"] == 8.0 and warm["ratio"] == 1.5
    partial = _by_names(figures(_samples({**ROUNDS, "lmcache": (0.010,)}), {}))
    assert not [name for name, _ in partial if "lmcache" in name]


def test_a_round_passes_only_when_b_loaded_every_prefix_block_over_moqt_and_the_tokens_agree() -> None:
    check_round(N, _round(), RELAY, KV)  # the first has the scheduler's figures only (max_tokens=1)
    for why, relay in {"a FETCH missing": {**RELAY, "kvsp": {**RELAY["kvsp"], "relay_fetches_total": 7.0}},
                       "warm went upstream": {**RELAY, "kvsp_warm_relay": RELAY["kvsp"]}}.items():
        with pytest.raises(RuntimeError):
            check_round(N, _round(), relay)
            pytest.fail(why)
    bad = {
        "A published too little": _round(publish=_answer(7, blocks_published=3)),
        "a block came over HTTP": _round(kvsp=_answer(7, external_tokens=N, blocks_moqt=7, blocks_http=1)),
        "a block failed": _round(kvsp_warm_relay=_answer(7, external_tokens=N, blocks_moqt=8, blocks_failed=1)),
        "fewer hit tokens": _round(kvsp=_answer(7, external_tokens=N - 32, blocks_moqt=7)),
        "other octets": _round(kvsp_warm_relay=_answer(7, external_tokens=N, blocks_moqt=8, bytes_moqt=KV // 2)),
        "the local hit missed a block": _round(local_hit=_answer(7, external_tokens=0, local_tokens=N - 32)),
        "the local hit loaded": _round(local_hit=_answer(7, external_tokens=32, local_tokens=N - 32)),
        "another first token": _round(example_connector=_answer(8)),
    }
    for why, answers in bad.items():
        with pytest.raises(RuntimeError):
            check_round(N, answers, RELAY, KV)
            pytest.fail(why)


def test_an_lmcache_round_counts_only_with_one_retrieval_of_the_prefix_and_the_recomputed_token() -> None:
    answers = {"lmcache_store": _answer(7), "lmcache": _answer(7)}
    check_lmcache(N, answers, [N], [7])
    for why, (retrieved, first) in {"nothing retrieved": ([], [7]), "a chunk short": ([N - 32], [7]),
                                    "retrieved twice": ([N, N], [7]), "another token": ([N], [8])}.items():
        with pytest.raises(RuntimeError):
            check_lmcache(N, answers, retrieved, first)
            pytest.fail(why)
    # LMCache's default chunk where the prefix is a multiple of it, else vLLM's block
    assert chunk_tokens(2048, 32) == 256 and chunk_tokens(1024, 32) == 256 and chunk_tokens(96, 32) == 32


def test_an_lmcache_load_counts_only_where_redis_served_it() -> None:
    check_redis_load(8, 0, 8)
    check_redis_load(8, 0, 9)  # a GET more (a retry) is still Redis's load
    for why, (stored, l1_objects, gets) in {"nothing stored in Redis": (0, 0, 0), "L1 still had it": (8, 8, 8),
                                            "Redis not read": (8, 0, 0), "a chunk not read": (8, 0, 7)}.items():
        with pytest.raises(RuntimeError):
            check_redis_load(stored, l1_objects, gets)
            pytest.fail(why)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_lmcache_server_s_failure_is_reported_and_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    require(REDIS_SERVER)  # the server's Redis L2 starts first
    said: list[str] = []
    server = LmcacheServer(256, said.append, module="kvsp_moq.no_such_module")
    with pytest.raises(RuntimeError, match="exited") as failed:
        server.start(timeout=60)
    assert "No module named" in str(failed.value)
    redis = server.redis.process
    assert redis is not None and redis.poll() is None  # its Redis had started
    server.close()
    assert not server.workdir.exists() and server.process is not None and server.process.returncode is not None
    assert redis.returncode is not None and not _port_open(server.redis.port)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    missing = lmcache_missing()
    assert missing is not None and missing.startswith("lmcache not installed") and "--no-deps" in missing
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    missing = redis_missing()
    assert missing is not None and missing.startswith("lmcache: redis-server not installed")
    without = LmcacheServer(256, said.append)
    with pytest.raises(RuntimeError, match="redis-server not installed"):
        without.start(timeout=60)
    without.close()
    assert not without.workdir.exists() and without.process is None


@pytest.mark.skipif(lmcache_missing() is not None, reason="lmcache not installed (optional: docs/vllm.md \"Benchmark\")")
def test_the_lmcache_server_runs_over_its_own_redis_and_leaves_nothing() -> None:
    require(REDIS_SERVER)
    said: list[str] = []
    server = LmcacheServer(256, said.append)
    try:
        server.start(timeout=120)
        assert server.process is not None and server.process.poll() is None
        redis = server.redis.process
        assert redis is not None and redis.poll() is None
        storage = server.status()["storage_manager"]
        # its L2 is the RESP client on our Redis; nothing stored yet, nothing in L1
        assert [a["type"] for a in storage["l2_adapters"]] == ["LMCacheRedisClient"]
        assert storage["store_controller"]["num_active_adapters"] == 1
        assert server.wait_in_redis(timeout=10) == 0
        assert server.redis.counters() == {"keys": 0, "gets": 0}
        log = server.tail(200)
        assert "Created RESP L2 adapter: 127.0.0.1:%d" % server.redis.port in log
        assert any("Redis L2" in line and "L1 skipped" in line for line in said)
    finally:
        server.close()
    assert server.process.returncode is not None and redis.returncode is not None
    assert not _port_open(server.redis.port) and not _port_open(server.port)
    assert not server.workdir.exists()


def test_the_lmcache_server_s_retrievals_are_read_from_its_log() -> None:
    server = LmcacheServer(256, lambda _: None)
    try:
        server.log_path.write_text("x Stored 256 tokens in 0.01 seconds\nx Retrieved 256 tokens in 0.003 seconds\n"
                                   "x Retrieved 2048 tokens in 0.010 seconds\n")
        assert server.retrieved() == [256, 2048]
        assert server.wait_retrieved(1, timeout=0) == [256, 2048]
        assert server.wait_retrieved(3, timeout=0) == [256, 2048]  # what there is once the bound passed
    finally:
        server.close()
    assert not server.workdir.exists()


def test_the_geometries_kv_octets(tmp_path: Path) -> None:
    assert TinyLlama().kv_bytes_per_token() == 4 * 2 * 2 * 32 * 4  # the tests' model: 2 KiB a token
    l8 = LLAMA3_8B_LAYERS
    assert (l8.hidden, l8.heads, l8.kv_heads, l8.head_dim, l8.intermediate, l8.dtype) == \
        (4096, 32, 8, 128, 14336, "bfloat16")
    assert l8.kv_bytes_per_token() == l8.layers * 2 * 8 * 128 * 2  # Llama-3-8B's 128 KiB over 32 layers
    with pytest.raises(ValueError):
        TinyLlama(dtype="int8")
    configs = {"tiny": ({"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                         "num_key_value_heads": 2}, "float32", (4, 512)),
               "llama8b": ({"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "head_dim": 128}, "bfloat16", (2, 4096))}
    for name, (config, dtype, want) in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert kv_bytes_per_token_layer(tmp_path / name, dtype) == want
    with pytest.raises(UsageError):
        kv_bytes_per_token_layer(tmp_path, "float32")


def test_the_direct_baseline_s_block_and_name() -> None:
    d = DirectRate(layers=2, layer_bytes=8 << 20, block_s=0.1, first_layer_s=0.05)
    assert d.name == "kv_aioquic_dgram16384_rate" and d.block_bytes == 16 << 20
    native = DirectRate(layers=2, layer_bytes=8 << 20, block_s=0.1, first_layer_s=0.05, backend="native")
    assert native.name == "kv_native_dgram16384_rate" and "(native," in native.params()["direct"]
    assert d.mb_s == pytest.approx((16 << 20) / 0.1 / 1e6)
    for layers, layer_bytes in ((0, TOKEN_BYTES), (2, TOKEN_BYTES + 1), (2, 0)):
        with pytest.raises(ValueError):  # refused before any process starts
            direct_rate(layers, layer_bytes)


def test_bad_arguments_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--prefix-tokens", "100"], ["--prefix-tokens", "0"], ["--hidden", "100"], ["--repeat", "0"],
                 ["--geometry", "llama8b", "--hidden", "256"], ["--hidden", "256", "--model-dir", "/models/m"],
                 ["--geometry", "llama8b", "--model-dir", "/models/m"], ["--block-tokens", "48"],
                 ["--block-tokens", "512", "--prefix-tokens", "256"]):
        assert main(["bench", "vllm", *args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("kvsp: ") and args[0] in last, last
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm", "--geometry", "llama70b"])
    assert exited.value.code == 2 and "llama70b" in capsys.readouterr().err


def test_bad_disagg_arguments_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--disagg", "--prompt-tokens", "10"], ["--disagg", "--prompt-tokens", "4000"],
                 ["--disagg", "--chunk-tokens", "8"], ["--disagg", "--repeat", "0"], ["--prompt-tokens", "500"],
                 ["--chunk-tokens", "256"], ["--no-cpu-split"]):
        assert main(["bench", "vllm", *args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("kvsp: ") and (args[-1] in last or args[-2] in last), last
    for args in (["demo", "--disagg"], ["demo", "--engine", "vllm", "--decoders", "2"],
                 ["demo", "--engine", "vllm", "--disagg", "--decoders", "4"]):
        assert main(args) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("kvsp: ") and ("--disagg" in last or "--decoders" in last), last


def test_a_backend_this_build_cannot_run_exits_2_saying_why_before_anything_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for args in (["--backend", "quiche"], ["--disagg", "--backend", "quiche"]):
        assert main(["bench", "vllm", *args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("kvsp: --backend quiche: unknown transport backend") and "aioquic" in last, last
    # a backend the transport knows but cannot load here names what is missing (aiopquic on
    # Python < 3.12 or without its package, native without its extension)
    for name in sorted({"aiopquic", "native"} - set(available_backends())):
        assert main(["bench", "vllm", "--backend", name]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"kvsp: --backend {name}: QUIC backend '{name}'") and "install" in last, last
    # without --backend, $KVSP_QUIC_BACKEND decides, and is named where it is the culprit
    monkeypatch.setenv(BACKEND_ENV, "quiche")
    assert main(["bench", "vllm"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"kvsp: ${BACKEND_ENV}=quiche (the default of --backend): unknown"), last


def test_the_backend_reaches_the_processes_the_bench_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the bench gives each process that speaks QUIC: $KVSP_QUIC_BACKEND in the environment
    the relay and the engines start with (the engines' specs name it too), read back from a real
    child's /proc/PID/environ; the child's TransportConfig runs on it. Restored afterwards."""
    monkeypatch.setenv(BACKEND_ENV, "qh3")
    spec = on_backend(EngineSpec("model", env={"OTHER": "1"}), "native")
    assert spec.env == {"OTHER": "1", BACKEND_ENV: "native"}
    show = "from kvsp_moq.transport import TransportConfig; print(TransportConfig().backend, flush=True); input()"
    with quic_backend_env("aioquic"):
        assert os.environ[BACKEND_ENV] == "aioquic"
        child = subprocess.Popen([sys.executable, "-c", show], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
    assert os.environ[BACKEND_ENV] == "qh3"
    unset = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE, text=True,
                             env={k: v for k, v in os.environ.items() if k != BACKEND_ENV})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "aioquic"
        assert check_processes("aioquic", {"relay": child.pid}) == {"relay": "aioquic"}
        assert process_backend(unset.pid) is None
        with pytest.raises(RuntimeError, match="engine B"):
            check_processes("aioquic", {"relay": child.pid, "engine B": unset.pid})
    finally:
        for proc in (child, unset):
            proc.communicate("\n", timeout=30)
