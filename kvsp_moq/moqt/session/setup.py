"""SETUP of the sans-IO session (§"SETUP"): the one we send, built from the
:class:`~.config.SessionConfig`, and the checks of the peer's that need the session's role
and transport (which side may send PATH / AUTHORITY, their URI syntax, whether they are
served)."""

from __future__ import annotations

import re

from ...wire.errors import SessionErrorCode, WireError
from ...wire.kvp import KeyValuePair
from ..messages import Setup, violation
from ..version import Version
from .config import SessionConfig

__all__ = ["build_setup", "check_peer_setup"]

# RFC 3986 path-abempty [ "?" query ] (PATH option, §"PATH"): pchar / "/" and "?" in query.
_PCHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_PATH_RE = re.compile(rf"^(?:/{_PCHAR}*)*(?:\?(?:{_PCHAR}|[/?])*)?$")
# RFC 3986 authority: [ userinfo "@" ] host [ ":" port ], loosely (no spaces, no "/?#").
_AUTHORITY_RE = re.compile(r"^(?:[^@/?#\s]*@)?(?:\[[0-9A-Fa-f:.]+\]|[^:@/?#\s\[\]]+)(?::[0-9]*)?$")


def build_setup(config: SessionConfig, version: Version, is_client: bool) -> Setup:
    """Our SETUP: every Setup Option the config names (PATH and AUTHORITY from a client
    on native QUIC only; MAX_REQUEST_UPDATES from draft 19 on)."""
    return Setup(
        path=config.path if is_client and not config.webtransport else None,
        authority=config.authority if is_client and not config.webtransport else None,
        moqt_implementation=config.implementation,
        max_request_updates=(config.max_request_updates
                             if version.has_range_filters else None),
        authorization_tokens=tuple(config.authorization_tokens),
        max_auth_token_cache_size=config.max_auth_token_cache_size,
        unknown_options=tuple(KeyValuePair(t, v) for t, v in config.extra_setup_options),
    )


def check_peer_setup(setup: Setup, config: SessionConfig, is_client: bool) -> None:
    """Raise :class:`WireError` if the peer's SETUP breaks a session rule."""
    if is_client:
        # PATH and AUTHORITY are sent by the client only (§"PATH", §"AUTHORITY").
        if setup.path is not None or setup.authority is not None:
            raise violation("server sent PATH or AUTHORITY")
        return
    if config.webtransport:  # §"PATH", §"AUTHORITY": not used over WebTransport
        if setup.path is not None:
            raise WireError(SessionErrorCode.INVALID_PATH, "PATH over WebTransport")
        if setup.authority is not None:
            raise WireError(SessionErrorCode.INVALID_AUTHORITY, "AUTHORITY over WebTransport")
    if setup.path is not None and not _PATH_RE.match(setup.path):
        raise WireError(SessionErrorCode.MALFORMED_PATH, f"malformed PATH {setup.path!r}")
    if setup.authority is not None and not _AUTHORITY_RE.match(setup.authority):
        raise WireError(SessionErrorCode.MALFORMED_AUTHORITY,
                        f"malformed AUTHORITY {setup.authority!r}")
    if config.accept_path is not None and not config.accept_path(setup.path):
        raise WireError(SessionErrorCode.INVALID_PATH, f"PATH {setup.path!r} not served")
    if config.accept_authority is not None and not config.accept_authority(setup.authority):
        raise WireError(SessionErrorCode.INVALID_AUTHORITY,
                        f"AUTHORITY {setup.authority!r} not served")
