/*
 * The operations behind the Python methods. The caller holds the endpoint lock; each
 * operation changes state, marks the connection for writing and returns an nq_err (the
 * binding wakes the network thread afterwards). Nothing here sends a packet.
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>

static nq_conn *usable_conn(nq_endpoint *ep, uint64_t handle) {
  nq_conn *c = nq_endpoint_conn(ep, handle);
  return c != NULL && nq_conn_usable(c) ? c : NULL;
}

int nq_api_connect(nq_endpoint *ep, const struct sockaddr *remote, socklen_t remotelen,
                   const char *server_name, uint64_t *handle, char *err, size_t errlen) {
  nq_conn *c;
  if (ep->cfg.server) {
    return NQ_EINVAL;
  }
  if (ep->nconns >= ep->cfg.max_connections) {
    return NQ_EBLOCKED;
  }
  c = nq_conn_new_client(ep, remote, remotelen, server_name, err, errlen);
  if (c == NULL) {
    return NQ_ENOMEM;
  }
  *handle = c->handle;
  return NQ_OK;
}

/* RFC 9000 §4.6: a stream beyond the peer's MAX_STREAMS cannot be opened (NQ_EBLOCKED; the
 * "stream_limit" event says when to retry). */
int nq_api_open_stream(nq_endpoint *ep, uint64_t conn, int uni, int64_t *stream_id) {
  nq_conn *c = usable_conn(ep, conn);
  nq_stream *s;
  int rv;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  rv = uni ? ngtcp2_conn_open_uni_stream(c->qc, stream_id, NULL)
           : ngtcp2_conn_open_bidi_stream(c->qc, stream_id, NULL);
  if (rv == NGTCP2_ERR_STREAM_ID_BLOCKED) {
    return NQ_EBLOCKED;
  }
  if (rv != 0) {
    return NQ_ENOMEM;
  }
  s = nq_stream_attach(c, *stream_id);
  if (s == NULL) {
    (void)ngtcp2_conn_shutdown_stream(c->qc, *stream_id, 0);
    return NQ_ENOMEM;
  }
  s->seen = 1;
  return NQ_OK;
}

/* The stream Python writes to: one of ours, or a bidirectional one of the peer's it has
 * seen (a peer's unidirectional stream has no send side, RFC 9000 §2.1). */
static int writable_stream(nq_conn *c, int64_t stream_id, nq_stream **out) {
  nq_stream *s = nq_stream_get(c, stream_id);
  if (s == NULL) {
    return NQ_ENOSTREAM;
  }
  if (!ngtcp2_is_bidi_stream(stream_id) && !ngtcp2_conn_is_local_stream(c->qc, stream_id)) {
    return NQ_ESTATE;
  }
  *out = s;
  return NQ_OK;
}

static int queue_bytes(nq_conn *c, int64_t stream_id, const uint8_t *data, size_t len,
                       nq_chunk **prefilled, int fin) {
  nq_stream *s = NULL;
  int rv = writable_stream(c, stream_id, &s);
  if (rv != NQ_OK) {
    return rv;
  }
  if (s->fin_queued || s->local_reset) {
    return NQ_ESTATE;
  }
  if (s->peer_stopped) {
    return NQ_OK;
  }
  if (*prefilled != NULL) {
    nq_sendbuf_append_chunk(&s->tx, *prefilled);
    *prefilled = NULL;
  } else if (nq_sendbuf_append(&s->tx, data, len) != 0) {
    return NQ_ENOMEM;
  }
  if (fin) {
    s->fin_queued = 1;
  }
  nq_stream_txq_add(s);
  return NQ_OK;
}

/* Queue bytes (copied here, or a chunk the binding made without the lock: a copy, or a held
 * chunk pointing into Python's buffer; once queued it is taken over and *prefilled set to
 * NULL, else it stays the caller's to free or release) and maybe FIN. After the send side
 * was reset by ngtcp2 for the peer's STOP_SENDING the bytes are dropped: the peer wants no
 * more (RFC 9000 §3.5). */
int nq_api_send(nq_endpoint *ep, uint64_t conn, int64_t stream_id, const uint8_t *data,
                size_t len, nq_chunk **prefilled, int fin) {
  nq_conn *c = usable_conn(ep, conn);
  int idle, rv;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  idle = c->state == NQ_OPEN && c->txq_head == NULL && c->dgram_head == NULL;
  rv = queue_bytes(c, stream_id, data, len, prefilled, fin);
  /* An idle connection sends the new bytes from this thread, now: a request, a response or
   * an object's first packets leave without waiting for the network thread to be scheduled
   * (two thread wake-ups per round trip otherwise: docs/benchmarks.md, first layer). What is
   * left past ngtcp2's send quantum, and every send on a connection already sending, stays
   * with the network thread, which the binding wakes. */
  if (rv == NQ_OK && idle && c->txq_head != NULL) {
    (void)nq_conn_write(c, nq_now());
  }
  return rv;
}

int nq_api_buffered(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t *out) {
  nq_conn *c = usable_conn(ep, conn);
  nq_stream *s;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  s = nq_stream_get(c, stream_id);
  *out = s != NULL ? nq_stream_buffered(s) : 0;
  return NQ_OK;
}

/* Python waits until the stream's buffered count is at most threshold (wait_writable): the
 * acknowledgement that brings it there signals the event fd (nq_emit_acked). *buffered is
 * the count now (0 for a stream that is gone): a caller that finds the threshold reached
 * already must not wait for that signal. */
int nq_api_watch_acked(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t threshold,
                       uint64_t *buffered) {
  nq_conn *c = usable_conn(ep, conn);
  nq_stream *s;
  *buffered = 0;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  s = nq_stream_get(c, stream_id);
  if (s != NULL) {
    s->ack_watched = 1;
    s->ack_armed = 1;
    s->ack_wake = threshold;
    *buffered = nq_stream_buffered(s);
  }
  return NQ_OK;
}

/* RESET_STREAM (RFC 9000 §19.4): abandon the send side. */
int nq_api_reset_stream(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t code) {
  nq_conn *c = usable_conn(ep, conn);
  nq_stream *s = NULL;
  int rv;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  rv = writable_stream(c, stream_id, &s);
  if (rv != NQ_OK) {
    return rv;
  }
  s->local_reset = 1;
  nq_stream_txq_remove(s);
  /* may close the stream and free s (nq_cb_stream_close) */
  (void)ngtcp2_conn_shutdown_stream_write(c->qc, stream_id, code);
  c->want_write = 1;
  return NQ_OK;
}

/* STOP_SENDING (RFC 9000 §19.5): ask the peer to abandon its send side. */
int nq_api_stop_sending(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t code) {
  nq_conn *c = usable_conn(ep, conn);
  nq_stream *s;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  if (stream_id < 0 ||
      (!ngtcp2_is_bidi_stream(stream_id) && ngtcp2_conn_is_local_stream(c->qc, stream_id))) {
    return NQ_ESTATE; /* our unidirectional stream has no receive side */
  }
  s = nq_stream_get(c, stream_id);
  if (s != NULL) {
    s->read_stopped = 1;
  }
  (void)ngtcp2_conn_shutdown_stream_read(c->qc, stream_id, code);
  c->want_write = 1;
  return NQ_OK;
}

int nq_api_send_datagram(nq_endpoint *ep, uint64_t conn, const uint8_t *data, size_t len) {
  nq_conn *c = usable_conn(ep, conn);
  size_t max;
  nq_dgram *d;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  max = nq_conn_max_datagram_payload(c);
  if (max == 0) {
    return NQ_ENODGRAM;
  }
  if (len > max) {
    return NQ_ETOOBIG;
  }
  if (c->dgram_bytes + len > NQ_TX_DGRAM_BYTES) {
    return NQ_EBLOCKED;
  }
  d = malloc(sizeof(*d) + len);
  if (d == NULL) {
    return NQ_ENOMEM;
  }
  d->next = NULL;
  d->len = len;
  memcpy(d->data, data, len);
  if (c->dgram_tail != NULL) {
    c->dgram_tail->next = d;
  } else {
    c->dgram_head = d;
  }
  c->dgram_tail = d;
  c->dgram_bytes += len;
  c->want_write = 1;
  return NQ_OK;
}

int nq_api_close_connection(nq_endpoint *ep, uint64_t conn, uint64_t code,
                            const uint8_t *reason, size_t reasonlen, int app) {
  nq_conn *c = usable_conn(ep, conn);
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  return nq_conn_request_close(c, code, app, reason, reasonlen) == 0 ? NQ_OK : NQ_ENOMEM;
}

/* PING (RFC 9000 §19.2): number a request; the next packets carry a PING (nq_write.c) and a
 * PONG event with this number (or a later one) follows its acknowledgement (nq_conn.c). */
int nq_api_ping(nq_endpoint *ep, uint64_t conn, uint64_t *seq) {
  nq_conn *c = usable_conn(ep, conn);
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  *seq = ++c->ping_requested;
  c->want_write = 1;
  return NQ_OK;
}

int nq_api_max_datagram_payload(nq_endpoint *ep, uint64_t conn, size_t *out) {
  nq_conn *c = usable_conn(ep, conn);
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  *out = nq_conn_max_datagram_payload(c);
  return NQ_OK;
}

/* Python holds the drained stream bytes now: extend the peer's flow-control credit by as
 * much (RFC 9000 §4.1, §4.2), stream and connection. */
void nq_api_credit(nq_endpoint *ep, const nq_event *drained) {
  for (const nq_event *ev = drained; ev != NULL; ev = ev->next) {
    nq_conn *c;
    if (ev->type != NQ_EV_STREAM || ev->data.len == 0) {
      continue;
    }
    c = nq_endpoint_conn(ep, ev->conn);
    if (c == NULL || (c->state != NQ_OPEN && c->state != NQ_HANDSHAKING)) {
      continue;
    }
    (void)ngtcp2_conn_extend_max_stream_offset(c->qc, ev->stream_id, ev->data.len);
    ngtcp2_conn_extend_max_offset(c->qc, ev->data.len);
    c->want_write = 1;
  }
}

int nq_api_stats(nq_endpoint *ep, uint64_t conn, nq_stats *out) {
  nq_conn *c = nq_endpoint_conn(ep, conn);
  ngtcp2_conn_stat cs;
  if (c == NULL || c->state == NQ_DEAD) {
    return NQ_ENOCONN;
  }
  ngtcp2_conn_get_conn_stat(c->qc, &cs);
  memset(out, 0, sizeof(*out));
  out->smoothed_rtt_ms = (double)cs.smoothed_rtt / NGTCP2_MILLISECONDS;
  out->min_rtt_ms = cs.min_rtt == UINT64_MAX ? 0.0 : (double)cs.min_rtt / NGTCP2_MILLISECONDS;
  out->latest_rtt_ms = (double)cs.latest_rtt / NGTCP2_MILLISECONDS;
  out->pto_ms = (double)ngtcp2_conn_get_pto(c->qc) / NGTCP2_MILLISECONDS;
  out->pacing_rate = cs.pacing_rate * NGTCP2_SECONDS; /* ngtcp2: bytes per nanosecond */
  out->cwnd = cs.cwnd;
  out->bytes_in_flight = cs.bytes_in_flight;
  out->delivery_rate = cs.delivery_rate_sec;
  out->bytes_sent = c->bytes_sent;
  out->bytes_recv = c->bytes_recv;
  out->stream_pkts_lost = c->stream_pkts_lost;
  for (size_t i = 0; i < c->streams.cap; ++i) {
    const nq_stream *s = c->streams.vals[i];
    if (s != NULL) {
      out->stream_pkts_lost += ngtcp2_conn_get_stream_loss_count(c->qc, s->id);
    }
  }
  out->max_udp_payload = ngtcp2_conn_get_path_max_tx_udp_payload_size(c->qc);
  out->cc = ep->cfg.cc;
  return NQ_OK;
}
