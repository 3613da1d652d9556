"""Setup Options the sans-IO session cannot be asked to send yet: MAX_AUTH_TOKEN_CACHE_SIZE
(draft-20 §"MAX_AUTH_TOKEN_CACHE_SIZE") and AUTHORIZATION TOKEN (§"AUTHORIZATION TOKEN").

``SessionConfig.extra_setup_options`` refuses known option types, so the relay amends the
SETUP the session queued in :meth:`Session.start`: the first ``SendStream`` action is
decoded with the public codec, the options are added, and it is re-encoded. Only public
APIs are used (``Session.actions()``, ``decode_message`` / ``encode_message``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvsp_moq.moqt.messages import Setup, Token, decode_message, encode_message
from kvsp_moq.moqt.session_events import Action, SendStream
from kvsp_moq.moqt.version import Version

__all__ = ["amend_setup"]


def amend_setup(actions: Sequence[Action], version: Version, *,
                tokens: Sequence[Token] = (), max_auth_token_cache_size: int | None = None
                ) -> list[Action]:
    """``actions`` with the SETUP among them carrying ``tokens`` and the cache size."""
    out = list(actions)
    if not tokens and max_auth_token_cache_size is None:
        return out
    for i, a in enumerate(out):
        if not isinstance(a, SendStream):
            continue
        decoded = decode_message(version, a.data)
        if decoded is None:
            continue
        setup, used = decoded
        if not isinstance(setup, Setup):
            continue
        setup = replace(setup, authorization_tokens=tuple(setup.authorization_tokens) + tuple(tokens),
                        max_auth_token_cache_size=(max_auth_token_cache_size
                                                   if max_auth_token_cache_size is not None
                                                   else setup.max_auth_token_cache_size))
        out[i] = SendStream(a.stream_id, encode_message(version, setup) + bytes(a.data[used:]),
                            a.end_stream)
        break
    return out
