/*
 * Packets out for one connection: ngtcp2 fills each packet from our queued datagrams and
 * streams (round robin), packets of one size to one peer go out in one GSO batch, and a call
 * sends at most ngtcp2's send quantum before it updates the pacing timer (ngtcp2 paces with
 * the congestion controller's rate; ngtcp2_conn_get_expiry includes the next send time).
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>

/* One GSO batch being filled in the endpoint's txbuf. */
typedef struct batch {
  size_t len;      /* bytes in txbuf */
  size_t seg;      /* the size of its packets (the last may be shorter) */
  size_t nseg;
  struct sockaddr_storage to;
  socklen_t tolen;
} batch;

static void batch_flush(nq_conn *c, batch *b) {
  if (b->len > 0) {
    nq_udp_send(&c->ep->udp, (const struct sockaddr *)&b->to, b->tolen, c->ep->txbuf, b->len,
                b->nseg > 1 ? b->seg : 0);
  }
  b->len = b->seg = b->nseg = 0;
}

/* Account for a packet ngtcp2 just wrote at txbuf + b->len. Packets join the batch while
 * they go to the same peer and do not grow; a shorter one ends it (GSO's last segment may be
 * short). A PMTU probe (larger than the path's confirmed size) goes alone: the kernel would
 * refuse a whole batch whose segments exceed the path MTU. */
static void batch_add(nq_conn *c, batch *b, const ngtcp2_path *path, size_t n) {
  size_t path_max = ngtcp2_conn_get_path_max_tx_udp_payload_size(c->qc);
  int same_peer = b->tolen == path->remote.addrlen &&
                  memcmp(&b->to, path->remote.addr, path->remote.addrlen) == 0;
  if (b->len > 0 && (!same_peer || n > b->seg || b->seg > path_max)) {
    size_t at = b->len; /* send what came before, then move this packet to the front */
    batch_flush(c, b);
    memmove(c->ep->txbuf, c->ep->txbuf + at, n);
  }
  if (b->len == 0) {
    b->seg = n;
    memcpy(&b->to, path->remote.addr, path->remote.addrlen);
    b->tolen = path->remote.addrlen;
  }
  b->len += n;
  ++b->nseg;
  c->bytes_sent += n;
  if (n < b->seg || n > path_max || b->nseg == NQ_GSO_MAX_SEGS ||
      b->len + c->ep->cfg.max_udp_payload > NQ_GSO_MAX_BYTES) {
    batch_flush(c, b);
  }
}

/* ngtcp2 took ndatalen bytes of s (and its FIN when all were offered with the flag). */
static void stream_took(nq_stream *s, ngtcp2_ssize ndatalen, uint32_t flags) {
  if (ndatalen < 0) {
    return;
  }
  nq_sendbuf_consume(&s->tx, (size_t)ndatalen);
  if ((flags & NGTCP2_WRITE_STREAM_FLAG_FIN) && s->tx.sent == s->tx.end) {
    s->fin_sent = 1;
  }
  nq_stream_txq_remove(s);
  nq_stream_txq_add(s); /* to the back of the queue, if it still has something to send */
}

/* What ngtcp2 said about a stream it could not write: the packet goes on without it. */
static void stream_refused(nq_stream *s, ngtcp2_ssize rv) {
  if (rv == NGTCP2_ERR_STREAM_DATA_BLOCKED) {
    s->blocked = 1; /* until MAX_STREAM_DATA (nq_cb_extend_max_stream_data) */
  } else if (rv == NGTCP2_ERR_STREAM_SHUT_WR && !s->local_reset) {
    s->peer_stopped = 1; /* ngtcp2 reset it for the peer's STOP_SENDING (RFC 9000 §3.5) */
  }
  nq_stream_txq_remove(s);
}

/* A queued datagram goes first; one that no longer fits the path is dropped (RFC 9221 §5). */
static nq_dgram *next_datagram(nq_conn *c) {
  while (c->dgram_head != NULL &&
         c->dgram_head->len > nq_conn_max_datagram_payload(c)) {
    nq_dgram *d = c->dgram_head;
    c->dgram_head = d->next;
    if (c->dgram_head == NULL) {
      c->dgram_tail = NULL;
    }
    c->dgram_bytes -= d->len;
    free(d);
  }
  return c->dgram_head;
}

static void datagram_sent(nq_conn *c) {
  nq_dgram *d = c->dgram_head;
  c->dgram_head = d->next;
  if (c->dgram_head == NULL) {
    c->dgram_tail = NULL;
  }
  c->dgram_bytes -= d->len;
  free(d);
}

static ngtcp2_ssize write_datagram(nq_conn *c, nq_dgram *d, ngtcp2_path *path,
                                   ngtcp2_pkt_info *pi, uint8_t *dest, size_t destlen,
                                   ngtcp2_tstamp ts) {
  ngtcp2_vec v = {d->data, d->len};
  int accepted = 0;
  ngtcp2_ssize n = ngtcp2_conn_writev_datagram(c->qc, path, pi, dest, destlen, &accepted,
                                               NGTCP2_WRITE_DATAGRAM_FLAG_MORE, 0, &v, 1, ts);
  if (accepted) {
    datagram_sent(c);
  }
  return n;
}

/* Offer the stream at the head of the queue (none: finish the packet). */
static ngtcp2_ssize write_stream(nq_conn *c, int finish, ngtcp2_path *path,
                                 ngtcp2_pkt_info *pi, uint8_t *dest, size_t destlen,
                                 ngtcp2_tstamp ts) {
  nq_stream *s = !finish && ngtcp2_conn_get_max_data_left(c->qc) > 0 ? c->txq_head : NULL;
  ngtcp2_vec vec[NQ_MAX_VECS];
  size_t nvec = 0;
  uint32_t flags = NGTCP2_WRITE_STREAM_FLAG_MORE;
  ngtcp2_ssize ndatalen = -1, n;
  int all = 1;
  if (s != NULL) {
    nvec = nq_sendbuf_unsent(&s->tx, vec, NQ_MAX_VECS, &all);
    if (all && s->fin_queued) {
      flags |= NGTCP2_WRITE_STREAM_FLAG_FIN;
    }
  }
  n = ngtcp2_conn_writev_stream(c->qc, path, pi, dest, destlen, &ndatalen, flags,
                                s != NULL ? s->id : -1, vec, nvec, ts);
  if (s != NULL) {
    if (n == NGTCP2_ERR_STREAM_DATA_BLOCKED || n == NGTCP2_ERR_STREAM_SHUT_WR ||
        n == NGTCP2_ERR_STREAM_NOT_FOUND) {
      stream_refused(s, n);
      return NGTCP2_ERR_WRITE_MORE; /* the packet continues with something else */
    }
    stream_took(s, ndatalen, flags);
  }
  return n;
}

/* Fill one packet; > 0: its size, 0: nothing may be sent now, < 0: a connection error.
 * Frames of many streams and datagrams may share it; past NQ_MAX_FRAMES offers the packet
 * is finished with what it has (a bound on the loop whatever ngtcp2 answers). */
#define NQ_MAX_FRAMES 256
static ngtcp2_ssize write_packet(nq_conn *c, ngtcp2_path *path, uint8_t *dest, size_t destlen,
                                 ngtcp2_tstamp ts) {
  ngtcp2_pkt_info pi;
  for (int i = 0;; ++i) {
    int finish = i >= NQ_MAX_FRAMES;
    nq_dgram *d = finish ? NULL : next_datagram(c);
    ngtcp2_ssize n = d != NULL ? write_datagram(c, d, path, &pi, dest, destlen, ts)
                               : write_stream(c, finish, path, &pi, dest, destlen, ts);
    if (n != NGTCP2_ERR_WRITE_MORE || i > NQ_MAX_FRAMES) {
      return n == NGTCP2_ERR_WRITE_MORE ? NGTCP2_ERR_INTERNAL : n;
    }
  }
}

/* PING (nq_api_ping). ngtcp2 0.12 has no call to send one, so a requested ping is answered by
 * the first ack-eliciting packet sent after the request: nq_conn.c waits for the
 * acknowledgement of a packet sent at or after ping_ts. When a write sends nothing
 * ack-eliciting (no stream data, no datagram: only ACKs, or nothing), ping_send writes one
 * more packet with a PING in it: ngtcp2 puts a PING into an otherwise empty packet once its
 * keep-alive timer has expired, and a 1 ns timeout, a nanosecond after the last packet,
 * expires it for that packet only (0 turns the timer off again). */
static int ping_wanted(const nq_conn *c) {
  return c->ping_requested > c->ping_sent && c->state == NQ_OPEN;
}

static uint64_t bytes_in_flight(nq_conn *c) {
  ngtcp2_conn_stat cs;
  ngtcp2_conn_get_conn_stat(c->qc, &cs);
  return cs.bytes_in_flight;
}

static void ping_sent(nq_conn *c, ngtcp2_tstamp ts) {
  c->ping_sent = c->ping_requested;
  c->ping_ts = ts;
}

/* After a write at *ts that began with inflight bytes in flight. Returns -1 when the
 * connection failed (closed). */
static int ping_send(nq_conn *c, batch *b, uint64_t inflight, ngtcp2_tstamp *ts) {
  ngtcp2_path_storage ps;
  ngtcp2_tstamp now = nq_now();
  ngtcp2_ssize n;
  if (bytes_in_flight(c) > inflight) {
    ping_sent(c, *ts); /* this write sent something ack-eliciting */
    return 0;
  }
  now = now > *ts ? now : *ts + 1;
  ngtcp2_path_storage_zero(&ps);
  ngtcp2_conn_set_keep_alive_timeout(c->qc, 1);
  n = write_packet(c, &ps.path, c->ep->txbuf + b->len, c->ep->cfg.max_udp_payload, now);
  ngtcp2_conn_set_keep_alive_timeout(c->qc, 0);
  if (n < 0) {
    batch_flush(c, b);
    nq_conn_close_liberr(c, (int)n, now);
    return -1;
  }
  if (n > 0) { /* else nothing may be sent now (pacing, congestion): the next write retries */
    batch_add(c, b, &ps.path, (size_t)n);
    ping_sent(c, now);
    *ts = now;
  }
  return 0;
}

/* Send what c may send now. Returns 1 when it stopped at the send quantum with more to
 * send (the network thread comes back at once), else 0. */
int nq_conn_write(nq_conn *c, ngtcp2_tstamp ts) {
  size_t destlen = c->ep->cfg.max_udp_payload;
  size_t quantum = ngtcp2_conn_get_send_quantum(c->qc) / destlen;
  size_t npkts = 0;
  batch b;
  int ping;
  uint64_t inflight = 0;
  if (c->state != NQ_HANDSHAKING && c->state != NQ_OPEN) {
    return 0;
  }
  memset(&b, 0, sizeof(b));
  if (quantum == 0) {
    quantum = 1;
  }
  c->want_write = 0;
  ping = ping_wanted(c);
  if (ping) {
    inflight = bytes_in_flight(c);
  }
  for (;;) {
    ngtcp2_path_storage ps;
    ngtcp2_ssize n;
    ngtcp2_path_storage_zero(&ps);
    n = write_packet(c, &ps.path, c->ep->txbuf + b.len, destlen, ts);
    if (n < 0) {
      batch_flush(c, &b);
      nq_conn_close_liberr(c, (int)n, ts);
      return 0;
    }
    if (n == 0) {
      break;
    }
    batch_add(c, &b, &ps.path, (size_t)n);
    if (++npkts == quantum) {
      if (ping && ping_send(c, &b, inflight, &ts) != 0) {
        return 0;
      }
      batch_flush(c, &b);
      ngtcp2_conn_update_pkt_tx_time(c->qc, ts);
      c->want_write = 1;
      return 1;
    }
  }
  if (ping && ping_send(c, &b, inflight, &ts) != 0) {
    return 0;
  }
  batch_flush(c, &b);
  ngtcp2_conn_update_pkt_tx_time(c->qc, ts);
  return 0;
}
