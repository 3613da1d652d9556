"""Sans-IO tests of the MOQT session's REQUEST_UPDATE answers and the requests added for the
pubsub API (SUBSCRIBE_TRACKS, draft-18 Joining FETCH). Two sessions wired in memory
(``tests.test_moqt_session.Wire``)."""

from __future__ import annotations

import pytest

from kvsp_moq.moqt.errors import PublishDoneCode, RequestErrorCode
from kvsp_moq.moqt.messages import (
    FetchType,
    JoiningFetch,
    MessageParameters,
    PublishDone,
    RequestError,
    SubscribeTracks,
)
from kvsp_moq.moqt.session import events as ev
from kvsp_moq.moqt.version import Version
from tests.test_moqt_session import NS, Wire


def _subscribed(w: Wire) -> int:
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    w.server.accept_subscribe(rid, 1)
    w.flush()
    w.take(w.client, ev.ResponseReceived)
    return rid


@pytest.mark.parametrize("version", [Version.DRAFT_18, Version.DRAFT_22])
def test_update_rejected_without_ending_then_publish_done_update_failed(
        version: Version) -> None:
    # §"Updating Subscriptions": an unsuccessful REQUEST_UPDATE is answered REQUEST_ERROR,
    # and the publisher MUST also send PUBLISH_DONE UPDATE_FAILED on the same stream.
    w = Wire(version).start()
    rid = _subscribed(w)
    upd = w.client.request_update(rid, MessageParameters(subscriber_priority=3))
    w.flush()
    [u] = w.take(w.server, ev.UpdateReceived)
    assert u.request_id == rid
    w.server.reject(rid, RequestErrorCode.INVALID_RANGE, "bad filter", end=False)
    w.flush()
    [a] = w.take(w.client, ev.UpdateAnswered)
    assert a.update_request_id == upd and isinstance(a.message, RequestError)
    assert a.message.error_code == RequestErrorCode.INVALID_RANGE
    # the request is still open on both sides
    assert rid in w.client.requests and rid in w.server.requests
    assert not w.take(w.client, ev.RequestFinished)
    w.server.publish_done(rid, PublishDoneCode.UPDATE_FAILED, 0, "update failed")
    w.flush()
    [m] = w.take(w.client, ev.RequestMessage)
    assert isinstance(m.message, PublishDone)
    assert m.message.status_code == PublishDoneCode.UPDATE_FAILED
    assert w.take(w.client, ev.RequestFinished)
    assert not w.client.closed and not w.server.closed


def test_reject_without_end_needs_an_answered_request() -> None:
    w = Wire().start()
    rid = w.client.subscribe(NS, b"t")
    w.flush()
    with pytest.raises(ValueError):
        w.server.reject(rid, RequestErrorCode.INVALID_RANGE, end=False)
    assert rid in w.server.requests  # nothing changed
    w.server.reject(rid, RequestErrorCode.DOES_NOT_EXIST)  # the normal end still works
    w.flush()
    [r] = w.take(w.client, ev.ResponseReceived)
    assert isinstance(r.message, RequestError)
    assert rid not in w.server.requests


def test_update_error_then_ok_in_order() -> None:
    w = Wire().start()
    rid = _subscribed(w)
    u1 = w.client.request_update(rid, MessageParameters(subscriber_priority=1))
    u2 = w.client.request_update(rid, MessageParameters(subscriber_priority=2))
    w.flush()
    w.server.reject(rid, RequestErrorCode.INTERNAL_ERROR, end=False)
    w.server.request_ok(rid)
    w.flush()
    answers = w.take(w.client, ev.UpdateAnswered)
    assert [a.update_request_id for a in answers] == [u1, u2]
    assert isinstance(answers[0].message, RequestError)
    assert not isinstance(answers[1].message, RequestError)


def test_subscribe_tracks_request() -> None:
    w = Wire().start()
    rid = w.client.subscribe_tracks((b"kvsp-1",), MessageParameters(forward=False))
    w.flush()
    [r] = w.take(w.server, ev.RequestReceived)
    assert r.request_id == rid and isinstance(r.message, SubscribeTracks)
    assert r.message.track_namespace_prefix == (b"kvsp-1",)
    assert r.message.parameters.forward is False
    w.server.request_ok(rid)
    w.flush()
    [a] = w.take(w.client, ev.ResponseReceived)
    assert a.request_id == rid


def test_joining_fetch_request_draft18_only() -> None:
    w = Wire(Version.DRAFT_18).start()
    sub = _subscribed(w)
    w.take(w.server, ev.RequestReceived)
    rid = w.client.joining_fetch(sub, 2)
    w.flush()
    [r] = w.take(w.server, ev.RequestReceived)
    assert isinstance(r.message, JoiningFetch)
    assert r.message.fetch_type is FetchType.RELATIVE_JOINING
    assert (r.message.joining_request_id, r.message.joining_start) == (sub, 2)
    assert r.request_id == rid
    w22 = Wire(Version.DRAFT_22).start()
    with pytest.raises(ValueError):
        w22.client.joining_fetch(_subscribed(w22), 1)
