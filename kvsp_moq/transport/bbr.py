"""BBR congestion control (a loss-tolerant model of the path), library-neutral.

:class:`BbrCongestionControl` has the shape of aioquic's congestion-control API
(``on_packet_sent`` / ``on_packet_acked`` / ``on_packets_lost`` / ``on_packets_expired`` /
``on_persistent_congestion`` / ``on_rtt_measurement``, ``congestion_window``,
``bytes_in_flight``); ``aioquic_backend`` registers it as ``"bbr"`` and paces its packets at
:attr:`BbrCongestionControl.pacing_rate`. Nothing here imports a QUIC library: a sent packet is
anything with ``sent_bytes`` and ``sent_time``.

The model, after draft-ietf-ccwg-bbr-00 ("BBR Congestion Control", Cardwell et al.; the
terms below are its names), BBRv1's ProbeBW gain cycle with v2's loss response:

* **Delivery rate** (the draft's "Delivery Rate Samples", from
  draft-cheng-iccrg-delivery-rate-estimation): each packet remembers the connection's
  ``delivered`` bytes, ``delivered_time`` and ``first_sent_time`` when it was sent; its ACK
  gives ``(delivered now - delivered then) / max(send_elapsed, ack_elapsed)``. A sample over
  an interval shorter than ``min_rtt`` is dropped (ACK compression).
* **BBR.max_bw**: the windowed max of the rate samples over :data:`BW_FILTER_ROUNDS` round
  trips; **BBR.min_rtt**: the min RTT over :data:`MIN_RTT_FILTER_S`; BDP = max_bw x min_rtt.
* **BBR.extra_acked**: the bytes acknowledged beyond what max_bw explains since an interval
  began (the ACK aggregation of a receiver that answers a burst with one ACK, as aioquic's
  does), its max over :data:`BW_FILTER_ROUNDS` round trips.
* **Pacing** at ``pacing_gain x max_bw x (1 - PACING_MARGIN)``; **cwnd** = ``cwnd_gain x
  BDP + extra_acked`` (+ :data:`CWND_EXTRA_PACKETS`), grown by the bytes acknowledged
  towards it.
* **States**: Startup (gain 2.77, until max_bw grew < 25 % in 3 rounds, or the loss of a
  round exceeded :data:`LOSS_THRESH` over at least :data:`STARTUP_FULL_LOSS_COUNT` packets),
  Drain (until inflight <= BDP), ProbeBW (the 8-phase cycle 1.25, 0.75, 1 x 6, one min_rtt
  each), ProbeRTT (when min_rtt is :data:`MIN_RTT_FILTER_S` old: cwnd at half the BDP for
  :data:`PROBE_RTT_DURATION_S` and a round trip).
* **Loss**: random loss below :data:`LOSS_THRESH` per round trip is *not* congestion: it does
  not touch the model. A round above it (and with at least :data:`STARTUP_FULL_LOSS_COUNT`
  packets lost) bounds the flight (``inflight_hi``, the draft's "BBR.inflight_longterm") by
  :data:`BETA` x cwnd; in ProbeBW the bound grows back (1, 2, 4 ... packets per clean round)
  and is dropped once it is twice what the model asks for.

Not modelled (documented in docs/transport.md): app-limited marking of rate samples (aioquic
does not tell a controller when the sender ran out of data; the max filter ignores the low
samples of app-limited phases anyway, but an application pause in Startup can end it early),
ECN, ``bw_lo`` / ``inflight_shortterm``.

Per packet the work is one tuple stored on send, and on ACK a division and a few additions
and comparisons (rate sample, extra_acked, state, cwnd); the filters advance once per round.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

__all__ = [
    "BETA",
    "BW_FILTER_ROUNDS",
    "LOSS_THRESH",
    "MIN_RTT_FILTER_S",
    "PROBE_RTT_DURATION_S",
    "STARTUP_FULL_LOSS_COUNT",
    "BbrCongestionControl",
]

# -- parameters (draft-ietf-ccwg-bbr-00 "Parameters", BBRv1 for the gain cycle) ---------------
#: BBRStartupPacingGain: 4 ln 2, doubling the sending rate each round trip.
STARTUP_PACING_GAIN = 2.77
#: BBRStartupCwndGain.
STARTUP_CWND_GAIN = 2.0
#: BBRDrainPacingGain: drains the queue Startup built in about one round trip.
DRAIN_PACING_GAIN = 0.35
#: ProbeBW's cwnd gain (BBRv1, and the draft's ProbeBW_UP cwnd gain is 2.25).
CWND_GAIN = 2.0
#: BBRv1's ProbeBW pacing-gain cycle: probe up, drain what the probe queued, cruise.
PROBE_BW_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
#: BBRLossThresh: the loss rate of a round trip above which loss is read as congestion.
LOSS_THRESH = 0.02
#: BBRBeta: the multiplicative decrease of inflight_hi on a round with excessive loss.
BETA = 0.7
#: BBRStartupFullLossCnt: packets a round must lose (besides the rate) to end Startup.
STARTUP_FULL_LOSS_COUNT = 6
#: BBR.full_bw: Startup ends once max_bw grew by less than this factor for FULL_BW_COUNT rounds.
FULL_BW_THRESH = 1.25
FULL_BW_COUNT = 3
#: The max_bw filter's window, round trips (BBRv1's BtlBwFilterLen).
BW_FILTER_ROUNDS = 10
#: BBR.min_rtt's window (BBRMinRTTFilterLen), seconds.
MIN_RTT_FILTER_S = 10.0
#: BBRProbeRTTDuration, seconds, and ProbeRTT's cwnd as a fraction of the BDP (BBRProbeRTTCwndGain).
PROBE_RTT_DURATION_S = 0.2
PROBE_RTT_CWND_GAIN = 0.5
#: BBRPacingMarginPercent: pace 1 % below the estimate, so that no queue builds at the bottleneck.
PACING_MARGIN = 0.01
#: BBRMinPipeCwnd, packets.
MIN_PIPE_CWND = 4
#: Packets of cwnd above gain x BDP: the ACK batching of the receive path (aioquic answers a
#: burst of up to 64 packets with one ACK) needs a few in flight beyond the BDP.
CWND_EXTRA_PACKETS = 3
#: RFC 9002 §7.2: the initial window, packets (aioquic's K_INITIAL_WINDOW).
INITIAL_WINDOW_PACKETS = 10

STARTUP, DRAIN, PROBE_BW, PROBE_RTT = "startup", "drain", "probe_bw", "probe_rtt"
_INFINITY = float("inf")


class BbrCongestionControl:
    """One connection's BBR (see the module docstring). ``rng`` picks the ProbeBW phase to
    start in (BBRv1: random, so that flows sharing a bottleneck do not probe in step)."""

    def __init__(self, *, max_datagram_size: int, rng: random.Random | None = None) -> None:
        self._mss = max_datagram_size
        self._rng = rng or random.Random()
        self.bytes_in_flight = 0
        self.congestion_window = INITIAL_WINDOW_PACKETS * max_datagram_size
        self.ssthresh: int | None = None  # aioquic logs it when set; BBR has none
        #: Bytes per second the sender should pace at; 0 until the first RTT sample.
        self.pacing_rate = 0.0
        self.state = STARTUP
        self.pacing_gain = STARTUP_PACING_GAIN
        self.cwnd_gain = STARTUP_CWND_GAIN
        # delivery-rate sampling (per packet)
        self._delivered = 0
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        # the model
        self.max_bw = 0.0  # bytes per second
        self.min_rtt = _INFINITY
        self._min_rtt_stamp = 0.0
        self._srtt = 0.0
        self._bw_ring = [0.0] * BW_FILTER_ROUNDS
        self._bw_slot = 0
        # ACK aggregation (the draft's BBR.extra_acked): bytes acknowledged beyond what
        # max_bw explains since an interval began; its max over BW_FILTER_ROUNDS rounds
        self.extra_acked = 0.0
        self._extra_ring = [0.0] * BW_FILTER_ROUNDS
        self._extra_start = 0.0
        self._extra_delivered = 0
        # round trips
        self.round_count = 0
        self._next_round_delivered = 0
        self._round_lost = 0
        self._round_lost_packets = 0
        self._round_acked = 0
        # Startup's full pipe
        self.full_bw_reached = False
        self._full_bw = 0.0
        self._full_bw_count = 0
        # ProbeBW
        self._cycle_index = 0
        self._cycle_stamp = 0.0
        self._lost_in_phase = False
        # loss response
        self.inflight_hi = _INFINITY
        self._probe_up_packets = 1
        # ProbeRTT
        self._probe_rtt_done = 0.0
        self._probe_rtt_round_done = False
        self._probe_rtt_round = 0
        # what tests and logs read (snapshot)
        self.max_cwnd = self.congestion_window
        self.lost_bytes = 0
        self.excessive_loss_rounds = 0
        self.states_entered: list[str] = [STARTUP]

    # -- the model's derived values --------------------------------------------------------
    def bdp(self) -> float:
        """max_bw x min_rtt, bytes (0 before both are known)."""
        if self.min_rtt == _INFINITY:
            return 0.0
        return self.max_bw * self.min_rtt

    # -- events from the QUIC library (aioquic's congestion-control API) --------------------
    def on_packet_sent(self, *, packet: Any) -> None:
        if self.bytes_in_flight == 0:  # restarting from idle: intervals start now
            self._first_sent_time = self._delivered_time = packet.sent_time
        self.bytes_in_flight += packet.sent_bytes
        packet.kvsp_rate_state = (self._delivered, self._delivered_time, self._first_sent_time)

    def on_packet_acked(self, *, now: float, packet: Any) -> None:
        size = packet.sent_bytes
        self.bytes_in_flight -= size
        self._delivered += size
        self._delivered_time = now
        self._round_acked += size
        prior_delivered, prior_time, first_sent = packet.kvsp_rate_state
        sent = packet.sent_time
        self._first_sent_time = sent
        send_elapsed = sent - first_sent
        ack_elapsed = now - prior_time
        interval = send_elapsed if send_elapsed > ack_elapsed else ack_elapsed
        if interval > 0 and interval >= self.min_rtt:
            rate = (self._delivered - prior_delivered) / interval
            if rate > self._bw_ring[self._bw_slot]:
                self._bw_ring[self._bw_slot] = rate
                if rate > self.max_bw:
                    self.max_bw = rate
        if prior_delivered >= self._next_round_delivered:
            self._next_round_delivered = self._delivered
            self._start_round()
        # BBRUpdateACKAggregation: the receive path acknowledges in bursts (aioquic: one ACK
        # per receive batch), so a window of gain x BDP alone would stall between them.
        expected = self.max_bw * (now - self._extra_start)
        if self._extra_delivered <= expected:
            self._extra_start, self._extra_delivered, expected = now, 0, 0.0
        self._extra_delivered += size
        extra = self._extra_delivered - expected
        if extra > self.congestion_window:
            extra = self.congestion_window
        if extra > self._extra_ring[self._bw_slot]:
            self._extra_ring[self._bw_slot] = extra
            if extra > self.extra_acked:
                self.extra_acked = extra
        self._advance(now)
        self._set_cwnd(size)

    def on_packets_lost(self, *, now: float, packets: Iterable[Any]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._round_lost += packet.sent_bytes
            self.lost_bytes += packet.sent_bytes
            self._round_lost_packets += 1
        self._lost_in_phase = True

    def on_packets_expired(self, *, packets: Iterable[Any]) -> None:
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes

    def on_persistent_congestion(self) -> None:
        # RFC 9002 §7.6.2: the window collapses; BBR keeps its model and grows the window
        # back by the bytes acknowledged (_set_cwnd), at the pacing rate the model gives.
        self.congestion_window = MIN_PIPE_CWND * self._mss

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        self._srtt = rtt if not self._srtt else 0.875 * self._srtt + 0.125 * rtt
        expired = self.min_rtt != _INFINITY and now > self._min_rtt_stamp + MIN_RTT_FILTER_S
        if rtt <= self.min_rtt or expired:
            self.min_rtt = rtt
            self._min_rtt_stamp = now
        if expired and self.state != PROBE_RTT and self.round_count:
            self._enter(PROBE_RTT, now)
        self._set_pacing_rate()

    def get_log_data(self) -> dict[str, Any]:
        """aioquic's qlog ``recovery:metrics_updated`` fields, plus the model."""
        return {"cwnd": self.congestion_window, "bytes_in_flight": self.bytes_in_flight,
                "bbr_state": self.state, "bbr_max_bw": int(self.max_bw),
                "bbr_pacing_rate": int(self.pacing_rate)}

    def snapshot(self) -> dict[str, Any]:
        """The model and what it recorded so far (tests, logs)."""
        return {"algorithm": "bbr", "state": self.state, "states_entered": list(self.states_entered),
                "max_bw": self.max_bw, "min_rtt": None if self.min_rtt == _INFINITY else self.min_rtt,
                "bdp": self.bdp(), "extra_acked": self.extra_acked,
                "congestion_window": self.congestion_window,
                "max_congestion_window": self.max_cwnd, "pacing_rate": self.pacing_rate,
                "inflight_hi": None if self.inflight_hi == _INFINITY else self.inflight_hi,
                "round_count": self.round_count, "delivered": self._delivered,
                "lost_bytes": self.lost_bytes, "excessive_loss_rounds": self.excessive_loss_rounds,
                "full_bw_reached": self.full_bw_reached, "bytes_in_flight": self.bytes_in_flight}

    # -- once per round trip -----------------------------------------------------------------
    def _start_round(self) -> None:
        """A round trip ended (the packet acknowledged was sent after the previous round's
        end): judge its loss, advance the filters and Startup's full-pipe check."""
        self.round_count += 1
        lost, packets = self._round_lost, self._round_lost_packets
        # Excessive: over LOSS_THRESH of the round's bytes *and* at least
        # STARTUP_FULL_LOSS_COUNT packets, so that a short round's one or two random losses
        # (a 40-packet round losing 2 at 0.5 % happens every ~60 rounds) are not congestion.
        excessive = (lost > LOSS_THRESH * (lost + self._round_acked)
                     and packets >= STARTUP_FULL_LOSS_COUNT)
        self._round_lost = self._round_lost_packets = self._round_acked = 0
        if excessive:
            self.excessive_loss_rounds += 1
            self.inflight_hi = max(MIN_PIPE_CWND * self._mss,
                                   BETA * min(self.congestion_window, self.inflight_hi))
            self._probe_up_packets = 1
        elif self.inflight_hi != _INFINITY and self.state == PROBE_BW:
            # a clean round: the bound grows back 1, 2, 4 ... packets per round (the draft's
            # BBRProbeInflightHiUpward), and goes once it no longer binds
            self.inflight_hi += self._probe_up_packets * self._mss
            self._probe_up_packets *= 2
            if self.inflight_hi > 2 * (self.cwnd_gain * self.bdp() + self.extra_acked):
                self.inflight_hi = _INFINITY
        # the max_bw filter: a slot per round, the oldest forgotten
        ring = self._bw_ring
        self._bw_slot = slot = self.round_count % BW_FILTER_ROUNDS
        ring[slot] = 0.0
        self.max_bw = max(ring)
        self._extra_ring[slot] = 0.0
        self.extra_acked = max(self._extra_ring)
        if not self.full_bw_reached:
            if self.max_bw >= self._full_bw * FULL_BW_THRESH:
                self._full_bw, self._full_bw_count = self.max_bw, 0
            else:
                self._full_bw_count += 1
            if self._full_bw_count >= FULL_BW_COUNT or (
                    excessive and packets >= STARTUP_FULL_LOSS_COUNT):
                self.full_bw_reached = True
        if self.state == PROBE_RTT and self._probe_rtt_done and not self._probe_rtt_round_done \
                and self.round_count > self._probe_rtt_round:
            self._probe_rtt_round_done = True

    # -- per ACK ---------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        state = self.state
        if state == STARTUP:
            if self.full_bw_reached:
                self._enter(DRAIN, now)
        elif state == DRAIN:
            if self.bytes_in_flight <= self.bdp():
                self._enter(PROBE_BW, now)
        elif state == PROBE_BW:
            # BBRv1's BBRIsNextCyclePhase: a phase lasts min_rtt; probing up lasts until the
            # flight reached gain x BDP or a packet was lost, draining ends once it is <= BDP.
            gain = self.pacing_gain
            full_length = now - self._cycle_stamp > self.min_rtt
            if gain == 1.0:
                advance = full_length
            elif gain > 1.0:
                advance = full_length and (
                    self._lost_in_phase or self.bytes_in_flight >= gain * self.bdp())
            else:
                advance = full_length or self.bytes_in_flight <= self.bdp()
            if advance:
                self._next_phase(now)
        elif state == PROBE_RTT:
            if not self._probe_rtt_done and \
                    self.bytes_in_flight <= self._probe_rtt_cwnd() + self._mss:
                self._probe_rtt_done = now + PROBE_RTT_DURATION_S
                self._probe_rtt_round = self.round_count
                self._probe_rtt_round_done = False
            elif self._probe_rtt_done and self._probe_rtt_round_done \
                    and now > self._probe_rtt_done:
                self._min_rtt_stamp = now
                self._enter(PROBE_BW if self.full_bw_reached else STARTUP, now)

    def _next_phase(self, now: float) -> None:
        self._cycle_index = (self._cycle_index + 1) % len(PROBE_BW_GAINS)
        self.pacing_gain = PROBE_BW_GAINS[self._cycle_index]
        self._cycle_stamp = now
        self._lost_in_phase = False
        self._set_pacing_rate()

    def _enter(self, state: str, now: float) -> None:
        self.state = state
        if len(self.states_entered) < 64:  # bounded: a long connection cycles ProbeRTT
            self.states_entered.append(state)
        if state == STARTUP:
            self.pacing_gain, self.cwnd_gain = STARTUP_PACING_GAIN, STARTUP_CWND_GAIN
        elif state == DRAIN:
            self.pacing_gain, self.cwnd_gain = DRAIN_PACING_GAIN, STARTUP_CWND_GAIN
        elif state == PROBE_BW:
            # BBRv1: any phase but the drain one (index 1), at random
            self._cycle_index = self._rng.choice((0, 2, 3, 4, 5, 6, 7))
            self.pacing_gain, self.cwnd_gain = PROBE_BW_GAINS[self._cycle_index], CWND_GAIN
            self._cycle_stamp = now
            self._lost_in_phase = False
        else:  # PROBE_RTT
            self.pacing_gain, self.cwnd_gain = 1.0, CWND_GAIN
            self._probe_rtt_done = 0.0
            self._probe_rtt_round_done = False
        self._set_pacing_rate()

    def _probe_rtt_cwnd(self) -> float:
        return max(MIN_PIPE_CWND * self._mss, PROBE_RTT_CWND_GAIN * self.bdp())

    def _set_cwnd(self, acked: int) -> None:
        bdp = self.bdp()
        cwnd: float = self.congestion_window
        if bdp:
            target = self.cwnd_gain * bdp + self.extra_acked + CWND_EXTRA_PACKETS * self._mss
            if self.full_bw_reached:
                cwnd = min(cwnd + acked, target)
            elif cwnd < target or self._delivered < INITIAL_WINDOW_PACKETS * self._mss:
                cwnd += acked
        else:
            cwnd += acked  # no model yet: grow as slow start does
        if cwnd > self.inflight_hi:
            cwnd = self.inflight_hi
        if self.state == PROBE_RTT:
            cwnd = min(cwnd, self._probe_rtt_cwnd())
        low = MIN_PIPE_CWND * self._mss
        self.congestion_window = icwnd = int(cwnd) if cwnd > low else low
        if icwnd > self.max_cwnd:
            self.max_cwnd = icwnd

    def _set_pacing_rate(self) -> None:
        if self.max_bw:
            rate = self.pacing_gain * self.max_bw * (1.0 - PACING_MARGIN)
        elif self._srtt:  # no rate sample yet: the initial window over the first RTT
            rate = self.pacing_gain * self.congestion_window / self._srtt
        else:
            return
        # In Startup the rate only rises (the draft's BBRSetPacingRateWithGain).
        if self.full_bw_reached or rate > self.pacing_rate:
            self.pacing_rate = rate
