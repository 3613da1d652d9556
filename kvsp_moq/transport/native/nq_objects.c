/*
 * Object destinations Python registers, and the peer's data streams parsed into them on the
 * network thread (DESIGN.md §6 "The native data plane").
 *
 * Python registers, before its FETCH (or SUBSCRIBE) leaves, the buffers the objects of that
 * request land in (nq_api_objects_register). A peer's unidirectional stream whose first bytes
 * (stream type, then Request ID or Track Alias) name a registration is parsed here by nq_moqt.c:
 * payloads are copied once, from the decrypted STREAM frame into their buffer, hashed as they
 * land, and Python hears one OBJECT event per object and one OBJECTS_END per stream. Every other
 * stream - control streams, data streams nobody registered for, bidirectional streams - goes to
 * Python unchanged, as before (its first bytes held here until its type and ID are known, at
 * most 18 bytes).
 *
 * Flow control: bytes consumed here are credited at once (RFC 9000 §4.1); they are in their
 * destination already, so the peer's window is not held by Python's pace.
 *
 * What a peer sends decides nothing that is allocated: the destinations are Python's, an object
 * whose Payload Length differs from its destination's size is refused (the stream is stopped with
 * CANCELLED, as kvsp_moq.bridge.receive refuses it), an object outside the registered range too;
 * a second delivery of an object is discarded.
 */
#include "nq.h"

#include <sys/mman.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Landed bytes are handed to the hash thread in batches of at least this many. */
#define NQ_HASH_BATCH (256u * 1024u)

/* A registered data stream being parsed. */
typedef struct nq_rx {
  nq_dsp dsp;
  nq_conn *conn;
  nq_stream *stream;
  nq_objreg *reg; /* NULL once Python unregistered it: objects are discarded */
  uint64_t reg_handle;
  size_t slot;
  int landing;
  /* The object landing: its hash context (on the hash thread) and the landed bytes not yet
   * handed to it. */
  gnutls_hash_hd_t hash;
  int hashing;
  const uint8_t *batch;
  size_t batchlen;
} nq_rx;

/* ---- registrations ----------------------------------------------------------------------- */

nq_objreg *nq_objreg_new(nq_dsp_kind kind, uint64_t id, uint64_t group, uint64_t first, size_t n,
                         int timed_out_range, int descending, uint64_t max_props) {
  nq_objreg *r = calloc(1, sizeof(*r));
  if (r == NULL) {
    return NULL;
  }
  r->kind = kind;
  r->id = id;
  r->group = group;
  r->first = first;
  r->n = n;
  r->timed_out_range = timed_out_range;
  r->descending = descending;
  r->max_props = max_props;
  r->ptr = calloc(n ? n : 1, sizeof(*r->ptr));
  r->len = calloc(n ? n : 1, sizeof(*r->len));
  r->state = calloc(n ? n : 1, 1);
  if (r->ptr == NULL || r->len == NULL || r->state == NULL) {
    nq_objreg_free(r);
    return NULL;
  }
  return r;
}

/* Ask for transparent huge pages on the destinations (madvise(2) MADV_HUGEPAGE), before
 * anything lands: a fresh destination is otherwise faulted in page by page (4 KiB) by the
 * network thread's copy, which measured 35 % of that thread's time on a 32 MiB block
 * (docs/benchmarks.md, "what bounds one connection"). Advice only: each run of adjacent
 * buffers is advised on the 2 MiB-aligned part it covers whole; nothing is mapped, moved or
 * written, and a refusal (no THP, not anonymous memory) changes nothing. */
#define NQ_HUGE_PAGE ((uintptr_t)2 << 20)
static void advise_run(uintptr_t start, uintptr_t end) {
  uintptr_t lo = (start + NQ_HUGE_PAGE - 1) & ~(NQ_HUGE_PAGE - 1);
  uintptr_t hi = end & ~(NQ_HUGE_PAGE - 1);
  if (hi > lo) {
    (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
  }
}

void nq_objreg_advise(const nq_objreg *r) {
  uintptr_t start = 0, end = 0;
  for (size_t i = 0; i < r->n; ++i) {
    uintptr_t p = (uintptr_t)r->ptr[i];
    if (p == 0 || r->len[i] == 0) {
      continue;
    }
    if (p != end) { /* not adjacent to the run so far: advise that run, start another */
      advise_run(start, end);
      start = p;
    }
    end = p + r->len[i];
  }
  advise_run(start, end);
}

void nq_objreg_free(nq_objreg *r) {
  if (r != NULL) {
    free(r->ptr);
    free(r->len);
    free(r->state);
    free(r);
  }
}

/* Where object o goes (binding v1 §8: an object outside the request, or of another length than
 * its destination, is refused; a duplicate is discarded). */
nq_dsp_dest nq_objreg_begin(nq_objreg *r, nq_dsp *p, const nq_dsp_object *o, uint8_t **dest,
                            size_t *slot) {
  char why[160];
  uint64_t i;
  if (o->status != 0 || r->n == 0) {
    return NQ_DEST_DISCARD; /* End of Group / Track: no payload; an empty registration (the
                               parser tests') takes nothing */
  }
  if (o->group != r->group || o->object < r->first || o->object - r->first >= r->n) {
    snprintf(why, sizeof(why), "unexpected object %llu/%llu", (unsigned long long)o->group,
             (unsigned long long)o->object);
    nq_dsp_refuse(p, NQ_MOQT_CANCELLED, why);
    return NQ_DEST_REFUSE;
  }
  i = o->object - r->first;
  if (r->ptr[i] == NULL || r->state[i] != 0) {
    return NQ_DEST_DISCARD;
  }
  if (o->length != r->len[i]) {
    snprintf(why, sizeof(why), "object %llu: payload length %llu != %zu",
             (unsigned long long)o->object, (unsigned long long)o->length, r->len[i]);
    nq_dsp_refuse(p, NQ_MOQT_CANCELLED, why);
    return NQ_DEST_REFUSE;
  }
  r->state[i] = 1;
  *slot = (size_t)i;
  *dest = r->ptr[i];
  return NQ_DEST_WRITE;
}

void nq_objreg_end(nq_objreg *r, size_t slot, const uint8_t *digest) {
  if (slot < r->n) {
    r->state[slot] = digest != NULL ? 2 : 0;
  }
}

static nq_objreg *find_reg(nq_conn *c, nq_dsp_kind kind, uint64_t id) {
  for (nq_objreg *r = c->objregs; r != NULL; r = r->next) {
    if (r->kind == kind && r->id == id) {
      return r;
    }
  }
  return NULL;
}

/* ---- parser callbacks on the network thread ------------------------------------------------ */

static nq_hasher *hasher_of(nq_rx *rx) {
  return &rx->conn->ep->hasher;
}

static void flush_batch(nq_rx *rx) {
  /* Without memory for the job the bytes go unhashed: the digest cannot match, the layer
   * fails its verification (never a wrong layer accepted). */
  if (rx->batchlen > 0) {
    (void)nq_hasher_update(hasher_of(rx), rx->hash, rx->batch, rx->batchlen);
  }
  rx->batch = NULL;
  rx->batchlen = 0;
}

/* The object in progress will not complete here: its hash context is finished, unused. */
static void abandon_hash(nq_rx *rx) {
  nq_objinfo none;
  if (!rx->hashing) {
    return;
  }
  memset(&none, 0, sizeof(none));
  rx->batch = NULL;
  rx->batchlen = 0;
  (void)nq_hasher_finish(hasher_of(rx), rx->hash, 0, 0, -1, &none, NULL, 0);
  rx->hashing = 0;
}

static nq_dsp_dest rx_begin(void *arg, nq_dsp *p, const nq_dsp_object *o, uint8_t **dest) {
  nq_rx *rx = arg;
  nq_dsp_dest d;
  rx->landing = 0;
  if (rx->reg == NULL) {
    return NQ_DEST_DISCARD;
  }
  d = nq_objreg_begin(rx->reg, p, o, dest, &rx->slot);
  if (d == NQ_DEST_WRITE) {
    if (gnutls_hash_init(&rx->hash, GNUTLS_DIG_SHA256) != 0) {
      nq_objreg_end(rx->reg, rx->slot, NULL);
      return NQ_DEST_DISCARD;
    }
    rx->hashing = 1;
    rx->landing = 1;
  }
  return d;
}

/* Bytes of the object landed in its destination: to the hash thread, in batches. */
static void rx_landed(void *arg, const uint8_t *at, size_t n) {
  nq_rx *rx = arg;
  if (!rx->hashing) {
    return;
  }
  if (rx->batchlen > 0 && rx->batch + rx->batchlen != at) {
    flush_batch(rx);
  }
  if (rx->batchlen == 0) {
    rx->batch = at;
  }
  rx->batchlen += n;
  if (rx->batchlen >= NQ_HASH_BATCH) {
    flush_batch(rx);
  }
}

void nq_objinfo_of(const nq_dsp_object *o, uint64_t reg, nq_objinfo *info) {
  memset(info, 0, sizeof(*info));
  info->reg = reg;
  info->group = o->group;
  info->subgroup = o->subgroup;
  info->has_subgroup = o->has_subgroup;
  info->object = o->object;
  info->length = o->length;
  info->has_priority = o->has_priority;
  info->priority = o->priority;
  info->status = o->status;
}

static void rx_end(void *arg, const nq_dsp_object *o, const uint8_t *digest) {
  nq_rx *rx = arg;
  nq_objinfo info;
  (void)digest; /* always NULL: the hash thread computes it */
  if (rx->landing && rx->reg != NULL) {
    /* Landed: the hash thread finishes its digest and queues its OBJECT event. */
    nq_objreg_end(rx->reg, rx->slot, (const uint8_t *)"");
    flush_batch(rx);
    nq_objinfo_of(o, rx->reg_handle, &info);
    rx->hashing = 0;
    rx->landing = 0;
    if (nq_hasher_finish(hasher_of(rx), rx->hash, 1, rx->conn->handle, rx->stream->id, &info,
                         o->props, o->propslen) != 0) {
      nq_dsp_refuse(&rx->dsp, NQ_MOQT_EXCESSIVE_LOAD, "out of memory");
    }
    return;
  }
  rx->landing = 0;
  if (rx->reg == NULL) {
    return; /* Python forgot the request: nobody to tell */
  }
  nq_objinfo_of(o, rx->reg_handle, &info);
  if (nq_emit_object(rx->conn, rx->stream->id, &info, o->props, o->propslen) != 0) {
    nq_dsp_refuse(&rx->dsp, NQ_MOQT_EXCESSIVE_LOAD, "event queue full");
  }
}

static const nq_dsp_cbs RX_CBS = {NULL, rx_begin, rx_end, NULL, rx_landed};

/* ---- the stream hook ------------------------------------------------------------------------ */

static void credit(nq_conn *c, int64_t stream_id, size_t n) {
  if (n == 0) {
    return;
  }
  (void)ngtcp2_conn_extend_max_stream_offset(c->qc, stream_id, n);
  ngtcp2_conn_extend_max_offset(c->qc, n);
  c->want_write = 1;
}

static void rx_free(nq_stream *s) {
  if (s->rx != NULL) {
    abandon_hash(s->rx);
    nq_dsp_free(&s->rx->dsp);
    free(s->rx);
    s->rx = NULL;
  }
}

/* The parse of a registered stream ended (result != MORE): tell Python, stop the stream when
 * we refuse the rest of it (STOP_SENDING, RFC 9000 §3.5), forget the parser. */
static int rx_finish(nq_conn *c, nq_stream *s, nq_dsp_result result) {
  nq_rx *rx = s->rx;
  int rv = 0;
  if (result == NQ_DSP_LIMIT || result == NQ_DSP_REFUSED) {
    (void)ngtcp2_conn_shutdown_stream_read(c->qc, s->id, rx->dsp.err_code);
    c->want_write = 1;
  }
  abandon_hash(rx); /* an object cut short by a refusal or a violation */
  if (rx->reg != NULL) { /* after the stream's objects: through the hash thread's queue */
    rv = nq_hasher_end(hasher_of(rx), c->handle, s->id, rx->reg_handle, (uint8_t)result,
                       rx->dsp.err_code, result == NQ_DSP_FIN ? "" : rx->dsp.reason);
  }
  s->native_done = 1;
  rx_free(s);
  return rv;
}

static int rx_feed(nq_conn *c, nq_stream *s, const uint8_t *data, size_t len, int fin) {
  nq_dsp_result r = nq_dsp_feed(&s->rx->dsp, data, len, fin);
  return r == NQ_DSP_MORE ? 0 : rx_finish(c, s, r);
}

/* Bytes Python should get (a stream that is not a registered data stream): what was held,
 * then these. */
static int to_python(nq_stream *s, const uint8_t *data, size_t len, int fin) {
  s->routed = 1;
  if (s->peeklen > 0) {
    uint8_t held = s->peeklen;
    s->peeklen = 0;
    if (nq_emit_stream_data(s, s->peek, held, fin && len == 0) != 0) {
      return -1;
    }
    if (len == 0) {
      return 0;
    }
  }
  return nq_emit_stream_data(s, data, len, fin);
}

/* A registered data stream begins: its parser. */
static int rx_start(nq_conn *c, nq_stream *s, nq_objreg *reg, nq_dsp_kind kind) {
  s->rx = calloc(1, sizeof(*s->rx));
  if (s->rx == NULL) {
    return -1;
  }
  s->rx->conn = c;
  s->rx->stream = s;
  s->rx->reg = reg;
  s->rx->reg_handle = reg->handle;
  nq_dsp_init(&s->rx->dsp, kind, reg->timed_out_range, reg->descending, reg->max_props, &RX_CBS,
              s->rx);
  return 0;
}

/* ---- parked SUBGROUP streams ---------------------------------------------------------------- */

/* The publisher chooses a subscription's Track Alias (SUBSCRIBE_OK), so Python can register its
 * destinations only once the answer is in; the publisher may open the subscription's SUBGROUP
 * stream right behind it, and its first bytes may arrive first. While Python has announced
 * SUBSCRIBEs whose answers are not settled (nq_api_subscriptions_pending), a SUBGROUP stream
 * of an unregistered alias is parked here instead of going to Python: its bytes are kept,
 * uncredited (the stream's flow-control window bounds them, RFC 9000 §4.1), until a
 * registration names its alias (then it is parsed into the destinations) or no SUBSCRIBE is
 * pending any more (then it goes to Python, unchanged, as any unregistered stream). */
#define NQ_PARK_CHUNK 16384

static int park(nq_stream *s, uint64_t alias, const uint8_t *data, size_t len, int fin) {
  s->parked = 1;
  s->parked_alias = alias;
  if (nq_bytes_append(&s->parked_data, s->peek, s->peeklen, NQ_PARK_CHUNK) != 0) {
    return -1;
  }
  s->peeklen = 0;
  s->parked_fin = fin != 0;
  return len == 0 ? 0 : nq_bytes_append(&s->parked_data, data, len, NQ_PARK_CHUNK);
}

/* The parked stream's bytes go to their registration (reg) or to Python (NULL). */
static int unpark(nq_conn *c, nq_stream *s, nq_objreg *reg) {
  nq_bytes held = s->parked_data;
  int fin = s->parked_fin, rv = 0;
  memset(&s->parked_data, 0, sizeof(s->parked_data));
  s->parked = 0;
  s->parked_fin = 0;
  if (reg == NULL) {
    s->routed = 1;
    s->seen = 1;
    for (const nq_chunk *ch = held.head; ch != NULL && rv == 0; ch = ch->next) {
      rv = nq_emit_stream_data(s, ch->data, ch->len, fin && ch->next == NULL);
    }
  } else if (rx_start(c, s, reg, NQ_DSP_SUBGROUP) != 0) {
    rv = -1;
  } else {
    credit(c, s->id, (size_t)held.len);
    for (const nq_chunk *ch = held.head; ch != NULL && s->rx != NULL && rv == 0; ch = ch->next) {
      rv = rx_feed(c, s, ch->data, ch->len, fin && ch->next == NULL);
    }
  }
  nq_bytes_clear(&held);
  return rv;
}

/* Settle the parked streams after a registration or an answered SUBSCRIBE. */
static void unpark_all(nq_conn *c) {
  for (size_t i = 0; i < c->streams.cap; ++i) {
    nq_stream *s = c->streams.vals[i];
    nq_objreg *reg;
    if (s == NULL || !s->parked) {
      continue;
    }
    reg = find_reg(c, NQ_DSP_SUBGROUP, s->parked_alias);
    if (reg == NULL && c->subs_pending > 0) {
      continue;
    }
    if (unpark(c, s, reg) != 0) {
      nq_conn_request_close(c, NGTCP2_INTERNAL_ERROR, 0, (const uint8_t *)"out of memory", 13);
      return;
    }
  }
}

/* RESET_STREAM on a parked stream: what was parked goes to Python first, then the reset. */
int nq_objects_parked_reset(nq_conn *c, nq_stream *s) {
  return s->parked ? unpark(c, s, NULL) : 0;
}

/* Received stream bytes (nq_cb_recv_stream_data): 1 taken here, 0 for Python as they are
 * (nothing held), -1 failure. */
int nq_objects_recv(nq_conn *c, nq_stream *s, const uint8_t *data, size_t len, int fin) {
  nq_dsp_kind kind = NQ_DSP_ANY;
  uint64_t id = 0;
  nq_objreg *reg = NULL;
  size_t take;
  int known;
  if (s->native_done) {
    credit(c, s->id, len); /* the rest of a stream we stopped parsing: dropped */
    return 1;
  }
  if (s->rx != NULL) {
    credit(c, s->id, len);
    return rx_feed(c, s, data, len, fin) == 0 ? 1 : -1;
  }
  if (s->parked) {
    s->parked_fin = fin != 0;
    return nq_bytes_append(&s->parked_data, data, len, NQ_PARK_CHUNK) == 0 ? 1 : -1;
  }
  if (s->routed) {
    return 0;
  }
  if (ngtcp2_is_bidi_stream(s->id) || ngtcp2_conn_is_local_stream(c->qc, s->id) ||
      (c->objregs == NULL && c->subs_pending == 0 && s->peeklen == 0)) {
    s->routed = 1;
    return 0;
  }
  take = sizeof(s->peek) - s->peeklen;
  if (take > len) {
    take = len;
  }
  memcpy(s->peek + s->peeklen, data, take);
  s->peeklen = (uint8_t)(s->peeklen + take);
  known = nq_dsp_peek(s->peek, s->peeklen, &kind, &id);
  if (!known && s->peeklen < sizeof(s->peek) && !fin) {
    return 1; /* held until the type and ID are complete */
  }
  if (known && kind != NQ_DSP_ANY) {
    reg = find_reg(c, kind, id);
  }
  if (reg == NULL && known && kind == NQ_DSP_SUBGROUP && c->subs_pending > 0) {
    return park(s, id, data + take, len - take, fin) == 0 ? 1 : -1;
  }
  if (reg == NULL) {
    s->seen = 1;
    return to_python(s, data + take, len - take, fin) == 0 ? 1 : -1;
  }
  if (rx_start(c, s, reg, kind) != 0) {
    return -1;
  }
  credit(c, s->id, s->peeklen + (len - take));
  {
    uint8_t held = s->peeklen;
    s->peeklen = 0;
    if (rx_feed(c, s, s->peek, held, fin && len == take) != 0) {
      return -1;
    }
  }
  if (s->rx != NULL && len > take) {
    return rx_feed(c, s, data + take, len - take, fin) == 0 ? 1 : -1;
  }
  return 1;
}

/* RESET_STREAM on a registered data stream: the objects in flight are lost. */
void nq_objects_reset(nq_conn *c, nq_stream *s, uint64_t code) {
  nq_rx *rx = s->rx;
  if (rx == NULL) {
    return;
  }
  if (rx->landing && rx->reg != NULL) {
    nq_objreg_end(rx->reg, rx->slot, NULL);
  }
  abandon_hash(rx);
  if (rx->reg != NULL) {
    (void)nq_hasher_end(hasher_of(rx), c->handle, s->id, rx->reg_handle, NQ_OBJ_RESET, code,
                        "stream reset");
  }
  s->native_done = 1;
  rx_free(s);
}

void nq_objects_stream_free(nq_stream *s) {
  rx_free(s);
  nq_bytes_clear(&s->parked_data);
}

void nq_objects_free_conn(nq_conn *c) {
  while (c->objregs != NULL) {
    nq_objreg *r = c->objregs;
    c->objregs = r->next;
    nq_objreg_free(r);
  }
}

/* ---- the operations Python calls (under the lock) ----------------------------------------- */

int nq_api_objects_register(nq_endpoint *ep, uint64_t conn, nq_objreg *r) {
  nq_conn *c = nq_endpoint_conn(ep, conn);
  if (c == NULL || !nq_conn_usable(c)) {
    return NQ_ENOCONN;
  }
  if (find_reg(c, r->kind, r->id) != NULL) {
    return NQ_ESTATE;
  }
  if (nq_hasher_start(ep) != 0) {
    return NQ_ENOMEM;
  }
  r->handle = ++ep->next_objreg;
  r->next = c->objregs;
  c->objregs = r;
  if (r->kind == NQ_DSP_SUBGROUP) {
    unpark_all(c); /* a stream of its alias may be parked */
  }
  return NQ_OK;
}

/* Python announces a SUBSCRIBE (delta 1) before it leaves, and settles it (-1) once its answer
 * is dispatched and any registration made (or it failed): SUBGROUP streams of unknown aliases
 * are parked meanwhile (above). */
int nq_api_subscriptions_pending(nq_endpoint *ep, uint64_t conn, int delta) {
  nq_conn *c = nq_endpoint_conn(ep, conn);
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  if (delta > 0) {
    ++c->subs_pending;
  } else if (c->subs_pending > 0) {
    --c->subs_pending;
    unpark_all(c);
    c->want_write = 1; /* credit for what was parked and is now parsed */
  }
  return NQ_OK;
}

/* Forget a registration: the network thread writes into its buffers no more once this returns
 * (it holds the lock while it parses); the hash thread may still read them until
 * nq_hasher_drain, which the caller runs next, without the lock. Streams still landing into it
 * are stopped (CANCELLED). */
int nq_api_objects_unregister(nq_endpoint *ep, uint64_t conn, uint64_t handle) {
  nq_conn *c = nq_endpoint_conn(ep, conn);
  nq_objreg **at;
  nq_objreg *r = NULL;
  if (c == NULL) {
    return NQ_ENOCONN;
  }
  for (at = &c->objregs; *at != NULL; at = &(*at)->next) {
    if ((*at)->handle == handle) {
      r = *at;
      *at = r->next;
      break;
    }
  }
  if (r == NULL) {
    return NQ_EINVAL;
  }
  for (size_t i = 0; i < c->streams.cap; ++i) {
    nq_stream *s = c->streams.vals[i];
    if (s != NULL && s->rx != NULL && s->rx->reg == r) {
      nq_dsp_drop_dest(&s->rx->dsp);
      abandon_hash(s->rx);
      s->rx->reg = NULL;
      s->rx->landing = 0;
      if (nq_conn_usable(c)) {
        (void)ngtcp2_conn_shutdown_stream_read(c->qc, s->id, NQ_MOQT_CANCELLED);
        c->want_write = 1;
      }
    }
  }
  nq_objreg_free(r);
  return NQ_OK;
}
