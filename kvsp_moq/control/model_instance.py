"""An instance whose §6.8 sessions run on its reference model (``kvsp instance``).

:func:`serve_model_instance` is :func:`.http.serve_instance` plus, when ``[instance.engine]``
is configured and ``[instance] session_engine = "model"`` (the default), a
:class:`~.model_sessions.ModelSessionEngine` bound to the instance's inference engine once the
model is loaded. Orders that arrive before that (the instance reports to the PC while it
starts) wait for the binding.
"""

from __future__ import annotations

from typing import Any

from .config import ControlConfig
from .http import INSTANCE_SERVICE, RunningServer, serve_instance
from .model_sessions import ModelSessionEngine

__all__ = ["serve_model_instance"]


async def serve_model_instance(config: ControlConfig, host: str = "127.0.0.1", port: int = 0, **kw: Any) -> RunningServer:
    """Run an instance per ``config.instance`` with model-backed sessions (module notes);
    ``kw`` goes to :func:`.http.serve_instance`."""
    ic = config.instance
    sessions: ModelSessionEngine | None = None
    if ic.engine is not None and ic.session_engine == "model" and kw.get("session_engine") is None:
        sessions = ModelSessionEngine(load_timeout_s=ic.session_load_timeout_ms / 1000)
        kw["session_engine"] = sessions
    server = await serve_instance(config, host, port, **kw)
    if sessions is not None:
        service = server.app[INSTANCE_SERVICE]
        assert service.inference is not None
        sessions.bind(service.inference, url=lambda: service.url)
    return server
