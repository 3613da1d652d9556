"""The suite's order: the longest modules first.

The suite runs on several pytest-xdist workers, one module to a worker at a time (``--dist
loadfile``, pyproject.toml): module-scoped fixtures such as the vLLM engines start once. Workers
take modules in collection order, so a long module collected last would run alone at the end;
these, measured at a few minutes each with the suite running (2-core CI machine), go first.
Everything else keeps pytest's own order.
"""

from __future__ import annotations

import pytest

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
