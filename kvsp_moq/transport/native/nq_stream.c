/*
 * Streams: our record of a QUIC stream (its send buffer, its place in the send queue, its
 * queued events) and the ngtcp2 callbacks about streams.
 *
 * A record exists for a stream Python opened or wrote to, and for a peer's stream once bytes
 * of it reach Python; it goes when ngtcp2 closes the stream (both directions done, RFC 9000
 * §3), which is also when ngtcp2 gives up its pointers into the send buffer.
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>

nq_stream *nq_stream_get(nq_conn *c, int64_t stream_id) {
  if (stream_id < 0) {
    return NULL;
  }
  return nq_u64map_get(&c->streams, (uint64_t)stream_id);
}

/* Our record of an ngtcp2 stream, made on first use. */
nq_stream *nq_stream_attach(nq_conn *c, int64_t stream_id) {
  nq_stream *s = nq_stream_get(c, stream_id);
  if (s != NULL) {
    return s;
  }
  s = calloc(1, sizeof(*s));
  if (s == NULL) {
    return NULL;
  }
  s->id = stream_id;
  s->conn = c;
  s->tx.ep = c->ep;
  if (nq_u64map_put(&c->streams, (uint64_t)stream_id, s) != 0) {
    free(s);
    return NULL;
  }
  (void)ngtcp2_conn_set_stream_user_data(c->qc, stream_id, s);
  return s;
}

/* ngtcp2 closed the stream (or the connection is going): it reads none of the send buffer any
 * more, so held chunks are handed back here, acknowledged or not (a reset stream's too). */
static void stream_free(nq_stream *s) {
  nq_objects_stream_free(s);
  nq_stream_txq_remove(s);
  nq_events_forget_stream(s);
  nq_sendbuf_free(&s->tx);
  free(s);
}

/* Free every record of a connection that is going away (its ngtcp2 state goes with it). */
void nq_stream_free_all(nq_conn *c) {
  for (size_t i = 0; i < c->streams.cap; ++i) {
    if (c->streams.vals[i] != NULL) {
      stream_free(c->streams.vals[i]);
    }
  }
  nq_u64map_free(&c->streams);
}

/* ---- the send queue: streams with something to send, served round robin -------------- */

int nq_stream_sendable(const nq_stream *s) {
  if (s->local_reset || s->peer_stopped || s->blocked) {
    return 0;
  }
  return s->tx.sent < s->tx.end || (s->fin_queued && !s->fin_sent);
}

void nq_stream_txq_add(nq_stream *s) {
  nq_conn *c = s->conn;
  if (s->in_txq || !nq_stream_sendable(s)) {
    return;
  }
  s->in_txq = 1;
  s->txq_next = NULL;
  s->txq_prev = c->txq_tail;
  if (c->txq_tail != NULL) {
    c->txq_tail->txq_next = s;
  } else {
    c->txq_head = s;
  }
  c->txq_tail = s;
  c->want_write = 1;
}

void nq_stream_txq_remove(nq_stream *s) {
  nq_conn *c = s->conn;
  if (!s->in_txq) {
    return;
  }
  if (s->txq_prev != NULL) {
    s->txq_prev->txq_next = s->txq_next;
  } else {
    c->txq_head = s->txq_next;
  }
  if (s->txq_next != NULL) {
    s->txq_next->txq_prev = s->txq_prev;
  } else {
    c->txq_tail = s->txq_prev;
  }
  s->txq_prev = s->txq_next = NULL;
  s->in_txq = 0;
}

/* Bytes queued and not yet acknowledged (0 once the send side is reset: they never will be). */
uint64_t nq_stream_buffered(const nq_stream *s) {
  if (s->local_reset || s->peer_stopped) {
    return 0;
  }
  return s->tx.end - s->tx.acked;
}

/* ---- ngtcp2 callbacks ------------------------------------------------------------------- */

/* A peer's stream closed: MAX_STREAMS credit for another one (RFC 9000 §4.6), at once if
 * Python has drained everything, else when it does (so a peer cannot make us queue events
 * for more streams than the limit while Python is not reading). */
static void count_closed_remote(nq_conn *c, int64_t stream_id) {
  if (ngtcp2_conn_is_local_stream(c->qc, stream_id)) {
    return;
  }
  if (ngtcp2_is_bidi_stream(stream_id)) {
    ++c->grant_bidi;
  } else {
    ++c->grant_uni;
  }
  if (c->queued_events == 0) {
    nq_conn_grant_streams(c);
  }
}

/* ngtcp2 before 0.14 never closes a peer's unidirectional stream (fixed upstream by commit
 * 1d591bde, "Fix bug that a remote uni stream never be closed"): there, the end of such a
 * stream (its FIN delivered, or a RESET_STREAM) counts as its close, once. ngtcp2 keeps its
 * state of the stream until the connection ends, and so do we keep our record (marked
 * ended), so that a RESET_STREAM after the FIN counts nothing twice. */
static int remote_uni_lingers(nq_conn *c, int64_t stream_id) {
  return c->ep->remote_uni_lingers && !ngtcp2_is_bidi_stream(stream_id) &&
         !ngtcp2_conn_is_local_stream(c->qc, stream_id);
}

static void remote_uni_ended(nq_conn *c, nq_stream *s, int64_t stream_id) {
  if (s == NULL) {
    s = nq_stream_attach(c, stream_id);
  }
  if (s != NULL) {
    if (s->ended) {
      return;
    }
    s->ended = 1;
  }
  count_closed_remote(c, stream_id);
}

int nq_cb_recv_stream_data(ngtcp2_conn *qc, uint32_t flags, int64_t stream_id, uint64_t offset,
                           const uint8_t *data, size_t datalen, void *user_data,
                           void *stream_user_data) {
  nq_conn *c = user_data;
  nq_stream *s = stream_user_data;
  (void)qc;
  (void)offset;
  int fin = (flags & NGTCP2_STREAM_DATA_FLAG_FIN) != 0;
  int taken;
  if (s == NULL && (s = nq_stream_attach(c, stream_id)) == NULL) {
    return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  /* A registered data stream is parsed into its destinations here (nq_objects.c). */
  taken = nq_objects_recv(c, s, data, datalen, fin);
  if (taken < 0 || (taken == 0 && nq_emit_stream_data(s, data, datalen, fin) != 0)) {
    return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  if ((flags & NGTCP2_STREAM_DATA_FLAG_FIN) && remote_uni_lingers(c, stream_id)) {
    remote_uni_ended(c, s, stream_id);
  }
  return 0;
}

int nq_cb_acked_stream_data_offset(ngtcp2_conn *qc, int64_t stream_id, uint64_t offset,
                                   uint64_t datalen, void *user_data, void *stream_user_data) {
  nq_stream *s = stream_user_data;
  (void)qc;
  (void)stream_id;
  (void)user_data;
  if (s == NULL || datalen == 0) {
    return 0;
  }
  nq_sendbuf_ack(&s->tx, offset, datalen);
  return nq_emit_acked(s) == 0 ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

/* ngtcp2 0.12 has no callback for a STOP_SENDING it receives (it answers with RESET_STREAM
 * itself, RFC 9000 §3.5). We learn of it when ngtcp2 refuses to write the stream
 * (peer_stopped), or when the stream closes carrying an error code while our send side was
 * neither finished nor reset by us. */
static int stopped_by_peer(nq_conn *c, const nq_stream *s, uint32_t flags) {
  if (s->peer_stopped) {
    return 1;
  }
  if (!(flags & NGTCP2_STREAM_CLOSE_FLAG_APP_ERROR_CODE_SET) || s->local_reset) {
    return 0;
  }
  if (!ngtcp2_is_bidi_stream(s->id) && !ngtcp2_conn_is_local_stream(c->qc, s->id)) {
    return 0; /* the peer's unidirectional stream: no send side */
  }
  return !(s->fin_sent && s->tx.acked == s->tx.end);
}

int nq_cb_stream_close(ngtcp2_conn *qc, uint32_t flags, int64_t stream_id,
                       uint64_t app_error_code, void *user_data, void *stream_user_data) {
  nq_conn *c = user_data;
  nq_stream *s = stream_user_data;
  int rv = 0;
  c->stream_pkts_lost += ngtcp2_conn_get_stream_loss_count(qc, stream_id);
  if (s != NULL) {
    if (stopped_by_peer(c, s, flags)) {
      rv = nq_emit_stop_sending(c, stream_id, app_error_code);
    }
    nq_u64map_del(&c->streams, (uint64_t)stream_id);
    stream_free(s);
  }
  count_closed_remote(c, stream_id);
  return rv == 0 ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

/* RESET_STREAM from the peer (RFC 9000 §19.4); Python hears of it only for a stream it saw. */
int nq_cb_stream_reset(ngtcp2_conn *qc, int64_t stream_id, uint64_t final_size,
                       uint64_t app_error_code, void *user_data, void *stream_user_data) {
  nq_conn *c = user_data;
  nq_stream *s = stream_user_data;
  int rv = 0;
  (void)final_size;
  if (s != NULL && s->ended) {
    return 0; /* after the FIN: nothing was lost */
  }
  if (s != NULL && s->rx != NULL) {
    nq_objects_reset(c, s, app_error_code);
  }
  if (s != NULL && nq_objects_parked_reset(c, s) != 0) {
    return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  if (s != NULL && s->seen) {
    rv = nq_emit_reset(c, stream_id, app_error_code);
  }
  /* Without a record ngtcp2 may have no state either (a RESET_STREAM opening the stream): it
   * then grants the credit itself. */
  if (remote_uni_lingers(c, stream_id) &&
      (s != NULL || ngtcp2_conn_set_stream_user_data(qc, stream_id, NULL) == 0)) {
    remote_uni_ended(c, s, stream_id);
  }
  return rv == 0 ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

/* MAX_STREAM_DATA (RFC 9000 §19.10): a blocked stream may send again. */
int nq_cb_extend_max_stream_data(ngtcp2_conn *qc, int64_t stream_id, uint64_t max_data,
                                 void *user_data, void *stream_user_data) {
  nq_stream *s = stream_user_data;
  (void)qc;
  (void)stream_id;
  (void)max_data;
  (void)user_data;
  if (s != NULL && s->blocked) {
    s->blocked = 0;
    nq_stream_txq_add(s);
  }
  return 0;
}

/* MAX_STREAMS (RFC 9000 §19.11): opens that were refused may be retried. */
int nq_cb_extend_max_local_streams(ngtcp2_conn *qc, uint64_t max_streams, void *user_data) {
  (void)qc;
  (void)max_streams;
  return nq_emit_stream_limit(user_data) == 0 ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}
