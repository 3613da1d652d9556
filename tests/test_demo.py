"""``kvsp demo`` as a real process (the reference model in two ``kvsp instance`` processes, every
request a §6.8 session through the front end): the report's numbers agree with each other and
with what the components counted (the instances' engine counters, the relay's metrics, the IS,
the front end's tally), reused KV gives the same greedy output, nothing is left running after it
exits, and Ctrl-C shuts everything down with 130. The relay serves only the run's tokens: asked
while the demo runs, it refuses a session without one or with a wrong one, and an instance's
token outside the run's scope (tests/relay_probe_support.py).

Nothing of a run outlives it, counted over what the run made only (tests/leftovers_support.py):
no process of its session, no shared-memory segment its processes made or mapped, nothing in
the ``TMPDIR`` of its own, where its temporary directory held the run's keys (the relay's TLS
key, the CA, the scope key) while it ran."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from leftovers_support import (
    Snapshot,
    Watched,
    left_in,
    own_segments,
    private_tmpdir,
    run_env,
    run_watched,
    session_members,
)
from relay_probe_support import DemoRelay

CMD = [sys.executable, "-m", "kvsp_moq", "demo"]
GUARD = 180.0  # safety net only: the demo takes a few seconds


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def had_its_keys(up: Snapshot) -> bool:
    """The run's temporary directory held its keys (in the TMPDIR it was given)."""
    return any(e.startswith("kvsp-demo-") and e.endswith(("/relay.key", "/scope.key")) for e in up.tmp)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("model"))


@dataclass
class DemoRun:
    report: dict[str, Any]
    run: Watched
    up: Snapshot
    #: What was left in its TMPDIR after it exited.
    left: list[str]
    #: What its relay answered clients of ours while the cluster was up.
    relay: DemoRelay


@pytest.fixture(scope="module")
def demo(model_dir: str) -> Iterator[DemoRun]:
    with private_tmpdir() as tmp:
        up = Snapshot()
        relay = DemoRelay()

        def on_line(line: str, sid: int) -> None:
            if line.startswith("[demo] cluster up"):
                up.take(sid, tmp)
            relay.see(line, tmp)

        run = run_watched(CMD + ["--json", "--model-dir", model_dir], env=run_env(tmp), timeout=GUARD,
                          on_line=on_line)
        assert run.code == 0, run.stderr
        yield DemoRun(json.loads(run.stdout), run, up, left_in(tmp), relay)


def test_the_relay_serves_only_the_runs_tokens(demo: DemoRun) -> None:
    """The relay runs with the ``--config`` the demo writes (docs/relay.md "Authorization"): a
    session without a token, or with one the run did not make, is refused; each instance's
    token is served in the run's scope (a track nobody publishes: DOES_NOT_EXIST, the answer
    past authorization) and refused outside it. The report's MOQT figures (test above) show the
    instances' own sessions were served."""
    assert demo.relay.answers == {
        "no token": "REQUEST_ERROR UNAUTHORIZED",
        "a wrong token": "session termination UNAUTHORIZED",
        "instance-1": "REQUEST_ERROR DOES_NOT_EXIST",
        "instance-1 outside its scope": "REQUEST_ERROR UNAUTHORIZED",
        "instance-2": "REQUEST_ERROR DOES_NOT_EXIST",
        "instance-2 outside its scope": "REQUEST_ERROR UNAUTHORIZED",
    }
    assert "authorized: the tokens of instance-1, instance-2 only" in demo.run.stderr


def test_the_report_adds_up(demo: DemoRun) -> None:
    report = demo.report
    assert report["ok"] is True and report["outputs_match"] is True
    cold, warm, *more = report["requests"]
    prompt_blocks, system_blocks = cold["prompt_blocks"], report["system_blocks"]
    assert system_blocks >= 3 and prompt_blocks > system_blocks  # the question's block is not shared
    # request 1: an empty cache (nothing named by key), everything recomputed; then the system
    # prompt is prefetched ahead of traffic to the other instance; request 2 (the same prompt,
    # its blocks now named by key) runs there, the question's block prefetched in its path
    assert cold["blocks_named"] == 0 and cold["directive"] is None and cold["prefetched"] == {"moqt": 0, "http": 0}
    assert cold["blocks"] == {"local": 0, "moqt": 0, "http": 0, "recomputed": prompt_blocks}
    ahead = report["prefetch_ahead"]
    assert ahead == {**ahead, "instance": warm["instance"], "state": "complete", "loaded": system_blocks,
                     "blocks": system_blocks} and ahead["ms"] > 0
    assert warm["instance"] != cold["instance"] and warm["blocks_named"] == prompt_blocks
    in_path = prompt_blocks - system_blocks
    assert warm["directive"]["state"] == "complete" and len(warm["directive"]["loaded"]) == in_path
    assert warm["prefetched"] == {"moqt": in_path, "http": 0}
    assert warm["blocks"] == {"local": prompt_blocks, "moqt": 0, "http": 0, "recomputed": 0}
    assert report["prefetch"] == {**report["prefetch"], "state": "complete", "loaded": in_path,
                                  "directive": warm["directive"]["directive"]}
    # requests 3 and 4 name the system blocks (resident at the second instance: no directive)
    assert all(r["instance"] == warm["instance"] and r["blocks_named"] == system_blocks and r["directive"] is None
               and r["blocks"]["local"] == system_blocks for r in more)
    assert report["ttft_ms"]["without_cache"] == cold["ttft_ms"] > 0 and report["ttft_ms"]["with_cache"] == warm["ttft_ms"] > 0
    assert report["ttft_ms"]["client_without_cache"] == cold["client_ttft_ms"] >= cold["ttft_ms"]
    assert report["ttft_ms"]["client_with_cache"] == warm["client_ttft_ms"] >= warm["ttft_ms"]
    # every request was one session at its instance; the per-request figures add up to the counters
    engines = report["instances"]
    assert sum(c["sessions"] for c in engines.values()) == len(report["requests"])
    assert sum(c["failed_sessions"] + c["requests"] for c in engines.values()) == 0
    for name, c in engines.items():
        mine = [r for r in report["requests"] if r["instance"] == name]
        assert c["ttft_ms"] == [r["ttft_ms"] for r in mine]
        assert c["output_tokens"] == sum(r["output_tokens"] for r in mine)
        for source in ("local", "moqt", "http", "recomputed"):
            assert c["request_blocks"][source]["blocks"] == sum(r["blocks"][source] for r in mine)

    # the transports are what the instances counted ...
    t = report["transports"]
    assert t["moqt"]["blocks"] == sum(c["prefetch_blocks"]["moqt"]["blocks"] + c["request_blocks"]["moqt"]["blocks"]
                                      for c in engines.values()) == prompt_blocks
    assert t["moqt"]["bytes"] == prompt_blocks * report["block_octets"]
    assert t["http"] == {"blocks": 0, "bytes": 0}
    assert t["recomputed"]["blocks"] == sum(r["blocks"]["recomputed"] for r in report["requests"])
    assert t["local"]["blocks"] == sum(r["blocks"]["local"] for r in report["requests"])
    assert report["hits"] == t["local"]["blocks"] and report["misses"] == t["recomputed"]["blocks"]
    assert report["hit_ratio"] == round(report["hits"] / (report["hits"] + report["misses"]), 4)
    # request 1 published its prompt blocks and the blocks its output completed (§6.8): the
    # last token sampled is not in the KV cache
    published = (cold["prompt_tokens"] + cold["output_tokens"] - 1) // report["model"]["block_tokens"]
    assert published > prompt_blocks
    assert engines[cold["instance"]]["published"]["moqt"] == published == cold["published"]["moqt"]
    # ... and what the relay counted: each layer of each block came through it once
    relay, layers = report["relay"], report["model"]["layers"]
    assert relay["bytes_out_total"] == relay["bytes_in_total"] == t["moqt"]["bytes"]
    assert relay["objects_out_total"] == relay["objects_in_total"] == t["moqt"]["blocks"] * layers
    assert relay["upstream_fetches_total"] == t["moqt"]["blocks"]
    # ... and the IS: every system block at the first instance, the holder, the relay, the second instance
    assert report["system_blocks_matched_at_is"] == system_blocks
    assert report["replicas_per_system_block"] == [4]
    # ... and the front end: every token delivered once, in one epoch, and streamed once
    fe = report["front_end"]
    streamed = sum(r["output_tokens"] for r in report["requests"])
    assert fe["sessions"] == len(report["requests"]) and fe["epochs"] == [1]
    assert fe["tokens_delivered"] == fe["tokens_streamed"] == streamed
    assert fe["duplicates_dropped"] == 0 and fe["stale_batches"] == 0
    assert cold["output"] == warm["output"] and len(cold["output"]) > 0
    g = report["model"]
    assert report["block_octets"] == layers * 2 * g["block_tokens"] * g["kv_heads"] * g["head_dim"] * 4


def test_progress_goes_to_stderr_and_everything_is_shut_down(demo: DemoRun) -> None:
    report, stderr, up = demo.report, demo.run.stderr, demo.up
    assert "[demo] cluster up" in stderr and "[demo] all servers stopped, relay and instances exited" in stderr
    roles = {s["role"] for s in report["servers"]}
    assert {"index", "relay", "holder", "pc", "frontend", "instance-1", "instance-2"} <= roles
    children = {server["pid"] for server in report["servers"] if "pid" in server}
    assert len(children) == 3 and children <= up.pids  # the relay and the instances, seen while up
    # Nothing of the run is left: no process of its session (nor the ports they held), ...
    assert all(_gone(pid) for pid in children) and session_members(demo.run.pid) == []
    # ... no shared memory of its processes, ...
    assert own_segments(up.pids, up.segments) == set()
    # ... and its temporary directory, with the run's keys while it ran, is gone.
    assert had_its_keys(up), up.tmp
    assert demo.left == []


def test_ctrl_c_shuts_down_cleanly_with_130(model_dir: str) -> None:
    """SIGINT once the cluster is up: 130, and nothing of the run left (its temporary
    directory, which held its keys, included)."""
    pids: list[int] = []
    up = Snapshot()
    with private_tmpdir() as tmp:
        def on_line(line: str, sid: int) -> None:
            if line.startswith(("[demo] relay ", "[demo] instance ")) and "(pid " in line:
                pids.append(int(line.split("(pid ")[1].split(",")[0].split(";")[0]))
            if line.startswith("[demo] cluster up"):
                up.take(sid, tmp)
                os.kill(sid, signal.SIGINT)

        run = run_watched(CMD + ["--model-dir", model_dir], env=run_env(tmp), timeout=GUARD, on_line=on_line)
        left = left_in(tmp)
    assert len(pids) == 3, run.stderr
    assert run.code == 130, run.stderr
    assert "[demo] interrupted: shutting down" in run.stderr
    assert "[demo] interrupted: clean shutdown, exit 130" in run.stderr
    assert "Traceback" not in run.stderr
    assert all(_gone(pid) for pid in pids) and session_members(run.pid) == []
    assert own_segments(up.pids, up.segments) == set()
    assert had_its_keys(up), up.tmp
    assert left == []


def test_a_demo_killed_with_sigkill_leaves_no_child_running() -> None:
    """SIGKILL to the demo alone (no cleanup of its own can run) once its relay and both
    instances are up: each child was started to receive SIGTERM when its parent dies
    (``setpriv --pdeathsig``), so every one of them exits: nothing of its session is left."""
    import re
    import select
    import subprocess

    children: list[int] = []
    with private_tmpdir() as tmp:
        proc = subprocess.Popen(CMD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=run_env(tmp),
                                start_new_session=True)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # ends if the demo exits first: then the assertion below fails
                if m := re.match(r"\[demo\] (relay|instance \d) .*\(pid (\d+)", line):
                    children.append(int(m[2]))
                if len(children) == 3:
                    break
            assert len(children) == 3, f"the demo ended before starting its relay and instances ({proc.poll()})"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            for pid in children:  # each waited on through a pidfd: readable once it has exited
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # already gone
                try:
                    ready, _, _ = select.select([fd], [], [], 60)
                    assert ready, f"child {pid} of the killed demo still runs 60 s later"
                finally:
                    os.close(fd)
            assert session_members(proc.pid) == []
        finally:
            for pid in session_members(proc.pid):
                os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
