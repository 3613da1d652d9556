"""Profile the send and receive sides of ``kvsp bench kv`` apart, with py-spy.

The holder (send side, ``kvsp_moq.cli.bench.kv.holder``) and the loader (receive side,
``kvsp_moq.cli.bench.kv.loader``: MOQT FETCH of one 32 x 1 MiB block into a torch sink,
every layer verified) run as two processes on loopback, each under ``py-spy record``. Writes,
into the output directory, the collapsed stacks (``<tag>_send.folded``, ``<tag>_recv.folded``)
and a summary of each (``<tag>_send.txt``, ``<tag>_recv.txt``: top self and inclusive frames
of the transfer, import and setup frames excluded).

    .venv/bin/python docs/perf/profile_kv.py [--out docs/perf] [--tag before] [--loads 10]
        [--backend aioquic] [--datagram-size 16384]

Needs py-spy (``pip install py-spy``) and ptrace rights (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _spy(out: Path, rate: int) -> list[str]:
    spy = Path(sys.executable).with_name("py-spy")
    return [str(spy), "record", "--native", "-r", str(rate), "--format", "raw", "-o", str(out), "--"]


def _frame(f: str) -> str:
    """``func (file.py:123)`` -> ``func (file.py)``: one entry per function."""
    name, sep, where = f.rpartition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if sep and ":" in where else f


def compact(folded: Path) -> None:
    """Merge the stacks per function (line numbers dropped) and drop the setup (imports),
    so that the file stays small (< 1 MB) and still loads in speedscope / flamegraph.pl."""
    merged: collections.Counter[str] = collections.Counter()
    for line in folded.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        if "importlib" in stack:
            continue
        merged[";".join(_frame(f) for f in stack.split(";"))] += int(n_s)
    folded.write_text("".join(f"{s} {n}\n" for s, n in sorted(merged.items())))


_SETUP = ("store_block", "make_self_signed", "import_torch", "shutdown (logging")


def _in_transfer(frames: list[str]) -> bool:
    """uvloop calls the protocol callbacks from C: their stacks start at the callback. Stacks
    from the main module are kept only inside the event loop, minus the setup."""
    if frames[0].startswith("_run_module_as_main") and not any("run_until_complete" in f for f in frames):
        return False
    return not any(s in f for f in frames for s in _SETUP)


def summarize(folded: Path, title: str, top: int = 30) -> str:
    """Top self / inclusive frames of the transfer's stacks (:func:`_in_transfer`)."""
    self_c: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        frames = stack.split(";")
        if not _in_transfer(frames):
            continue
        n = int(n_s)
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [title, f"samples in the transfer: {total}", "", "self time:"]
    lines += [f"{100 * n / total:5.1f}%  {f}" for f, n in self_c.most_common(top)]
    lines += ["", "inclusive time:"]
    lines += [f"{100 * n / total:5.1f}%  {f}" for f, n in incl.most_common(2 * top)]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "docs" / "perf"))
    p.add_argument("--tag", default="kv")
    p.add_argument("--loads", type=int, default=10)
    p.add_argument("--rate", type=int, default=500)
    p.add_argument("--backend", default="aioquic")
    p.add_argument("--datagram-size", type=int, default=16384)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    send, recv = out / f"{args.tag}_send.folded", out / f"{args.tag}_recv.folded"
    common = ["--backend", args.backend, "--datagram-size", str(args.datagram_size)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen(_spy(send, args.rate) + [sys.executable, "-m", "kvsp_moq.cli.bench.kv.holder", *common],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert holder.stdout is not None
        line = ""
        while not line.startswith("{"):
            line = holder.stdout.readline()
            if not line:
                raise SystemExit("the holder exited before serving")
        subprocess.run(_spy(recv, args.rate) + [sys.executable, "-m", "kvsp_moq.cli.bench.kv.loader", "--info", line.strip(),
                        "--repeat", str(args.loads), "--no-http", *common], check=True, cwd=ROOT, env=env)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)
    compact(send)
    compact(recv)
    what = f"{args.backend}, max datagram size {args.datagram_size}, {args.loads + 1} loads of 32 x 1 MiB"
    (out / f"{args.tag}_send.txt").write_text(summarize(send, f"holder (send side), {what}"))
    (out / f"{args.tag}_recv.txt").write_text(summarize(recv, f"loader (receive side), {what}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
