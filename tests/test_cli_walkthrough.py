"""docs/cli.md's walkthrough, run line by line in one real bash: a block named by hand
(binding v1), encoded from a .npy file, published with a token through a real relay that
wants one (``--config``), fetched back with ``kvsp moq fetch --block``; the fetched octets are
the container's layers. Then the refusals the walkthrough promises, each one ``kvsp:`` line.

The only changes to the documented lines: the relay's port (a free one instead of 4443), and a
background command's output goes to a FIFO the test reads (to wait for the line its comment
names) with its PID kept, so that it can be stopped and its exit status checked.
"""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

from kvsp_moq.kvsp.container import decode_container

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"
#: Seconds any one step may take before the test gives up (a bound, not a measurement).
STEP_LIMIT = 120
_BACKGROUND = re.compile(r"^(?P<cmd>.*\S)\s*&\s+# wait for: (?P<marker>.+)$")
_SENTINEL = "__walkthrough_rc="


def walkthrough_commands() -> list[str]:
    """The shell commands of the walkthrough's code block; a heredoc is one command."""
    text = DOC.read_text()
    section = text[text.index("## Walkthrough: a block by hand over MOQT"):]
    block = section[section.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    commands: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if m := re.search(r"<<'?(\w+)'?$", line):
            body = [line]
            for more in lines:
                body.append(more)
                if more == m.group(1):
                    break
            commands.append("\n".join(body))
        else:
            commands.append(line)
    return commands


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Shell:
    """One bash fed command by command on stdin; each answer is read up to a sentinel line
    carrying the command's exit status."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], cwd=cwd, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        self.background = 0

    @staticmethod
    def _pump(stream: object, into: queue.Queue[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.put(line)
        into.put("")  # end of stream

    def run(self, command: str) -> tuple[int, str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\necho \"{_SENTINEL}$?\"\n")
        self.proc.stdin.flush()
        out: list[str] = []
        while True:
            line = self.lines.get(timeout=STEP_LIMIT)
            assert line, f"bash ended during {command!r}: {''.join(out)}"
            if line.startswith(_SENTINEL):
                return int(line[len(_SENTINEL):]), "".join(out)
            out.append(line)

    def start(self, command: str, marker: str) -> str:
        """``command &``, its output into a FIFO read until a line contains ``marker``."""
        self.background += 1
        fifo = self.cwd / f"background-{self.background}.fifo"
        os.mkfifo(fifo)
        rc, out = self.run(f"{command} > {fifo} 2>&1 &\nBG_{self.background}=$!")
        assert rc == 0, out
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: self._pump(open(fifo), lines), daemon=True).start()
        seen: list[str] = []
        while True:  # the output drains on in the thread after the marker, so nothing blocks
            line = lines.get(timeout=STEP_LIMIT)
            assert line, f"{command!r} ended before printing {marker!r}: {''.join(seen)}"
            seen.append(line)
            if marker in line:
                return "".join(seen)

    def stop_background(self) -> list[int]:
        """SIGTERM to every background command, the last started first (the publisher
        before the relay it is connected to); their exit statuses in that order."""
        statuses = []
        for n in range(self.background, 0, -1):
            rc, out = self.run(f"kill -TERM $BG_{n}; wait $BG_{n}")
            statuses.append(rc)
        return statuses

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=STEP_LIMIT)


def _one_kvsp_line(out: str) -> str:
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvsp: ") and "Traceback" not in out, out
    return lines[0]


def test_walkthrough_publishes_and_fetches_a_block_over_an_authorized_relay(tmp_path: Path) -> None:
    port = _free_udp_port()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    shell = Shell(tmp_path, env)
    outputs: dict[str, str] = {}
    try:
        for command in walkthrough_commands():
            command = command.replace("127.0.0.1:4443", f"127.0.0.1:{port}")
            if m := _BACKGROUND.match(command):
                outputs[m.group("cmd")] = shell.start(m.group("cmd"), m.group("marker"))
                continue
            rc, out = shell.run(command)
            assert rc == 0, f"{command}: exit {rc}: {out}"
            outputs[command] = out

        walk = tmp_path / "kvsp-walk"
        encode = next(out for cmd, out in outputs.items() if cmd.startswith("kvsp container encode"))
        report = json.loads(encode)
        fetch = next(out for cmd, out in outputs.items() if cmd.startswith("kvsp moq fetch"))
        fetched = [l for l in fetch.splitlines() if not l.startswith("TLS verification disabled")]
        # one line per layer: group 0, Object ID = layer, 1024 octets, sha256 = layer digest
        assert fetched == [f"0 {i} 1024 {d}" for i, d in enumerate(report["layer_digests"])]
        box = decode_container((walk / "block.kvb").read_bytes())
        payloads = b"".join(bytes(box.layer_payload(i)) for i in range(box.header.layer_count))
        assert (walk / "layers.bin").read_bytes() == payloads
        assert outputs[walkthrough_commands()[-1]].strip() == "fetched block = published block"

        # What the walkthrough says happens without the token and without --insecure.
        block = shell.run('echo "$BLOCK"')[1].strip()
        url = f"moqt://127.0.0.1:{port}/moq"
        rc, out = shell.run(f'kvsp moq fetch {url} --block "{block}" --insecure')
        assert rc == 1
        line = _one_kvsp_line(out)
        assert "MOQT error 0x1 (REQUEST_ERROR UNAUTHORIZED)" in line and "--token-file" in line
        rc, out = shell.run(f'kvsp moq fetch {url} --block "{block}" --token-file token')
        assert rc == 1
        line = _one_kvsp_line(out)
        assert "TLS handshake failed" in line and "--ca FILE" in line and "--insecure" in line

        assert shell.stop_background() == [0, 0]  # the lingering publisher, then the relay
    finally:
        shell.close()
