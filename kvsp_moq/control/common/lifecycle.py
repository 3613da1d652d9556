"""An instance's lifecycle and its admitted sessions (kvsp-draft §6.3).

- Only the PC changes the state (``PUT state``, or its answer ``draining`` to a request to
  sleep): "A sleeping instance becomes active only on a state change from the PC."
- A draining instance "MUST complete its in-flight sessions and MUST NOT accept new ones; when
  it has none left it enters sleeping and reports it": :meth:`Lifecycle.admit` refuses with
  :class:`~.common.errors.NotActive` unless active; the last session to finish moves a draining
  instance to sleeping and calls ``on_sleep`` (the reporter sends a status at once).
- The PC asking ``draining`` or ``sleeping`` of an instance with sessions in flight gets
  ``draining`` (the sessions complete first); of an idle one, ``sleeping`` at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from ...kvsp.records.instance import ACTIVE, DRAINING, SLEEPING
from .clock import Clock
from .errors import NotActive


class Lifecycle:
    """State and in-flight sessions of one instance."""

    def __init__(self, clock: Clock, *, max_sessions: int = 1024, on_sleep: Callable[[], None] | None = None) -> None:
        self.clock = clock
        self.max_sessions = max_sessions
        self.on_sleep = on_sleep
        self.state = ACTIVE
        self.sessions: dict[uuid.UUID, bytes] = {}  # session -> scope_id
        self.idle_since_ms: int | None = clock.now_ms()

    def admit(self, session: uuid.UUID, scope_id: bytes) -> None:
        """Admit a new session; ``NotActive`` unless active (§6.3) or when full."""
        if session in self.sessions:
            return  # the same admission again
        if self.state != ACTIVE:
            raise NotActive(f"the instance is {self.state} and accepts no new sessions")
        if len(self.sessions) >= self.max_sessions:
            raise NotActive(f"the instance runs {self.max_sessions} sessions, its maximum")
        self.sessions[session] = scope_id
        self.idle_since_ms = None

    def finish(self, session: uuid.UUID) -> bool:
        """A session completed; whether it was in flight."""
        if self.sessions.pop(session, None) is None:
            return False
        if not self.sessions:
            self.idle_since_ms = self.clock.now_ms()
            if self.state == DRAINING:
                self._sleep()
        return True

    def set_state(self, state: str) -> str:
        """The PC's state change; returns the state entered."""
        if state == ACTIVE:
            self.state = ACTIVE
        elif self.sessions:
            self.state = DRAINING
        else:
            self._sleep()
        return self.state

    def _sleep(self) -> None:
        changed = self.state != SLEEPING
        self.state = SLEEPING
        if changed and self.on_sleep is not None:
            self.on_sleep()

    def idle_for_ms(self) -> int:
        return 0 if self.idle_since_ms is None else self.clock.now_ms() - self.idle_since_ms

    def restart_idle(self) -> None:
        """A refused request to sleep: wait another idle period before asking again."""
        if self.idle_since_ms is not None:
            self.idle_since_ms = self.clock.now_ms()
