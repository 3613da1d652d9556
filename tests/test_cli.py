"""The ``kvsp`` command, run as a real process, against pinned vectors."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

VECTORS = Path(__file__).parent / "vectors"
CORE = json.loads((VECTORS / "core/core.json").read_text())
CONTAINERS = json.loads((VECTORS / "container/container.json").read_text())
RAW3 = next(v for v in CONTAINERS["valid"] if v["name"] == "raw-fp16-3layers")


def kvsp(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # The console script when installed (as the README does), else the module.
    script = shutil.which("kvsp", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "kvsp_moq"]
    proc = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_compat_id(tmp_path: Path) -> None:
    vec = CORE["descriptors"]["llama-like"]
    (tmp_path / "d.json").write_text(json.dumps(vec["descriptor"]))
    assert kvsp("compat-id", str(tmp_path / "d.json")).stdout == vec["compat_id"] + "\n"


def test_compat_id_names_the_bad_member(tmp_path: Path) -> None:
    doc = dict(CORE["descriptors"]["llama-like"]["descriptor"], adapters=[])
    (tmp_path / "d.json").write_text(json.dumps(doc))
    proc = kvsp("compat-id", str(tmp_path / "d.json"), check=False)
    assert proc.returncode == 2 and "adapters" in proc.stderr and proc.stdout == ""
    (tmp_path / "bad.json").write_text("{not json")
    assert kvsp("compat-id", str(tmp_path / "bad.json"), check=False).returncode == 2
    assert kvsp("compat-id", str(tmp_path / "missing.json"), check=False).returncode == 2


def test_keys_from_arguments_and_file(tmp_path: Path) -> None:
    vec = CORE["block_keys"][0]
    common = ["--scope-key", vec["scope_key"], "--compat-id", vec["compat_id"],
              "--block-tokens", str(vec["block_tokens"])]
    expected = "".join(k + "\n" for k in vec["keys"])
    assert kvsp("keys", *common, *map(str, vec["tokens"])).stdout == expected
    (tmp_path / "t.txt").write_text("\n".join(" ".join(map(str, vec["tokens"][i:i + 7]))
                                              for i in range(0, len(vec["tokens"]), 7)))
    assert kvsp("keys", *common, "--tokens-file", str(tmp_path / "t.txt")).stdout == expected


@pytest.mark.parametrize("extra", [["--scope-key", "00" * 31], ["--compat-id", "zz" * 32], ["-1"],
                                   [str(2**32)], ["abc"]])
def test_keys_errors(extra: list[str]) -> None:
    vec = CORE["block_keys"][0]
    args = {"--scope-key": vec["scope_key"], "--compat-id": vec["compat_id"], "--block-tokens": "16"}
    tokens = ["1"] * 16
    if extra[0].startswith("--"):
        args[extra[0]] = extra[1]
    else:
        tokens += extra
    proc = kvsp("keys", *[x for kv in args.items() for x in kv], *tokens, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("kvsp: ")


def test_container_inspect_matches_vector() -> None:
    report = json.loads(kvsp("container", "inspect", str(VECTORS / "container" / RAW3["file"])).stdout)
    assert report["version"] == 1 and report["codec"] == 1
    assert (report["first_layer"], report["layer_count"], report["token_count"]) == (0, 3, 2)
    assert report["layer_digests"] == RAW3["layer_digests"]
    assert report["digest"] == "sha-256:" + RAW3["replica_digest"]


def test_container_inspect_rejects_malformed(tmp_path: Path) -> None:
    for bad in CONTAINERS["invalid"][:5]:
        proc = kvsp("container", "inspect", str(VECTORS / "container" / bad["file"]), check=False)
        assert proc.returncode == 2 and "KVB1" in proc.stderr


def _record(layer_digests: list[str]) -> dict[str, object]:
    digest = hashlib.sha256(b"".join(bytes.fromhex(d) for d in layer_digests)).hexdigest()
    return {"block_key": "ab" * 32, "compat_id": "cd" * 32, "scope_id": "ef" * 16,
            "holder": "https://h1.example/kvsp/", "codec": 1, "size": RAW3["size"],
            "digest": "sha-256:" + digest, "layer_digests": layer_digests,
            "residency": [{"tier": "host", "layers": [0, len(layer_digests) - 1]}], "ttl_ms": 60000}


def test_container_verify_ok_and_layer_range(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps(_record(RAW3["layer_digests"])))
    box = VECTORS / "container" / RAW3["file"]
    assert "OK" in kvsp("container", "verify", str(box), "--record", str(tmp_path / "r.json")).stdout
    from kvsp_moq.kvsp.container import extract_layers

    (tmp_path / "part.bin").write_bytes(extract_layers(box.read_bytes(), 1, 2))
    assert "layers 1-2" in kvsp("container", "verify", str(tmp_path / "part.bin"),
                                "--record", str(tmp_path / "r.json")).stdout


def test_container_verify_mismatch_exits_nonzero(tmp_path: Path) -> None:
    digests = list(RAW3["layer_digests"])
    digests[1] = "00" * 32
    (tmp_path / "r.json").write_text(json.dumps(_record(digests)))
    proc = kvsp("container", "verify", str(VECTORS / "container" / RAW3["file"]),
                "--record", str(tmp_path / "r.json"), check=False)
    assert proc.returncode == 1
    assert "layer 1 digest" in proc.stderr
    tampered = bytearray((VECTORS / "container" / RAW3["file"]).read_bytes())
    tampered[-1] ^= 1
    (tmp_path / "t.bin").write_bytes(tampered)
    (tmp_path / "good.json").write_text(json.dumps(_record(RAW3["layer_digests"])))
    proc = kvsp("container", "verify", str(tmp_path / "t.bin"), "--record", str(tmp_path / "good.json"), check=False)
    assert proc.returncode == 1 and "layer 2 digest" in proc.stderr


def test_container_verify_bad_record(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"block_key": "x"}))
    proc = kvsp("container", "verify", str(VECTORS / "container" / RAW3["file"]),
                "--record", str(tmp_path / "r.json"), check=False)
    assert proc.returncode == 2 and "block_key" in proc.stderr


@pytest.mark.parametrize("bench", [["keys", "--tokens", "4096"], ["container", "--layers", "4"],
                                   ["moqt", "--block-mib", "2", "--datagram-size", "16384"]])
def test_bench_prints_json_figures_and_a_table(bench: list[str]) -> None:
    proc = kvsp("bench", *bench, "--repeat", "1")
    lines = proc.stdout.splitlines()
    assert lines
    for line in lines:
        fig = json.loads(line)
        assert {"name", "unit", "value", "baseline_name", "baseline_value", "ratio"} <= fig.keys()
        assert fig["value"] > 0 and fig["baseline_value"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["baseline_value"], rel=1e-3)
        assert fig["name"] in proc.stderr and fig["baseline_name"] in proc.stderr


def test_demo_json_report(tmp_path: Path) -> None:
    # the whole scenario is checked in test_demo.py; here: the console script and the JSON shape
    report = json.loads(kvsp("demo", "--json", "--model-dir", str(tmp_path)).stdout)
    assert report["ok"] is True and report["outputs_match"] is True
    assert report["transports"]["moqt"]["blocks"] >= report["system_blocks"] >= 1
    assert {"without_cache", "with_cache", "speedup"} <= report["ttft_ms"].keys()


def test_kvsp_relay_forwards_its_options_and_stops_on_sigterm() -> None:
    import signal

    script = shutil.which("kvsp", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "kvsp_moq"]
    proc = subprocess.Popen(cmd + ["relay", "--listen", "127.0.0.1:0", "--cache-mib", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("relay listening on moqt://127.0.0.1:"), line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_version_is_the_installed_distribution_version() -> None:
    from importlib.metadata import version

    assert kvsp("--version").stdout.strip() == f"kvsp {version('kvsp-moq')}"


@pytest.mark.parametrize("argv, usage", [
    (["demo", "--jsn"], "usage: kvsp demo "),
    (["moq", "fetch", "moqt://127.0.0.1:1/", "a", "b", "--bogus"], "usage: kvsp moq fetch "),
    (["container", "encode", "-o", "x", "--nope"], "usage: kvsp container encode "),
])
def test_a_bad_flag_prints_its_subcommands_usage(argv: list[str], usage: str) -> None:
    proc = kvsp(*argv, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith(usage), proc.stderr
    assert f"error: unrecognized arguments: {argv[-1]}" in proc.stderr


def test_kvsp_relay_help_names_itself_and_shows_defaults() -> None:
    out = kvsp("relay", "--help").stdout
    assert out.startswith("usage: kvsp relay ") and "python -m relay" not in out
    assert "(default: 127.0.0.1:4443)" in out and "(default: 256)" in out


def test_scope_id_matches_the_vector(tmp_path: Path) -> None:
    vector = CORE["scopes"][0]
    assert kvsp("scope-id", "--scope-key", vector["scope_key"]).stdout.strip() == vector["scope_id"]
    key_file = tmp_path / "scope.key"
    key_file.write_text(vector["scope_key"][:20] + "\n  " + vector["scope_key"][20:] + "\n")
    assert kvsp("scope-id", "--scope-key-file", str(key_file)).stdout.strip() == vector["scope_id"]
    short = kvsp("scope-id", "--scope-key", "ab" * 31, check=False)
    assert short.returncode == 2 and short.stderr.startswith("kvsp: ") and "32 octets" in short.stderr


def test_container_encode_from_npy_layers_and_one_kv_array(tmp_path: Path) -> None:
    import numpy as np

    from kvsp_moq.kvsp.container import decode_container, layer_digest

    rng = np.random.default_rng(3)
    kv = rng.standard_normal((3, 2, 5, 2, 4)).astype(np.float16)  # layers, K/V, tokens, heads, dim
    np.save(tmp_path / "kv.npy", kv)
    args = []
    for layer in range(3):
        for i, part in enumerate("kv"):
            np.save(tmp_path / f"{part}{layer}.npy", kv[layer, i])
        args += ["--layer", str(tmp_path / f"k{layer}.npy"), str(tmp_path / f"v{layer}.npy")]
    a = json.loads(kvsp("container", "encode", "-o", str(tmp_path / "a.kvb"), *args, "--first-layer", "4").stdout)
    b = json.loads(kvsp("container", "encode", "-o", str(tmp_path / "b.kvb"), "--kv", str(tmp_path / "kv.npy"),
                        "--first-layer", "4").stdout)
    assert (tmp_path / "a.kvb").read_bytes() == (tmp_path / "b.kvb").read_bytes()
    box = decode_container((tmp_path / "a.kvb").read_bytes())
    assert (box.header.first_layer, box.header.layer_count, box.header.token_count) == (4, 3, 5)
    for layer in range(3):  # K then V, little-endian fp16, [token][head][dim]
        assert bytes(box.layer(4 + layer).k) == kv[layer, 0].astype("<f2").tobytes()
        assert bytes(box.layer(4 + layer).v) == kv[layer, 1].astype("<f2").tobytes()
    assert a["layer_digests"] == [layer_digest(kv[i, 0].tobytes(), kv[i, 1].tobytes()).hex() for i in range(3)]
    assert a == {**b, "file": a["file"]} and a["kv_dtype"] == "fp16"
    assert kvsp("container", "inspect", str(tmp_path / "a.kvb")).stdout.count(a["digest"]) == 1

    np.save(tmp_path / "bits.npy", kv.view(np.uint16))  # bf16 bit patterns: numpy cannot say so
    ambiguous = kvsp("container", "encode", "-o", str(tmp_path / "c.kvb"), "--kv", str(tmp_path / "bits.npy"),
                     check=False)
    assert ambiguous.returncode == 2 and "--kv-dtype" in ambiguous.stderr
    assert not (tmp_path / "c.kvb").exists()
    bf16 = json.loads(kvsp("container", "encode", "-o", str(tmp_path / "c.kvb"), "--kv", str(tmp_path / "bits.npy"),
                           "--kv-dtype", "bf16").stdout)
    assert bf16["kv_dtype"] == "bf16" and bf16["layer_digests"] == a["layer_digests"]  # same octets
    wrong = kvsp("container", "encode", "-o", str(tmp_path / "d.kvb"), "--kv", str(tmp_path / "k0.npy"), check=False)
    assert wrong.returncode == 2 and wrong.stderr.startswith("kvsp: ") and "[layers, 2, tokens" in wrong.stderr


def test_progress_on_stderr_only_when_asked_or_a_terminal() -> None:
    quiet = kvsp("bench", "keys", "--tokens", "2048", "--repeat", "1")  # stderr is a pipe here
    assert "[bench keys] running:" not in quiet.stderr
    shown = kvsp("bench", "keys", "--tokens", "2048", "--repeat", "1", "--progress")
    assert re.search(r"^\[bench keys\] running: \d+\.\d s \(done\)$", shown.stderr, re.M), shown.stderr
    assert [json.loads(line)["name"] for line in shown.stdout.splitlines()] == \
        [json.loads(line)["name"] for line in quiet.stdout.splitlines()]  # stdout unchanged
