"""One direction of the userspace WAN shaper: what ``tc qdisc ... netem delay D loss L% limit N
[rate R]`` does to the packets leaving an interface, without the kernel's ``sch_netem``.

Emulated, as netem's enqueue/dequeue (net/sched/sch_netem.c) do it with only these options:

* **loss**: each packet is dropped with probability L %, independently of the others (netem's
  Bernoulli loss, no correlation: ``loss L%``), before it is queued;
* **limit**: a packet that finds ``limit`` packets already queued is tail-dropped (netem's
  ``limit``, default 1000 packets: what bounds the memory);
* **rate** (optional): the link serializes packets at R bytes per second, so a packet leaves
  once those queued before it have (netem's ``rate``: the bottleneck of the tests that check a
  congestion controller backs off); the queueing this adds is counted (``queue_ms_max``);
* **delay**: every other packet leaves ``delay`` seconds after it arrived (after its turn on
  the rate-limited link); a fixed delay keeps the order (netem's tfifo with no jitter), so the
  queue is a FIFO and its head is the next due.

Not emulated (not needed by ``kvsp bench wan``): jitter, correlation, duplication, corruption,
reordering, netem's per-packet and cell overheads of ``rate``. Pure: the caller passes the clock (``now``, seconds) and moves the bytes.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass

__all__ = ["Counters", "DelayLine"]


@dataclass
class Counters:
    """Per direction, what came in and where it went (packets and octets), and how late
    the forwarded packets left against their due time (the shaper's own added delay, in
    seconds: netem's timer is exact to microseconds, a userspace loop's is not)."""

    packets_in: int = 0
    bytes_in: int = 0
    forwarded: int = 0
    bytes_forwarded: int = 0
    dropped_loss: int = 0
    dropped_limit: int = 0
    late_s_sum: float = 0.0
    late_s_max: float = 0.0
    queue_s_max: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The counts, and the lateness as ``late_ms_mean`` / ``late_ms_max``."""
        out: dict[str, int | float] = {k: v for k, v in asdict(self).items()
                                       if not k.startswith(("late_", "queue_"))}
        out["late_ms_mean"] = round(self.late_s_sum / self.forwarded * 1e3, 3) if self.forwarded else 0.0
        out["late_ms_max"] = round(self.late_s_max * 1e3, 3)
        out["queue_ms_max"] = round(self.queue_s_max * 1e3, 3)
        return out


class DelayLine:
    """netem's ``delay`` + ``loss`` + ``limit`` (+ ``rate``, bytes per second, 0: none) on one
    direction (see the module docstring)."""

    def __init__(self, delay_s: float, loss_pct: float, limit: int, seed: int,
                 rate: float = 0.0) -> None:
        if delay_s < 0 or not 0 <= loss_pct <= 100 or limit < 1 or rate < 0:
            raise ValueError("delay must be >= 0, loss in [0, 100] %, limit >= 1 packet and "
                             "rate >= 0")
        self.delay_s = delay_s
        self.limit = limit
        self.rate = rate
        self._link_free = 0.0  # when the rate-limited link has sent what is queued on it
        self.counters = Counters()
        self._loss = loss_pct / 100.0
        self._rng = random.Random(seed)  # seeded: a run's loss pattern can be replayed
        self._queue: deque[tuple[float, bytes]] = deque()

    def offer(self, packet: bytes, now: float) -> None:
        """A packet that arrived at ``now``: dropped (loss, then limit) or queued until
        ``now + delay``. The caller passes a ``now`` no earlier than the packet's arrival."""
        c = self.counters
        c.packets_in += 1
        c.bytes_in += len(packet)
        if self._loss and self._rng.random() < self._loss:
            c.dropped_loss += 1
        elif len(self._queue) >= self.limit:
            c.dropped_limit += 1
        elif self.rate:
            start = now if now > self._link_free else self._link_free
            self._link_free = sent = start + len(packet) / self.rate
            if sent - now > c.queue_s_max:
                c.queue_s_max = sent - now
            self._queue.append((sent + self.delay_s, packet))
        else:
            self._queue.append((now + self.delay_s, packet))

    def pop_due(self, now: float) -> list[bytes]:
        """The queued packets due at ``now`` or before, oldest first, counted as forwarded."""
        out: list[bytes] = []
        queue = self._queue
        c = self.counters
        late_sum, late_max = c.late_s_sum, c.late_s_max
        while queue and queue[0][0] <= now:
            due, packet = queue.popleft()
            out.append(packet)
            late_sum += now - due
            if now - due > late_max:
                late_max = now - due
        c.late_s_sum, c.late_s_max = late_sum, late_max
        c.forwarded += len(out)
        c.bytes_forwarded += sum(map(len, out))
        return out

    def next_due(self) -> float | None:
        """When the head of the queue is due (None when empty)."""
        return self._queue[0][0] if self._queue else None

    def __len__(self) -> int:
        return len(self._queue)
