"""kvsp_moq.moqt.rangeset: the range set the session keeps its ID history in.

Hypothesis checks it against a plain ``set[int]`` for membership under any sequence of adds,
range adds and discards, and that its ranges stay sorted, disjoint and never adjacent (so a
contiguous history is exactly one range).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_moq.moqt.rangeset import RangeSet

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 80), st.just(0)),
        st.tuples(st.just("range"), st.integers(0, 80), st.integers(0, 12)),
        st.tuples(st.just("discard"), st.integers(0, 80), st.just(0)),
    ),
    max_size=60,
)


def _apply(ops: list[tuple[str, int, int]]) -> tuple[RangeSet, set[int]]:
    rs, ref = RangeSet(), set()
    for op, a, b in ops:
        if op == "add":
            rs.add(a)
            ref.add(a)
        elif op == "range":
            rs.add_range(a, a + b)
            ref.update(range(a, a + b))
        else:
            rs.discard(a)
            ref.discard(a)
    return rs, ref


def _check_canonical(rs: RangeSet) -> None:
    ranges = list(rs)
    for start, stop in ranges:
        assert start < stop
    for (_, stop), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert stop < start  # disjoint and not even touching: merged as they fill


@settings(max_examples=400, deadline=None)
@given(_OPS)
def test_equivalent_to_a_set(ops: list[tuple[str, int, int]]) -> None:
    rs, ref = _apply(ops)
    for v in range(-2, 100):
        assert (v in rs) == (v in ref), v
    assert rs.count() == len(ref)
    _check_canonical(rs)


@settings(max_examples=200, deadline=None)
@given(_OPS, st.integers(1, 5))
def test_fill_gaps_bounds_the_ranges_and_only_adds(ops: list[tuple[str, int, int]],
                                                   limit: int) -> None:
    rs, ref = _apply(ops)
    before = len(rs)
    filled = rs.fill_gaps(limit)
    assert len(rs) == min(before, limit)
    assert filled == max(0, before - limit)
    for v in ref:  # nothing is lost: only the lowest gaps become members
        assert v in rs
    _check_canonical(rs)


@settings(max_examples=100, deadline=None)
@given(st.permutations(list(range(40))))
def test_contiguous_history_in_any_order_is_one_range(order: list[int]) -> None:
    rs = RangeSet()
    for v in order:
        rs.add(v)
    assert list(rs) == [(0, 40)]


def test_watermark_plus_holes() -> None:
    rs = RangeSet()
    for v in range(100_000):
        if v not in (7, 50_000):
            rs.add(v)
    assert list(rs) == [(0, 7), (8, 50_000), (50_001, 100_000)]
    rs.add(50_000)
    rs.add(7)
    assert list(rs) == [(0, 100_000)]
    rs.discard(0)
    rs.discard(99_999)
    rs.discard(500)
    assert list(rs) == [(1, 500), (501, 99_999)]
    assert RangeSet([(1, 500), (501, 99_999)]) == rs
    assert rs.fill_gaps(1) == 1 and list(rs) == [(1, 99_999)]


def test_errors() -> None:
    rs = RangeSet()
    rs.add_range(5, 5)
    assert len(rs) == 0
    with pytest.raises(ValueError):
        rs.add_range(6, 5)
    with pytest.raises(ValueError):
        rs.fill_gaps(0)
    assert "RangeSet" in repr(rs)
