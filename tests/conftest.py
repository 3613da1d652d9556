"""The suite's order (the longest modules first), and its system programs.

The suite runs on several pytest-xdist workers, one module to a worker at a time (``--dist
loadfile``, pyproject.toml): module-scoped fixtures such as the vLLM engines start once. Workers
take modules in collection order, so a long module collected last would run alone at the end;
these, measured at a few minutes each with the suite running (2-core CI machine), go first.
Everything else keeps pytest's own order.

Tests that need a system program missing here (``.ci/system-packages.txt``: Debian's
redis-server and chromium) are skipped at collection with one reason that names it and the
command that installs it, reported once: in the header and as one folded line of the summary.
Under CI (``CI=true``) they fail instead (tests/system_programs.py says why).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
from system_programs import SystemProgram, load, missing_failure, under_ci

#: Modules by their time in the suite (longest first): engine starts, the soak, the relay's
#: 100 000-track flood, the interop matrices, the aiopquic venv's drivers.
LONGEST_FIRST = (
    "test_relay_hostile.py",
    "test_demo_vllm.py",
    "test_vllm_connector.py",
    "test_soak.py",
    "test_interop_wt.py",
    "test_interop_matrix.py",
    "test_transport_aiopquic.py",
    "test_demo.py",
    "test_bench_kv.py",
    "test_cli.py",
    "test_cli_moq.py",
    "test_moqt_session_state.py",
)

PROGRAMS = load()
MISSING = [p for p in PROGRAMS if not p.present]
#: The missing program an item needs (set at collection).
NEEDS_MISSING = pytest.StashKey[SystemProgram]()


def pytest_report_header() -> list[str]:
    if not MISSING:
        return [f"system programs present: {', '.join(p.path for p in PROGRAMS)}"]
    then = "their tests FAIL (CI=true)" if under_ci() else "their tests are skipped"
    return [f"system programs missing: {p.reason}; {then}" for p in MISSING]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        program = next((p for p in MISSING if p.needed_by(item)), None)
        if program is None:
            continue
        item.stash[NEEDS_MISSING] = program
        if not under_ci():
            # First of the item's marks: before a module's own skipif of the same program.
            item.add_marker(pytest.mark.skipif(True, reason=program.reason), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under CI: the test fails before its fixtures (or a module's own skip mark) run."""
    program = item.stash.get(NEEDS_MISSING, None)
    if program is not None and under_ci():
        pytest.fail(missing_failure(program), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
        item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A skip for a missing program is reported at the program's line of the list, so the
    summary folds them all into one line (``SKIPPED [N] .ci/system-packages.txt:L: ...``)."""
    report = yield
    program = item.stash.get(NEEDS_MISSING, None)
    if program is not None and report.skipped and isinstance(report.longrepr, tuple):
        report.longrepr = (str(program.list_file), program.line, report.longrepr[2])
    return report
