"""A throwaway Redis Cluster on loopback (DESIGN.md §8): 3 primaries and one replica each (or
``replicas``) of ``redis-server``, for the tests, ``kvsp soak --store cluster`` and ``kvsp bench index --store
cluster``; a node can be killed (SIGKILL) and the cluster waited for until a replica took over.

Each node listens on a port whose cluster bus port (port + 10000) is free too, in a folder of
its own (its ``nodes.conf``, so a killed node started again rejoins, now as a replica). The
cluster is formed with ``redis-cli --cluster create ... --cluster-replicas 1``. What the
cluster does is observed by asking its nodes (``CLUSTER INFO``, ``CLUSTER NODES``, ``INFO
replication``): there is no event to wait on, so each wait is a poll with a deadline.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from redis import Redis
from redis.cluster import key_slot
from redis.exceptions import RedisError

__all__ = ["ClusterNodeProcess", "RedisClusterProcess"]

#: Bound on each wait: a node to answer, the cluster to form, a failover to finish.
WAIT_S = 30.0
#: ``cluster-node-timeout``: how long a silent primary takes to be declared failed.
NODE_TIMEOUT_MS = 1_000
_POLL_S = 0.05


def _port_pair_free(port: int) -> bool:
    for p in (port, port + 10_000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` ports below 55535 whose bus port (+10000) is free as well."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10_000 >= 65_536:
            port = 20_000 + port % 30_000
        if port not in ports and _port_pair_free(port):
            ports.append(port)
    return ports


def _until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (RedisError, OSError, LookupError):  # a node down, a slot not served yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis cluster: {what} not within {timeout_s} s")
        time.sleep(_POLL_S)


@dataclass
class ClusterNodeProcess:
    """One ``redis-server`` of the cluster."""

    executable: str
    port: int
    folder: Path
    appendonly: bool = False
    process: subprocess.Popen[bytes] | None = None
    node_timeout_ms: int = NODE_TIMEOUT_MS

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self) -> Redis:
        return Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=5)

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-replica-validity-factor", "0",
                "--save", "", "--protected-mode", "no", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no"]
        if self.appendonly:
            args += ["--appendfsync", "always"]
        with open(self.folder / "redis.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

        def answers() -> bool:
            if not self.running:
                raise RuntimeError(f"redis-server on {self.port} exited: "
                                   f"{(self.folder / 'redis.log').read_text()[-2000:]}")
            with self.client() as c:
                return bool(c.ping())

        _until(f"node {self.port} to answer", answers)

    def kill(self) -> None:
        """SIGKILL: a crash; what it had not sent to its replica is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


class RedisClusterProcess:
    """``with RedisClusterProcess() as url:`` a formed cluster's ``redis+cluster://`` URL."""

    def __init__(self, folder: Path | None = None, *, primaries: int = 3, replicas: int = 1,
                 appendonly: bool = False, executable: str | None = None,
                 node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        """``node_timeout_ms``: a bench gives a longer one, so that a node starved of CPU on a
        busy machine is not failed over in the middle of a measurement."""
        found = executable or shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if found is None or cli is None:
            raise RuntimeError("a Redis Cluster needs redis-server and redis-cli (Debian package redis-server)")
        self.executable, self.cli = found, cli
        self._tmp = None if folder is not None else tempfile.TemporaryDirectory(prefix="kvsp-redis-cluster-")
        self.folder = folder if folder is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.nodes = [ClusterNodeProcess(found, port, self.folder / str(port), appendonly,
                                         node_timeout_ms=node_timeout_ms)
                      for port in _free_ports(primaries * (1 + replicas))]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run([self.cli, "--cluster", "create", *(n.address for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=WAIT_S)
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- what the cluster says --------------------------------------------------------------------

    def _live(self) -> list[ClusterNodeProcess]:
        return [n for n in self.nodes if n.running]

    def _view(self) -> list[list[str]]:
        """``CLUSTER NODES`` of a live node, one split line per node."""
        for node in self._live():
            try:
                with node.client() as c:
                    text = c.execute_command("CLUSTER", "NODES")
            except (RedisError, OSError):
                continue
            text = text.decode() if isinstance(text, bytes) else str(text)
            return [line.split() for line in text.splitlines() if line.strip()]
        raise LookupError("redis cluster: no node answers")

    def primary_ports(self) -> list[int]:
        return sorted(int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in self._view()
                      if "master" in f[2] and "fail" not in f[2] and len(f) > 8)

    def primary_for(self, key: str | bytes) -> ClusterNodeProcess:
        """The running node that serves ``key``'s slot now."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for f in self._view():
            if "master" not in f[2] or "fail" in f[2]:
                continue
            for part in f[8:]:
                lo, _, hi = part.partition("-")
                if not lo.isdigit():
                    continue
                if int(lo) <= slot <= int(hi or lo):
                    port = int(f[1].split("@")[0].rsplit(":", 1)[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"redis cluster: no primary serves slot {slot}")

    def _healthy(self) -> bool:
        """Every running node says ``cluster_state:ok``, every slot is served by a running
        primary, and every running replica's link to its primary is up."""
        live = {n.port for n in self._live()}
        primaries = 0
        for node in self._live():
            with node.client() as c:
                info = c.execute_command("CLUSTER", "INFO")
                info = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in info:
                    return False
                repl = c.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
                primaries += repl.get("role") == "master"
        view = self._view()
        serving = [f for f in view if "master" in f[2] and len(f) > 8]
        return all(int(f[1].split("@")[0].rsplit(":", 1)[1]) in live and "fail" not in f[2] for f in serving) \
            and primaries == len(serving)

    def wait_healthy(self, timeout_s: float = WAIT_S) -> None:
        _until("cluster_state:ok with every slot on a running primary", self._healthy, timeout_s)

    def kill_primary(self, key: str | bytes) -> ClusterNodeProcess:
        """SIGKILL the primary of ``key``'s slot and wait (bounded) until its replica took over;
        the killed node."""
        victim = self.primary_for(key)
        victim.kill()
        _until(f"a replica of {victim.port} to take over",
               lambda: self.primary_for(key).port != victim.port and self._healthy())
        return victim

    def restart(self, node: ClusterNodeProcess) -> None:
        """Start a killed node again: it rejoins (as a replica of the node that took over)."""
        node.start()
        self.wait_healthy()
