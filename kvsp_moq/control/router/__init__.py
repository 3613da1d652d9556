"""The disaggregation router (prefill on one engine, decode on others, KV streamed over MOQT):
:mod:`.service` routes, :mod:`.routes` serves it over HTTP (docs/vllm.md "Prefill→decode")."""

from .service import STREAM_PARAM, CompletionError, DisaggRouter, Engine

__all__ = ["STREAM_PARAM", "CompletionError", "DisaggRouter", "Engine"]
