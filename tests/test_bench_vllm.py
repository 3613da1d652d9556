"""``kvsp bench vllm``'s figures and its per-round checks, without vLLM (the bench itself needs
three engine processes, minutes on CI's 2 cores: it is run by hand, docs/benchmarks.md), and its
refusals of bad arguments (exit 2) before anything starts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvsp_moq.cli import main
from kvsp_moq.cli.bench.vllm import Samples, check_round, figures

N = 256  # 8 blocks of 32


def _answer(first: int, **kvsp: int) -> dict[str, Any]:
    return {"token_ids": [first], "elapsed_s": 0.01, "kv_transfer_params": {"kvsp": kvsp} if kvsp else None}


def _round(**changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    loaded = {"external_tokens": N, "blocks_moqt": N // 32, "bytes_moqt": 8 * 4 * 16384}
    answers = {"publish": _answer(7, blocks_published=N // 32), "kvsp": _answer(7, external_tokens=N),
               "kvsp_warm_relay": _answer(7, **loaded), "recompute": _answer(7),
               "example_connector_store": _answer(7), "example_connector": _answer(7)}
    answers.update(changes)
    return answers


RELAY = {"kvsp": {"relay_fetches_total": 8.0, "relay_upstream_fetches_total": 8.0},
         "kvsp_warm_relay": {"relay_fetches_total": 8.0, "relay_upstream_fetches_total": 0.0}}


def test_each_way_beside_recomputing_and_kvsp_beside_vllm_s_own_connector() -> None:
    samples = Samples(N)
    rounds = {"kvsp": (0.030, 0.020), "kvsp_warm_relay": (0.012, 0.015), "recompute": (0.060, 0.020),
              "example_connector": (0.015, 0.040), "example_connector_store": (0.070, 0.080)}
    for way, seconds in rounds.items():
        for s in seconds:
            samples.add(way, {"elapsed_s": s})
    figs = figures(samples, {"model": "tiny-llama"})
    lines = [json.loads(f.json_line()) for f in figs]
    by = {(d["name"], d["baseline_name"]): d for d in lines}
    assert set(by) == {
        ("vllm_ttft_kvsp_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_kvsp_warm_relay_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_example_connector_prefix256", "vllm_ttft_recompute_prefix256"),
        ("vllm_ttft_kvsp_vs_example_connector_prefix256", "vllm_ttft_example_connector_prefix256"),
    }
    kvsp = by[("vllm_ttft_kvsp_prefix256", "vllm_ttft_recompute_prefix256")]
    # the best of the rounds, each way on its own; every sample kept
    assert kvsp["value"] == 20.0 and kvsp["baseline_value"] == 20.0 and kvsp["ratio"] == 1.0
    assert kvsp["unit"] == "ms" and kvsp["params"]["rounds"] == 2 and kvsp["params"]["prefix_tokens"] == N
    assert kvsp["params"]["samples_ms"]["recompute"] == [60.0, 20.0]
    vs = by[("vllm_ttft_kvsp_vs_example_connector_prefix256", "vllm_ttft_example_connector_prefix256")]
    assert vs["value"] == 20.0 and vs["baseline_value"] == 15.0


def test_a_round_passes_only_when_b_loaded_every_prefix_block_over_moqt_and_the_tokens_agree() -> None:
    check_round(N, _round(), RELAY)  # the first has the scheduler's figures only (max_tokens=1)
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
        "another first token": _round(example_connector=_answer(8)),
    }
    for why, answers in bad.items():
        with pytest.raises(RuntimeError):
            check_round(N, answers, RELAY)
            pytest.fail(why)


def test_bad_arguments_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--prefix-tokens", "100"], ["--prefix-tokens", "0"], ["--hidden", "100"], ["--repeat", "0"]):
        assert main(["bench", "vllm", *args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("kvsp: ") and args[0] in last, last
