"""``SessionClient.run`` (the client side of ``kvsp demo``) against a scripted front end: the
stream's last item decides the outcome. A stream that ends with ``StreamFailed`` (the PC gave
the session up) is a :class:`SessionFailed` naming the reason, not an ``AttributeError`` on
the failure item (found by mypy: the loop read ``item.index`` of every non-``StreamEnd``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvsp_moq.cli.demo.router import SessionClient, SessionFailed
from kvsp_moq.control.common.session_records import (
    ClientSession,
    ClientSessionRequest,
    OutputToken,
    StreamEnd,
    StreamFailed,
)

SESSION = uuid.UUID(int=7)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [1, *text.encode()]


class _FrontEnd:
    def __init__(self, items: list[OutputToken | StreamEnd | StreamFailed]) -> None:
        self.items = items

    async def start(self, fe_url: str, request: ClientSessionRequest) -> ClientSession:
        return ClientSession(session=SESSION, instance="http://127.0.0.1:1/", epoch=0,
                             tokens_url=f"{fe_url}sessions/{SESSION}/tokens")

    async def tokens(self, fe_url: str, session: uuid.UUID
                     ) -> AsyncIterator[OutputToken | StreamEnd | StreamFailed]:
        for item in self.items:
            yield item


def _client(items: list[OutputToken | StreamEnd | StreamFailed]) -> SessionClient:
    front_end: Any = _FrontEnd(items)  # duck-typed HttpFrontEndClient
    index: Any = None  # never asked: the prompt is shorter than one block
    return SessionClient(fe_url="http://127.0.0.1:2/", front_end=front_end, index=index,
                         scope_key=bytes(range(32)), scope_id=b"scope", compat_id=bytes(32),
                         block_tokens=64, tokenizer=_Tokenizer())


async def test_complete_stream() -> None:
    out = await _client([OutputToken(index=0, token=5), OutputToken(index=1, token=6),
                         StreamEnd(end=2)]).run("hi", max_tokens=2)
    assert out.session == SESSION and out.tokens == [5, 6] and out.prompt_blocks == 0


async def test_failed_stream_is_session_failed() -> None:
    client = _client([OutputToken(index=0, token=5),
                      StreamFailed(reason="no instance left", next=1)])
    with pytest.raises(SessionFailed, match="gave it up after 1 tokens: no instance left"):
        await client.run("hi", max_tokens=4)


async def test_failed_before_any_token() -> None:
    with pytest.raises(SessionFailed, match="after 0 tokens: model mismatch"):
        await _client([StreamFailed(reason="model mismatch", next=0)]).run("hi", max_tokens=4)
