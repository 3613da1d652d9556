"""Prefill→decode without engines: the stream a request names, and the router's HTTP API refusing
what it cannot route (docs/vllm.md "Prefill→decode"). The streams themselves, with real
engines: tests/test_vllm_disagg.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from aiohttp import ClientSession

from kvsp_moq.control.http.server import serve_app
from kvsp_moq.control.router import STREAM_PARAM, DisaggRouter
from kvsp_moq.control.router.routes import make_app
from kvsp_moq.integrations.vllm.stream import PARAM, StreamError, StreamParams, role_of

ID = "0f" * 16


def test_a_stream_is_named_by_its_id_and_the_engines_part() -> None:
    assert StreamParams.of(None, "kv_both") is None
    assert StreamParams.of({"kvsp": False}, "kv_both") is None
    p = StreamParams.of({"kvsp_stream": {"id": ID, "as": "producer"}}, "kv_both")
    assert p is not None and p.producer and p.stream_id == bytes.fromhex(ID) and p.to_json() == {"id": ID, "as": "producer"}
    # a producer or consumer engine's part goes without saying
    c = StreamParams.of({"kvsp_stream": {"id": ID}}, "kv_consumer")
    assert c is not None and c.consumer
    assert role_of("kv_producer") == ("producer",) and role_of(None) == ("producer", "consumer")


@pytest.mark.parametrize(("raw", "role", "detail"), [
    ("x", "kv_both", "must be an object"),
    ({"id": ID.upper(), "as": "producer"}, "kv_both", "lowercase hex"),
    ({"id": ID[:-2], "as": "producer"}, "kv_both", "32 lowercase hex"),
    ({"id": 7, "as": "producer"}, "kv_both", "hex"),
    ({"id": ID}, "kv_both", "must be \"producer\" or \"consumer\""),
    ({"id": ID, "as": "both"}, "kv_both", "must be \"producer\" or \"consumer\""),
    ({"id": ID, "as": "producer"}, "kv_consumer", "cannot be the stream's producer"),
    ({"id": ID, "as": "consumer"}, "kv_producer", "cannot be the stream's consumer"),
])
def test_a_malformed_stream_or_one_the_role_cannot_take_is_refused(raw: object, role: str, detail: str) -> None:
    with pytest.raises(StreamError, match=detail):
        StreamParams.of({"kvsp_stream": raw}, role)


def test_the_router_and_the_connector_name_the_stream_alike() -> None:
    assert STREAM_PARAM == PARAM


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(StreamError, match="kv_role"):
        role_of("kv_prefill")


class _Unreachable:
    """An engine the router must not reach: every request below is refused before routing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.asked = 0

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        self.asked += 1
        raise AssertionError("a refused request reached an engine")


@pytest.mark.parametrize(("body", "detail"), [
    ({"prompt": "hello", "max_tokens": 4}, "token ids"),
    ({"prompt": [], "max_tokens": 4}, "token ids"),
    ({"prompt": [1, -2], "max_tokens": 4}, "token ids"),
    ({"prompt": [1, True], "max_tokens": 4}, "token ids"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "8"}, "max_tokens"),
    ({"prompt": [1, 2], "temperature": 0.7}, "greedy"),
    ({"prompt": [1, 2], "kv_transfer_params": {"kvsp_stream": {"id": ID}}}, "router's to set"),
    ({"prompt": [1, 2], "cache_salt": 5}, "cache_salt"),
    ([1, 2], "JSON object"),
])
async def test_the_router_refuses_what_it_cannot_route(body: object, detail: str) -> None:
    prefill, decoder = _Unreachable("prefill"), _Unreachable("decode")
    server = await serve_app(make_app(DisaggRouter(prefill, [decoder])))
    port = server.port
    try:
        async with ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body)) as reply:
                assert reply.status == 400
                assert detail in (await reply.json())["error"]["message"]
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{not json") as reply:
                assert reply.status == 400
            async with http.get(f"http://127.0.0.1:{port}/health") as reply:
                assert (await reply.json()) == {"ok": True, "requests": 0}
    finally:
        await server.close()
    assert prefill.asked == decoder.asked == 0


def test_a_router_needs_decoders_and_a_fan_out_they_can_take() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DisaggRouter(_Unreachable("p"), [])
    with pytest.raises(ValueError, match="fan_out"):
        DisaggRouter(_Unreachable("p"), [_Unreachable("d")], fan_out=2)
