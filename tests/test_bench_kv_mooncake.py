"""The Mooncake Transfer Engine row of ``kvsp bench kv`` (issue 28): skipped with its reason
where the engine does not import; where it does, two real engine processes on loopback and a
verified read. Never asserts on speed."""

from __future__ import annotations

import pytest

from kvsp_moq.cli.bench.kv.mooncake import MooncakeTiming, measure_mooncake


def test_skipped_with_its_reason_when_the_engine_does_not_import() -> None:
    got = measure_mooncake(1 << 20, 1, module="kvsp_no_such_mooncake.engine")
    assert isinstance(got, str)
    assert "kvsp_no_such_mooncake.engine does not import" in got
    assert "kvsp-moq[mooncake]" in got and "libibverbs1" in got


def test_a_failing_engine_is_a_reason_not_a_crash() -> None:
    """A module that imports but has no working engine: the target process fails, and its
    last stderr lines are the reason."""
    got = measure_mooncake(1 << 20, 1, module="json")
    assert isinstance(got, str) and "did not start" in got and "TransferEngine" in got


def test_measures_a_verified_read_where_installed() -> None:
    pytest.importorskip("mooncake.engine")
    got = measure_mooncake(2 << 20, 1)
    # The reader checks the SHA-256 of every read against the target's; a mismatch is a reason.
    assert isinstance(got, MooncakeTiming), got
    assert got.block_s > 0 and got.cpu_s >= 0 and got.version
