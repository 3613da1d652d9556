"""The sans-IO MOQT session (drafts 18, 20/21, 22): :class:`SessionMachine`, one per
connection, its settings (:class:`SessionConfig`), roles and states, the stream numbering it
asks the transport for (:class:`StreamIdAllocator`), and its events and actions
(:mod:`.events`). See ``docs/moqt-session.md``."""

from .config import Role, SessionConfig, SessionState
from .machine import SessionMachine
from .streams import StreamCounter, StreamIdAllocator

__all__ = ["Role", "SessionConfig", "SessionMachine", "SessionState", "StreamCounter",
           "StreamIdAllocator"]
