"""The native QUIC extension under AddressSanitizer and UndefinedBehaviorSanitizer (issue 28).

The extension parses what hostile peers send (DESIGN.md §6), so CI builds it a second time,
with ``-fsanitize=address,undefined`` (setup.py's ``KVSP_NATIVE_SANITIZE=1``), into a copy of
the package in a temporary directory, and runs its receive-path and hostile-peer tests
(tests/test_native_quic.py: real UDP, aioquic peers, random and truncated datagrams, flow
control; tests/test_native_receive.py: the MOQT data-stream parser on hostile, truncated and
random streams, payloads landing in registered buffers, hostile publishers) in a child Python that loads that build first, with ASan's runtime preloaded and any
report fatal (``halt_on_error``). Leak detection is off: the interpreter itself never frees
some of what it allocates; the extension's own frees are checked by the use-after-free and
double-free detection that stays on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvsp_moq.transport import native
from system_programs import under_ci

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvsp_moq"
BUILD_S = 600  # bounds on the build and the run: a guard against a hang, not a speed check
RUN_S = 900

pytestmark = pytest.mark.skipif(not native.available() and not under_ci(),
                                reason=native.unavailable_reason() or "")


def _asan_runtime() -> str:
    path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.fail(f"gcc's ASan runtime was not found (gcc -print-file-name=libasan.so: {path!r})")
    return path


def test_receive_path_and_hostile_peer_tests_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    build, copy = tmp_path / "build", tmp_path / "site"
    env = {**os.environ, "KVSP_NATIVE_SANITIZE": "1"}
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(copy),
                            "--build-temp", str(build)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=BUILD_S)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    sanitized = list((copy / "kvsp_moq" / "transport" / "native").glob("_ngtcp2*.so"))
    assert len(sanitized) == 1, f"setup.py did not build the extension: {built.stderr[-3000:]}"
    # The package's Python next to the sanitized build, first on the child's path.
    shutil.copytree(PACKAGE, copy / "kvsp_moq", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h"))
    run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(ROOT / "tests")]),
               "LD_PRELOAD": _asan_runtime(),
               "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=1",
               "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    run_env.pop("KVSP_NATIVE_SANITIZE", None)
    which = subprocess.run([sys.executable, "-c", "import kvsp_moq.transport.native._ngtcp2 as m; print(m.__file__)"],
                           cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=RUN_S)
    assert which.returncode == 0 and which.stdout.strip() == str(sanitized[0]), which.stdout + which.stderr[-3000:]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_native_quic.py"),
                            str(ROOT / "tests" / "test_native_receive.py")], cwd=tmp_path, env=run_env,
                           capture_output=True, text=True, timeout=RUN_S)
    report = tests.stdout[-4000:] + tests.stderr[-6000:]
    assert tests.returncode == 0, report
    assert "AddressSanitizer" not in tests.stderr and "runtime error:" not in tests.stderr, report
    assert " passed" in tests.stdout and " skipped" not in tests.stdout, report
