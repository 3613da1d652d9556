"""The processes of ``kvsp soak``: every role its own child process, on fixed loopback ports.

Unlike the demo's cluster (``cli/demo/cluster.py``, where the IS, PC, holder and front end run in
the demo's process), every role here is a child process, so the chaos schedule can SIGKILL,
SIGSTOP and restart any of them for real:

* ``kvsp index``, ``kvsp pc``, ``kvsp holder`` (one disk tier: its blocks survive a restart, the
  holder that comes back adopts them and refreshes their records, §6.1) and ``kvsp frontend``;
* relay A (``python -m relay``) and relay B chained to it (``--upstream``); relay B is reached
  through the lossy link (``.lossy``: a UDP forwarder that drops a share of the packets each way);
* ``--instances`` × ``kvsp instance`` running the reference model: the odd ones publish through
  relay A, the even ones through the lossy link to relay B (so their ``moqt://`` records name the
  link, and every instance that loads their blocks crosses it).

Ports are chosen once (the OS's free ports, probed before the start) and reused by every
restart, so the URLs in the configuration files, records and the PC's registry stay valid: a
restarted role is the same role, as after a crash in a deployment. stderr of each incarnation goes to
``<workdir>/<name>.<n>.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..demo.cluster import ROOT, instance_toml, make_demo_tls

__all__ = ["Role", "SoakCluster", "free_port", "start_soak_cluster"]

MiB = 1 << 20
#: Seconds a role gets to print its URL after it was started (instances import torch and load the model).
START_TIMEOUT_S = 120.0
#: Seconds a role gets to exit after SIGTERM, before SIGKILL.
STOP_GRACE_S = 5.0


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port the OS calls free now on 127.0.0.1 (TCP or UDP); the role binds it soon after."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@dataclass
class Role:
    """One role: its command line, what its first stdout lines announce, its current process."""

    name: str
    argv: list[str]
    #: ``{key: regex}``: each group(1) is read from the process's stdout lines at start.
    announces: Mapping[str, str]
    workdir: Path
    process: asyncio.subprocess.Process | None = None
    found: dict[str, str] = field(default_factory=dict)
    incarnation: int = 0
    stopped: bool = False  # SIGSTOPped now
    #: The last stdout lines of the current incarnation (a role may print a JSON summary on exit).
    tail: list[str] = field(default_factory=list)
    _drainer: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None

    @property
    def alive(self) -> bool:
        return self.pid is not None

    async def start(self) -> None:
        self.incarnation += 1
        log = self.workdir / f"{self.name}.{self.incarnation}.log"
        with open(log, "wb") as err:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, cwd=str(ROOT), env=_env(), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=err)
        assert self.process.stdout is not None
        self.found = {}
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while len(self.found) < len(self.announces):
                    line = (await self.process.stdout.readline()).decode()
                    if not line:
                        raise RuntimeError(f"{self.name} exited during start-up (status {await self.process.wait()}); "
                                           f"its log: {log.read_text()[-2000:]}")
                    for key, pattern in self.announces.items():
                        if key not in self.found and (m := re.search(pattern, line)):
                            self.found[key] = m.group(1)
        except TimeoutError:
            raise RuntimeError(f"{self.name} did not start within {START_TIMEOUT_S:.0f} s; log {log}") from None
        # Keep reading stdout so that a chatty role never blocks on a full pipe.
        self.tail = []
        self._drainer = asyncio.get_running_loop().create_task(_drain(self.process.stdout, self.tail))

    def kill(self) -> None:
        """SIGKILL: no goodbye, whatever is in flight is cut."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.stopped = False

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets and answers nothing (a stall, not a crash)."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.pid is not None and self.stopped:
            os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    async def wait_dead(self) -> None:
        if self.process is not None:
            async with asyncio.timeout(30):
                await self.process.wait()

    async def stop(self) -> None:
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        self.resume()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self._drainer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drainer, STOP_GRACE_S)

    def rss_mib(self) -> float | None:
        """Resident set size now, from /proc (Linux), in MiB."""
        if self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
        except OSError:
            return None
        return None


async def _drain(stream: asyncio.StreamReader, tail: list[str]) -> None:
    with contextlib.suppress(Exception):
        while line := await stream.readline():
            tail.append(line.decode(errors="replace"))
            del tail[:-5]


@dataclass
class SoakCluster:
    tokens: dict[str, str]
    index: Role
    pc: Role
    holder: Role
    frontend: Role
    relay_a: Role
    lossy: Role
    relay_b: Role
    instances: list[Role]
    descriptor: Mapping[str, Any]
    workdir: Path

    @property
    def roles(self) -> list[Role]:
        return [self.index, self.pc, self.holder, self.frontend, self.relay_a, self.lossy, self.relay_b, *self.instances]

    def url(self, role: Role) -> str:
        return role.found["url"]

    async def stop(self) -> None:
        # Instances first (they report to the PC and publish to the others), the PC and IS last.
        for role in [*self.instances, self.frontend, self.relay_b, self.lossy, self.relay_a, self.holder, self.pc, self.index]:
            await role.stop()


def _principals(tokens: Mapping[str, str]) -> str:
    out = []
    for name, tok in tokens.items():
        out += ["[[principals]]", f"name = {json.dumps(name)}", f"token = {json.dumps(tok)}",
                'scopes = ["*"]', 'holders = ["*"]', 'instances = ["*"]', ""]
    return "\n".join(out)


def _http_role(name: str, command: str, port: int, config: Path, workdir: Path) -> Role:
    return Role(name, [sys.executable, "-m", "kvsp_moq", command, "--listen", f"127.0.0.1:{port}", "--config", str(config)],
                {"url": rf"kvsp {command}: listening on (\S+)"}, workdir)


def _relay_role(name: str, port: int, metrics_port: int, tls: Any, workdir: Path, extra: Sequence[str] = ()) -> Role:
    argv = [sys.executable, "-m", "relay", "--listen", f"127.0.0.1:{port}", "--metrics", f"127.0.0.1:{metrics_port}",
            "--cache-mib", "64", "--cert", str(tls.cert_file), "--key", str(tls.key_file), "--drain-timeout", "2",
            "--max-datagram-size", "1452", "--log-level", "ERROR", *extra]
    return Role(name, argv, {"url": r"relay listening on (moqt://\S+)", "metrics": r"relay metrics on (http://\S+)"}, workdir)


async def start_soak_cluster(workdir: Path, *, descriptor: Mapping[str, Any], model_dir: str, scope_key: bytes,
                             instances: int, loss: float, seed: int, progress: Any,
                             store: str | None = None) -> SoakCluster:
    """Write every configuration file, then start the roles (module notes). ``store`` (a
    ``redis+cluster://`` URL, ``--store cluster``) is the store of the IS, the PC, the holder
    and the front end; default: each its memory."""
    import secrets

    names = ["index", "pc", "holder", "frontend", "client", *(f"instance-{n}" for n in range(1, instances + 1))]
    tokens = {n: secrets.token_urlsafe(24) for n in names}
    principals = _principals(tokens)
    (workdir / "descriptor.json").write_text(json.dumps(dict(descriptor)))
    key_file = workdir / "scope.key"
    key_file.write_text(scope_key.hex() + "\n")
    key_file.chmod(0o600)
    tls = make_demo_tls(workdir)

    ports = {n: free_port() for n in ("index", "pc", "holder", "frontend", "metrics-a", "metrics-b")}
    udp = {n: free_port(socket.SOCK_DGRAM) for n in ("relay-a", "lossy", "relay-b")}
    base = {n: f"http://127.0.0.1:{ports[n]}/" for n in ("index", "pc", "holder", "frontend")}

    def config(name: str, text: str) -> Path:
        path = workdir / f"{name}.toml"
        path.write_text(principals + text)
        return path

    # The roles' store keys (in their own section, after its first line): a store every
    # process of the role shares, which outlives its kills.
    stored = "" if store is None else f'store = "{store}"\nstore_timeout_ms = 2000\n'

    index = _http_role("index", "index", ports["index"], config("index", '[index]\ndescriptors = ["descriptor.json"]\n' + stored), workdir)
    pc = _http_role("pc", "pc", ports["pc"], config("pc", (
        f'[pc]\nindex_url = "{base["index"]}"\nindex_token = "{tokens["pc"]}"\ninstance_token = "{tokens["pc"]}"\n'
        "prefetch_deadline_ms = 10000\nprefetch_lease_ms = 15000\nfailure_check_ms = 500\n" + stored
        # the leader lease outlasts a failover of the store (about 3 s: docs/deploy.md "Redis Cluster")
        + ("" if store is None else "leader_lease_ms = 10000\n"))), workdir)
    (workdir / "holder-disk").mkdir(exist_ok=True)
    holder = _http_role("holder", "holder", ports["holder"], config("holder", (
        f'[holder]\nindex_url = "{base["index"]}"\nindex_token = "{tokens["holder"]}"\n'
        f'tiers = [{{kind = "disk", capacity = {256 * MiB}, path = "holder-disk"}}]\n'
        'records_journal = "holder-records.jsonl"\n' + stored)),
        workdir)
    frontend = _http_role("frontend", "frontend", ports["frontend"], config("frontend", (
        f'[frontend]\npc_url = "{base["pc"]}"\npc_token = "{tokens["frontend"]}"\n' + stored)), workdir)
    relay_a = _relay_role("relay-a", udp["relay-a"], ports["metrics-a"], tls, workdir)
    lossy = Role("lossy-link", [sys.executable, "-m", "kvsp_moq.cli.soak.lossy", "--listen", f"127.0.0.1:{udp['lossy']}",
                                "--to", f"127.0.0.1:{udp['relay-b']}", "--loss", str(loss), "--seed", str(seed)],
                 {"url": r"lossy link (udp://\S+)"}, workdir)
    relay_b = _relay_role("relay-b", udp["relay-b"], ports["metrics-b"], tls, workdir,
                          ["--upstream", f"moqt://127.0.0.1:{udp['relay-a']}/moq", "--upstream-ca", str(tls.ca_file)])
    # The even instances reach relay B only through the lossy link: their blocks are published,
    # and fetched by everyone, across it (the records name that URL).
    relay_urls = (f"moqt://127.0.0.1:{udp['relay-a']}/moq", f"moqt://127.0.0.1:{udp['lossy']}/moq")

    roles = []
    for n in range(1, instances + 1):
        name = f"instance-{n}"
        text = instance_toml(tokens={}, token=tokens[name], index_url=base["index"], pc_url=base["pc"],
                             relay_url=relay_urls[(n - 1) % 2], holder_url=base["holder"], model_dir=model_dir,
                             block_tokens=int(descriptor["block_tokens"]), scope_key_file=str(key_file),
                             ca_file=str(tls.ca_file),
                             # a killed instance's next run withdraws the records of what it lost (§6.1)
                             records_journal=f"{name}-records.jsonl")
        roles.append(Role(name, [sys.executable, "-m", "kvsp_moq", "instance", "--listen", f"127.0.0.1:{free_port()}",
                                 "--config", str(config(name, text))],
                          {"url": r"kvsp instance: listening on (\S+)"}, workdir))

    cluster = SoakCluster(tokens, index, pc, holder, frontend, relay_a, lossy, relay_b, roles, descriptor, workdir)
    try:
        await index.start()
        await asyncio.gather(pc.start(), holder.start(), relay_a.start())
        await asyncio.gather(frontend.start(), relay_b.start())
        await lossy.start()
        progress(f"control plane and relays up: IS {cluster.url(index)}, PC {cluster.url(pc)}, holder {cluster.url(holder)}, "
                 f"front end {cluster.url(frontend)}, relay A {relay_urls[0]}, relay B (upstream A) behind a link losing "
                 f"{loss:g} % each way at {relay_urls[1]}")
        await asyncio.gather(*(r.start() for r in roles))
        progress(f"{instances} instances up: " + ", ".join(cluster.url(r) for r in roles))
    except BaseException:
        await cluster.stop()
        raise
    return cluster
