"""The BBR model (kvsp_moq.transport.bbr) on its own: its state machine driven through a small
discrete-event model of one path (a bottleneck link of a given rate, a propagation delay, a
drop-tail buffer, Bernoulli loss), then through aioquic's registry. Pure and seeded: the same
packets every run, a fraction of a second each; no timed assertion (time is the model's)."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvsp_moq.transport import bbr
from kvsp_moq.transport.bbr import BbrCongestionControl

MSS = 1200


class Packet:
    """What the controller sees of a sent packet (aioquic's QuicSentPacket has these)."""

    def __init__(self, sent_time: float) -> None:
        self.sent_time = sent_time
        self.sent_bytes = MSS


@dataclass
class Path:
    """A bottleneck of ``rate`` packets/s, round trip ``rtt`` without queueing, a buffer of
    ``buffer`` packets (tail drop), random loss ``loss`` (each way: data only here)."""

    rate: float
    rtt: float
    buffer: int = 1000
    loss: float = 0.0
    seed: int = 1
    max_queue_delay: float = 0.0
    delivered: int = 0
    lost: int = 0
    rtts: list[float] = field(default_factory=list)


def drive(cc: Any, path: Path, seconds: float, until: float = 0.0) -> Path:
    """Send as cwnd and pacing allow for ``seconds`` of model time from ``until``; ACK each
    packet one propagation RTT after it left the bottleneck, declare a dropped one lost 9/8
    RTT after it was sent (RFC 9002's time threshold). Then, sending nothing more, let every
    packet in flight be acknowledged or lost (so that a next ``drive`` starts clean)."""
    rng = random.Random(path.seed)
    events: list[tuple[float, int, str, Packet]] = []
    now, link_free, next_send, seq = until, until, until, 0
    end = until + seconds
    while now < end or events:
        while now < end and cc.bytes_in_flight + MSS <= cc.congestion_window \
                and next_send <= now:
            packet = Packet(now)
            cc.on_packet_sent(packet=packet)
            rate = getattr(cc, "pacing_rate", 0.0)
            next_send = now + MSS / rate if rate else now
            depart = max(now, link_free) + 1 / path.rate
            queued = (depart - now) * path.rate
            seq += 1
            if rng.random() < path.loss or queued > path.buffer:
                heapq.heappush(events, (now + 1.125 * path.rtt, seq, "lost", packet))
            else:
                link_free = depart
                path.max_queue_delay = max(path.max_queue_delay, depart - now)
                heapq.heappush(events, (depart + path.rtt, seq, "ack", packet))
        nxt = events[0][0] if events else end
        if now < end and cc.bytes_in_flight + MSS <= cc.congestion_window:
            nxt = min(nxt, max(next_send, now))
        now = max(now, nxt)
        while events and events[0][0] <= now:
            at, _, kind, packet = heapq.heappop(events)
            if kind == "ack":
                path.delivered += MSS
                cc.on_packet_acked(now=at, packet=packet)
                path.rtts.append(at - packet.sent_time)
                cc.on_rtt_measurement(now=at, rtt=at - packet.sent_time)
            else:
                path.lost += MSS
                cc.on_packets_lost(now=at, packets=[packet])
    return path


def new_bbr(seed: int = 1) -> BbrCongestionControl:
    return BbrCongestionControl(max_datagram_size=MSS, rng=random.Random(seed))


def test_startup_finds_the_bottleneck_then_drains_and_probes() -> None:
    """1000 packets/s, 40 ms: Startup ends on a plateau of max_bw (not on loss), Drain, then
    ProbeBW; max_bw is the bottleneck's rate, min_rtt the path's, the pacing rate follows."""
    cc = new_bbr()
    path = drive(cc, Path(rate=1000, rtt=0.040), 4.0)
    assert cc.states_entered[:3] == [bbr.STARTUP, bbr.DRAIN, bbr.PROBE_BW]
    assert cc.state == bbr.PROBE_BW and cc.full_bw_reached and cc.excessive_loss_rounds == 0
    assert 0.9 * 1000 * MSS <= cc.max_bw <= 1.05 * 1000 * MSS
    assert cc.min_rtt == pytest.approx(0.040 + 1 / 1000, rel=0.05)
    assert 0.7 * cc.max_bw <= cc.pacing_rate <= 1.3 * cc.max_bw  # a ProbeBW phase's gain
    assert path.delivered >= 0.8 * 1000 * MSS * 4.0  # the link was kept busy


def test_backs_off_on_a_real_bottleneck_queue_stays_bounded() -> None:
    """A deep buffer (1000 packets = 1 s at the rate) that a loss-based controller fills:
    BBR's window stays a small multiple of the BDP and the queueing delay about one RTT, and
    it never lost a packet to the buffer. Reno (aioquic's) on the same path, for contrast,
    fills it."""
    from aioquic.quic.congestion.reno import RenoCongestionControl

    rate, rtt = 1000, 0.040
    bdp = rate * MSS * rtt
    cc = new_bbr()
    path = drive(cc, Path(rate=rate, rtt=rtt, buffer=1000), 6.0)
    assert path.lost == 0
    assert cc.max_cwnd <= 4 * bdp + bbr.CWND_EXTRA_PACKETS * MSS
    steady = path.rtts[len(path.rtts) // 2:]  # after Startup's queue is drained
    assert max(steady) <= 2.5 * rtt
    reno = RenoCongestionControl(max_datagram_size=MSS)
    reno_path = drive(reno, Path(rate=rate, rtt=rtt, buffer=1000), 6.0)
    assert max(reno_path.rtts[len(reno_path.rtts) // 2:]) > 1.2 * max(steady)  # its queue grows


def test_random_loss_below_the_threshold_is_not_congestion() -> None:
    """1 % random loss: no round is excessive, the window is not cut, and BBR keeps the link
    near its rate; Reno on the same path and seed loses most of it."""
    from aioquic.quic.congestion.reno import RenoCongestionControl

    cc = new_bbr()
    path = drive(cc, Path(rate=1000, rtt=0.040, loss=0.01), 6.0)
    assert path.lost > 0 and cc.lost_bytes == path.lost
    assert cc.excessive_loss_rounds == 0 and cc.snapshot()["inflight_hi"] is None
    assert cc.state == bbr.PROBE_BW
    reno = RenoCongestionControl(max_datagram_size=MSS)
    reno_path = drive(reno, Path(rate=1000, rtt=0.040, loss=0.01), 6.0)
    assert path.delivered >= 0.8 * 1000 * MSS * 6.0
    assert path.delivered > 2 * reno_path.delivered


def test_loss_above_the_threshold_bounds_the_flight() -> None:
    """10 % loss is read as congestion: rounds are judged excessive and inflight_hi bounds
    the window below what the model alone would allow."""
    cc = new_bbr()
    drive(cc, Path(rate=1000, rtt=0.040, loss=0.10), 4.0)
    assert cc.excessive_loss_rounds > 0
    assert cc.inflight_hi != float("inf") and cc.congestion_window <= cc.inflight_hi


def test_a_shallow_buffer_ends_startup_on_loss() -> None:
    """A 5-packet buffer: Startup's overshoot loses many packets in a round, which ends
    Startup (the draft's loss exit) rather than waiting for the plateau alone."""
    cc = new_bbr()
    path = drive(cc, Path(rate=2000, rtt=0.020, buffer=5), 3.0)
    assert path.lost > 0 and cc.full_bw_reached
    assert cc.excessive_loss_rounds > 0


def test_min_rtt_is_refreshed_while_probing_without_probe_rtt() -> None:
    """On a steady path ProbeBW's drain phase empties the queue, so min_rtt is seen again
    within its window and ProbeRTT is never needed."""
    cc = new_bbr()
    drive(cc, Path(rate=1000, rtt=0.040), bbr.MIN_RTT_FILTER_S + 2.0)
    assert bbr.PROBE_RTT not in cc.states_entered and cc.state == bbr.PROBE_BW


def test_probe_rtt_after_the_min_rtt_window_then_back_to_probe_bw() -> None:
    """The path's RTT grows from 40 to 60 ms (a new route): the old min_rtt is never seen
    again, so once MIN_RTT_FILTER_S passed, ProbeRTT (the window at half the BDP for
    PROBE_RTT_DURATION_S and a round), then ProbeBW with min_rtt the new path's."""
    cc = new_bbr()
    drive(cc, Path(rate=1000, rtt=0.040), 1.0)
    drive(cc, Path(rate=1000, rtt=0.060), bbr.MIN_RTT_FILTER_S + 1.0, until=1.0)
    entered = cc.states_entered
    assert bbr.PROBE_RTT in entered
    assert entered[entered.index(bbr.PROBE_RTT) + 1] == bbr.PROBE_BW
    assert cc.state == bbr.PROBE_BW
    assert cc.min_rtt == pytest.approx(0.060 + 1 / 1000, rel=0.05)


def test_persistent_congestion_collapses_the_window_then_it_regrows() -> None:
    cc = new_bbr()
    path = Path(rate=1000, rtt=0.040)
    drive(cc, path, 2.0)
    cc.on_persistent_congestion()  # RFC 9002 §7.6.2
    assert cc.congestion_window == bbr.MIN_PIPE_CWND * MSS
    in_flight = cc.bytes_in_flight  # still counted until acknowledged or lost
    assert in_flight >= 0
    grown = BbrCongestionControl(max_datagram_size=MSS)
    assert grown.congestion_window == bbr.INITIAL_WINDOW_PACKETS * MSS


def test_expired_packets_leave_bytes_in_flight_only() -> None:
    cc = new_bbr()
    packets = [Packet(0.0) for _ in range(3)]
    for p in packets:
        cc.on_packet_sent(packet=p)
    window = cc.congestion_window
    cc.on_packets_expired(packets=packets)
    assert cc.bytes_in_flight == 0 and cc.congestion_window == window and cc.lost_bytes == 0


def test_registered_in_aioquic_and_paced_at_the_model_rate() -> None:
    """``congestion_control_algorithm="bbr"``, and None (the default): aioquic's recovery
    creates it, the library swaps in the pacer that reads BBR's rate; ``"reno"`` keeps
    aioquic's own controller and pacer; an unknown name is still refused."""
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection

    from kvsp_moq.transport import TransportConfig
    from kvsp_moq.transport.aioquic_backend import LIBRARY, AioquicBbr, BbrPacer

    qc = QuicConfiguration(is_client=True)
    LIBRARY.configure(qc, TransportConfig(congestion_control_algorithm="bbr"))
    quic = QuicConnection(configuration=qc)
    LIBRARY.prepare_connection(quic)
    cc = quic._loss._cc
    assert isinstance(cc, AioquicBbr) and isinstance(quic._loss._pacer, BbrPacer)
    cc.max_bw, cc.pacing_gain = 10e6, 1.0
    cc._set_pacing_rate()
    quic._loss._pacer.update_rate(congestion_window=cc.congestion_window, smoothed_rtt=0.04)
    assert quic._loss._pacer.packet_time == pytest.approx(
        qc.max_datagram_size / (10e6 * (1 - bbr.PACING_MARGIN)))
    assert (LIBRARY.congestion_state(quic) or {}).get("algorithm") == "bbr"
    default = QuicConfiguration(is_client=True)
    LIBRARY.configure(default, TransportConfig())  # None: BBR, the default (issue 28)
    assert default.congestion_control_algorithm == "bbr"
    reno = QuicConfiguration(is_client=True)
    LIBRARY.configure(reno, TransportConfig(congestion_control_algorithm="reno"))
    plain = QuicConnection(configuration=reno)
    LIBRARY.prepare_connection(plain)
    assert not isinstance(plain._loss._pacer, BbrPacer)
    assert (LIBRARY.congestion_state(plain) or {}).get("algorithm") == "reno"
    with pytest.raises(ValueError, match="unknown congestion control"):
        LIBRARY.configure(QuicConfiguration(is_client=True),
                          TransportConfig(congestion_control_algorithm="vegas"))


def test_selected_by_the_role_configs() -> None:
    """``[transport] congestion_control`` reaches every MOQT client config of a control-plane
    role; the relay's ``--congestion-control`` both its downstream and upstream configs; an
    unknown key of the section is refused naming it."""
    from relay.__main__ import build_config, parse_args

    from kvsp_moq.control.common.config import config_from_mapping
    from kvsp_moq.control.common.errors import ConfigError

    control = config_from_mapping({"transport": {"congestion_control": "bbr"}})
    assert control.tls.transport().congestion_control_algorithm == "bbr"
    assert config_from_mapping({}).tls.transport().congestion_control_algorithm is None
    with pytest.raises(ConfigError, match="transport.pacing"):
        config_from_mapping({"transport": {"pacing": True}})
    relay = build_config(parse_args(["--listen", "127.0.0.1:0", "--congestion-control", "bbr"]))
    assert relay.server_transport.congestion_control_algorithm == "bbr"
    assert relay.upstream_transport.congestion_control_algorithm == "bbr"


async def test_both_ends_of_a_real_connection_run_it() -> None:
    """A loopback connection with ``bbr`` on both configs: the client's connection and the
    one the server's demultiplexer created both run BBR (paced by BbrPacer) and carry 2 MiB
    intact; the model saw the transfer (round trips, a bandwidth, an RTT)."""
    import asyncio

    from kvsp_moq.transport import BaseConnectionHandler, Connection, TransportConfig, connect, serve
    from kvsp_moq.transport.tls import make_self_signed

    size = 2 << 20
    accepted: asyncio.Queue[Connection] = asyncio.Queue()

    class Sender(BaseConnectionHandler):
        def connection_made(self, conn: Connection, alpn: str) -> None:
            accepted.put_nowait(conn)

    class Receiver(BaseConnectionHandler):
        def __init__(self) -> None:
            self.got = bytearray()
            self.ended = asyncio.get_running_loop().create_future()

        def stream_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool) -> None:
            self.got += data
            if end_stream:
                self.ended.set_result(None)

    cert = make_self_signed()
    common = TransportConfig(backend="aioquic", congestion_control_algorithm="bbr",
                             datagrams=False, alpn_protocols=("kvsp-test",),
                             max_datagram_size=1452)
    receiver = Receiver()
    async with await serve("127.0.0.1", 0, Sender, common.replace(
            certificate_pem=cert.cert_pem, private_key_pem=cert.key_pem)) as server:
        client = await connect(f"moqt://127.0.0.1:{server.port}", lambda: receiver,
                               common.replace(insecure=True))
        sender = await asyncio.wait_for(accepted.get(), 10)
        sid = sender.open_uni()
        payload = bytes(range(256)) * (size // 256)
        await sender.write(sid, payload, end_stream=True)
        await asyncio.wait_for(receiver.ended, 30)
        await asyncio.wait_for(sender.drain(), 10)
        assert bytes(receiver.got) == payload
        state = sender.congestion_state() or {}
        assert state["algorithm"] == "bbr" and state["delivered"] >= size
        assert state["round_count"] > 0 and state["max_bw"] > 0 and state["min_rtt"] > 0
        assert (client.congestion_state() or {}).get("algorithm") == "bbr"
        await client.aclose()
