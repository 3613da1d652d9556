"""``kvsp descriptor`` (kvsp_moq/cli/descriptor.py): the Compatibility Descriptor a vLLM engine
derives for a local model, printed without an engine, for holders and relays that transcode.

That it equals what a real engine publishes under is checked where real engines run:
tests/test_vllm_connector.py builds its relay's and holder's descriptor with this command
and asserts the engine's published ``compat_id`` is that descriptor's. Here: the process,
its ranks, adapters and usage errors.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("the tiny model is written with transformers (the vllm extra)", allow_module_level=True)

from kvsp_moq.integrations.vllm.tiny_model import TinyLlama, write_tiny_llama, write_tiny_lora  # noqa: E402
from kvsp_moq.kvsp.compat import compat_id  # noqa: E402

SHAPE = TinyLlama()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), SHAPE)


def descriptor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsp_moq", "descriptor", *args],
                          capture_output=True, text=True, timeout=120)


def parsed(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert proc.stderr.strip().splitlines()[-1] == f"compat_id {compat_id(doc).hex()}"
    return doc


def test_each_rank_and_adapter_names_its_own_bytes(model: Path, tmp_path: Path) -> None:
    base = parsed(descriptor(str(model), "--dtype", "bfloat16", "--block-tokens", "32"))
    assert (base["model"], base["layers"], base["kv_heads"], base["kv_dtype"], base["block_tokens"]) == \
        (str(model), SHAPE.layers, SHAPE.kv_heads, "bf16", 32)
    ranks = [parsed(descriptor(str(model), "--dtype", "bfloat16", "--block-tokens", "32",
                               "--tensor-parallel-size", "2", "--rank", str(r))) for r in (0, 1)]
    assert [d["kv_heads"] for d in ranks] == [SHAPE.kv_heads // 2] * 2
    assert len({compat_id(d) for d in (base, *ranks)}) == 3  # every rank's blocks differ (§4.1)
    lora = write_tiny_lora(tmp_path / "lora", SHAPE)
    adapted = parsed(descriptor(str(model), "--dtype", "bfloat16", "--block-tokens", "32", "--adapter", str(lora)))
    assert len(adapted["adapters"]) == 1 and compat_id(adapted) != compat_id(base)
    named = parsed(descriptor(str(model), "--dtype", "bfloat16", "--block-tokens", "32", "--name", "llama"))
    assert named["model"] == "llama" and named["model_digest"] == base["model_digest"]


@pytest.mark.parametrize(("args", "says"), [
    (["--block-tokens", "32"], "give the engine's --dtype"),  # config.json: float32
    (["--dtype", "bfloat16", "--block-tokens", "0"], "--block-tokens must be a positive"),
    (["--dtype", "bfloat16", "--block-tokens", "32", "--tensor-parallel-size", "2", "--rank", "2"], "--rank must be in"),
    (["--dtype", "bfloat16", "--block-tokens", "32", "--kv-cache-dtype", "int4"], "no KVSP element type"),
])
def test_bad_settings_are_usage_errors(model: Path, args: list[str], says: str) -> None:
    proc = descriptor(str(model), *args)
    assert proc.returncode == 2 and says in proc.stderr and not proc.stdout, proc.stderr


def test_a_directory_without_config_json_is_a_usage_error(tmp_path: Path) -> None:
    proc = descriptor(str(tmp_path), "--block-tokens", "32")
    assert proc.returncode == 2 and "no config.json" in proc.stderr and not proc.stdout
