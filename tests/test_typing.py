"""The packages type-check clean: ``python -m mypy`` with the project's configuration
(``[tool.mypy]`` in pyproject.toml: ``kvsp_moq``, ``relay`` and ``interop``) exits 0.

mypy's cache is ``.mypy_cache/`` at the repository root (git-ignored): a first run checks
everything (≈15 s on 2 cores, most of it reading torch's and numpy's annotations), later ones
only what changed. The check needs torch installed (as the README's test command does): without
it every torch annotation is unresolved and the model code cannot be checked.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                       reason="mypy is not installed (it is in the 'test' extra)"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                       reason="torch is not installed: the model code cannot be type-checked"),
]


def test_mypy_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}", pytrace=False)
