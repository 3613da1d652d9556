/*
 * The event queue Python drains (Endpoint.events()). The network thread appends C events
 * under the endpoint lock; Python detaches the whole list at once and converts it.
 *
 * Received stream bytes are coalesced: a stream has at most one STREAM event in the queue,
 * and bytes received before Python drains join it. Those bytes are bounded by flow control:
 * credit is extended only once Python has taken them (nq_api_credit; RFC 9000 §4.1). A
 * stream has at most one ACKED event, a connection at most one STREAM_LIMIT event; datagrams
 * and control events are charged to per-connection budgets.
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static nq_event *event_new(nq_conn *c, nq_event_type type) {
  nq_event *ev = calloc(1, sizeof(*ev));
  if (ev == NULL) {
    return NULL;
  }
  ev->type = type;
  ev->conn = c->handle;
  ev->stream_id = -1;
  return ev;
}

/* Tell Python (the eventfd turns readable) once per drain. */
static void signal_python(nq_endpoint *ep) {
  uint64_t one = 1;
  ssize_t rv;
  if (ep->event_signalled) {
    return;
  }
  ep->event_signalled = 1;
  rv = write(ep->event_fd, &one, sizeof(one));
  (void)rv; /* the counter cannot overflow: it is read back at every drain */
}

/* A held send chunk ngtcp2 is done with (nq_buf.c): Python releases its buffer at the next
 * drain (the network thread never touches a Python object). */
void nq_release_held(nq_endpoint *ep, nq_chunk *chunk) {
  chunk->next = ep->released;
  ep->released = chunk;
  signal_python(ep);
}

/* The released held chunks, for the binding to release and free (under the lock). */
nq_chunk *nq_released_detach(nq_endpoint *ep) {
  nq_chunk *head = ep->released;
  ep->released = NULL;
  return head;
}

/* Queue ev; signal: tell Python now (else the next signalled event carries it along). */
static void push_signal(nq_conn *c, nq_event *ev, int signal) {
  nq_endpoint *ep = c->ep;
  ev->next = NULL;
  if (ep->ev_tail != NULL) {
    ep->ev_tail->next = ev;
  } else {
    ep->ev_head = ev;
  }
  ep->ev_tail = ev;
  ep->ev_bytes += sizeof(*ev) + ev->cost;
  ++c->queued_events;
  if (signal) {
    signal_python(ep);
  }
}

static void push(nq_conn *c, nq_event *ev) {
  push_signal(c, ev, 1);
}

/* A control event: charged to the connection's budget; past it, the connection is to be
 * closed (a peer provoking events faster than Python drains them) and the ngtcp2 callback
 * that emitted it fails, so ngtcp2 stops processing the packet. */
static int push_control_signal(nq_conn *c, nq_event *ev, int signal) {
  size_t cost = sizeof(*ev) + ev->data.len;
  if (c->ctl_bytes + cost > NQ_CTL_EVENT_BYTES) {
    nq_events_free_list(ev);
    nq_conn_request_close(c, NGTCP2_INTERNAL_ERROR, 0, (const uint8_t *)"event queue full", 16);
    return -1;
  }
  c->ctl_bytes += cost;
  ev->cost = cost;
  push_signal(c, ev, signal);
  return 0;
}

static int push_control(nq_conn *c, nq_event *ev) {
  return push_control_signal(c, ev, 1);
}

int nq_emit_established(nq_conn *c, const uint8_t *alpn, size_t alpnlen) {
  nq_event *ev = event_new(c, NQ_EV_ESTABLISHED);
  if (ev == NULL || nq_bytes_append(&ev->data, alpn, alpnlen, alpnlen) != 0) {
    nq_events_free_list(ev);
    return -1;
  }
  memcpy(&ev->addr, &c->remote, c->remotelen);
  ev->addrlen = c->remotelen;
  return push_control(c, ev);
}

/* Received bytes join the stream's queued STREAM event (or start one). */
int nq_emit_stream_data(nq_stream *s, const uint8_t *data, size_t len, int fin) {
  nq_event *ev = s->rx_ev;
  size_t chunk;
  if (ev == NULL) {
    ev = event_new(s->conn, NQ_EV_STREAM);
    if (ev == NULL) {
      return -1;
    }
    ev->stream_id = s->id;
    ev->stream = s;
    s->rx_ev = ev;
    s->seen = 1;
    push(s->conn, ev);
  }
  /* Chunks grow with what is queued: a few bytes do not cost NQ_RX_CHUNK. */
  chunk = ev->data.len < 4096 ? 4096 : (size_t)ev->data.len;
  if (chunk > NQ_RX_CHUNK) {
    chunk = NQ_RX_CHUNK;
  }
  if (nq_bytes_append(&ev->data, data, len, chunk) != 0) {
    return -1;
  }
  s->conn->ep->ev_bytes += len;
  if (fin) {
    ev->fin = 1;
  }
  return 0;
}

static int emit_stream_code(nq_conn *c, nq_event_type type, int64_t stream_id, uint64_t code) {
  nq_event *ev = event_new(c, type);
  if (ev == NULL) {
    return -1;
  }
  ev->stream_id = stream_id;
  ev->code = code;
  return push_control(c, ev);
}

int nq_emit_reset(nq_conn *c, int64_t stream_id, uint64_t code) {
  return emit_stream_code(c, NQ_EV_RESET, stream_id, code);
}

int nq_emit_stop_sending(nq_conn *c, int64_t stream_id, uint64_t code) {
  return emit_stream_code(c, NQ_EV_STOP_SENDING, stream_id, code);
}

/* A received datagram, dropped when the connection's datagram budget is spent (RFC 9221 §5
 * lets a receiver drop DATAGRAM frames). */
int nq_emit_datagram(nq_conn *c, const uint8_t *data, size_t len) {
  nq_event *ev;
  if (c->rx_dgram_bytes + len > NQ_RX_DGRAM_BYTES) {
    return 0;
  }
  ev = event_new(c, NQ_EV_DATAGRAM);
  if (ev == NULL || nq_bytes_append(&ev->data, data, len, len) != 0) {
    nq_events_free_list(ev);
    return -1;
  }
  ev->cost = len;
  c->rx_dgram_bytes += len;
  push(c, ev);
  return 0;
}

/* Bytes of s were acknowledged: its ACKED event (at most one queued per stream) carries it to
 * the next drain. Once Python has waited on the stream (wait_writable: nq_api_watch_acked),
 * it is woken for the event only while it waits and once the stream's buffered count fell to
 * its threshold: a writer that has its room is not woken by every ACK frame, which at
 * 1452-byte packets was thousands of wake-ups (and lock hand-offs) per MiB
 * (docs/benchmarks.md, "what bounds one connection"). A stream never waited on signals every
 * ACKED event, as before. */
int nq_emit_acked(nq_stream *s) {
  if (s->acked_ev == NULL) {
    nq_event *ev = event_new(s->conn, NQ_EV_ACKED);
    if (ev == NULL) {
      return -1;
    }
    ev->stream_id = s->id;
    ev->stream = s;
    s->acked_ev = ev;
    if (push_control_signal(s->conn, ev, 0) != 0) {
      return -1;
    }
  }
  if (!s->ack_watched || (s->ack_armed && nq_stream_buffered(s) <= s->ack_wake)) {
    s->ack_armed = 0;
    signal_python(s->conn->ep);
  }
  return 0;
}

int nq_emit_stream_limit(nq_conn *c) {
  nq_event *ev;
  if (c->stream_limit_queued || !c->established) {
    return 0;
  }
  ev = event_new(c, NQ_EV_STREAM_LIMIT);
  if (ev == NULL) {
    return -1;
  }
  c->stream_limit_queued = 1;
  return push_control(c, ev);
}

/* The last event of a connection; never refused (the budget does not apply). */
int nq_emit_closed(nq_conn *c, uint64_t code, const uint8_t *reason, size_t reasonlen, int app,
                   int by_peer) {
  nq_event *ev;
  if (c->closed_emitted) {
    return 0;
  }
  c->closed_emitted = 1;
  if (!c->established && c->ep->cfg.server) {
    return 0; /* Python never heard of this connection */
  }
  ev = event_new(c, NQ_EV_CLOSED);
  if (ev == NULL) {
    return -1;
  }
  if (reasonlen > 0 && nq_bytes_append(&ev->data, reason, reasonlen, reasonlen) != 0) {
    free(ev);
    return -1;
  }
  ev->code = code;
  ev->app = (uint8_t)(app != 0);
  ev->by_peer = (uint8_t)(by_peer != 0);
  push(c, ev);
  return 0;
}

/* A ping's packet (or one sent after it) was acknowledged: requests up to seq are answered. */
int nq_emit_pong(nq_conn *c, uint64_t seq) {
  nq_event *ev = event_new(c, NQ_EV_PONG);
  if (ev == NULL) {
    return -1;
  }
  ev->code = seq;
  return push_control(c, ev);
}

/* An object of a registered data stream landed (nq_objects.c); its properties ride along. */
int nq_emit_object(nq_conn *c, int64_t stream_id, const nq_objinfo *info, const uint8_t *props,
                   size_t propslen) {
  nq_event *ev = event_new(c, NQ_EV_OBJECT);
  if (ev == NULL || (propslen > 0 && nq_bytes_append(&ev->data, props, propslen, propslen) != 0)) {
    nq_events_free_list(ev);
    return -1;
  }
  ev->stream_id = stream_id;
  ev->obj = *info;
  return push_control(c, ev);
}

/* A registered data stream ended (result: an nq_dsp_result or NQ_OBJ_RESET). */
int nq_emit_objects_end(nq_conn *c, int64_t stream_id, uint64_t reg, uint8_t result,
                        uint64_t code, const char *reason) {
  nq_event *ev = event_new(c, NQ_EV_OBJECTS_END);
  size_t len = strlen(reason);
  if (ev == NULL || (len > 0 && nq_bytes_append(&ev->data, (const uint8_t *)reason, len, len) != 0)) {
    nq_events_free_list(ev);
    return -1;
  }
  ev->stream_id = stream_id;
  ev->obj.reg = reg;
  ev->obj.result = result;
  ev->code = code;
  return push_control(c, ev);
}

/* The stream goes away: its queued events keep their bytes but stop collecting. */
void nq_events_forget_stream(nq_stream *s) {
  if (s->rx_ev != NULL) {
    s->rx_ev->stream = NULL;
    s->rx_ev = NULL;
  }
  if (s->acked_ev != NULL) {
    s->acked_ev->stream = NULL;
    s->acked_ev = NULL;
  }
}

/* Settle one event as it leaves the queue: later bytes start a new event, budgets are
 * returned, ACKED takes the stream's buffered count now. */
static void settle(nq_endpoint *ep, nq_event *ev) {
  nq_conn *c = nq_endpoint_conn(ep, ev->conn);
  nq_stream *s = ev->stream;
  if (s != NULL) {
    if (ev->type == NQ_EV_STREAM) {
      s->rx_ev = NULL;
    } else if (ev->type == NQ_EV_ACKED) {
      ev->buffered = nq_stream_buffered(s);
      s->acked_ev = NULL;
    }
    ev->stream = NULL;
  }
  if (c == NULL) {
    return;
  }
  if (ev->type == NQ_EV_DATAGRAM) {
    c->rx_dgram_bytes -= ev->cost;
  } else {
    c->ctl_bytes -= ev->cost;
  }
  if (ev->type == NQ_EV_STREAM_LIMIT) {
    c->stream_limit_queued = 0;
  }
  c->queued_events = 0;
}

/* Take every queued event (the caller holds the lock) and clear the eventfd. Streams that
 * closed while Python held their events get their MAX_STREAMS credit now. */
nq_event *nq_events_detach(nq_endpoint *ep) {
  nq_event *head = ep->ev_head;
  uint64_t counter;
  ssize_t rv;
  for (nq_event *ev = head; ev != NULL; ev = ev->next) {
    settle(ep, ev);
  }
  for (nq_conn *c = ep->conns; c != NULL; c = c->next) {
    nq_conn_grant_streams(c);
  }
  ep->ev_head = ep->ev_tail = NULL;
  ep->ev_bytes = 0;
  ep->event_signalled = 0;
  rv = read(ep->event_fd, &counter, sizeof(counter));
  (void)rv; /* EAGAIN when nothing was signalled */
  return head;
}

void nq_events_free_list(nq_event *ev) {
  while (ev != NULL) {
    nq_event *next = ev->next;
    nq_bytes_clear(&ev->data);
    free(ev);
    ev = next;
  }
}
