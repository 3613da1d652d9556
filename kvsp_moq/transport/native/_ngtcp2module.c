/*
 * kvsp_moq.transport.native._ngtcp2: the Python face of the native QUIC data plane (nq.h).
 *
 * Endpoint wraps one nq_endpoint. Methods take the endpoint lock (without the GIL when they
 * have to wait for it), call nq_api.c and wake the network thread; events() detaches the C
 * event queue and turns it into tuples under the GIL. The network thread never runs Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <netdb.h>
#include <stdlib.h>
#include <string.h>

#include "_ngtcp2objects.h"
#include "nq.h"

#define NQ_VARINT_MAX ((1ULL << 62) - 1) /* RFC 9000 §16 */
#define NQ_STOP_TIMEOUT_MS 5000

static const char *const EVENT_NAMES[] = {
    "established", "stream", "reset", "stop_sending", "datagram", "acked", "stream_limit",
    "closed", "pong", "object", "objects_end",
};
#define NQ_NEVENTS (sizeof(EVENT_NAMES) / sizeof(EVENT_NAMES[0]))

static const char *const CC_NAMES[] = {"reno", "cubic", "bbr", "bbr2"};
static const ngtcp2_cc_algo CC_ALGOS[] = {NGTCP2_CC_ALGO_RENO, NGTCP2_CC_ALGO_CUBIC,
                                          NGTCP2_CC_ALGO_BBR, NGTCP2_CC_ALGO_BBR2};

typedef struct {
  PyObject *endpoint_type;
  PyObject *event_names[NQ_NEVENTS]; /* interned */
} module_state;

/* The buffers of one object registration (Endpoint.receive_objects). */
typedef struct pyreg {
  struct pyreg *next;
  uint64_t conn, handle;
  nqpy_dests dests;
} pyreg;

typedef struct {
  PyObject_HEAD
  nq_endpoint *ep;
  pyreg *regs;      /* registrations whose buffers the network thread may write into */
  int closing;      /* close() began: every method refuses */
  int inflight;     /* methods waiting for the lock without the GIL */
  int free_pending; /* close() is done but a waiting method still holds ep: it frees it */
} EndpointObject;

/* ---- argument conversion -------------------------------------------------------------- */

/* A QUIC variable-length integer (error codes, stream IDs, handles): 0 .. 2^62 - 1. */
static int conv_varint(PyObject *o, void *out) {
  unsigned long long v;
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "an int is required, not %.100s", Py_TYPE(o)->tp_name);
    return 0;
  }
  v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    return 0;
  }
  if (v > NQ_VARINT_MAX) {
    PyErr_SetString(PyExc_OverflowError, "value exceeds 2**62 - 1");
    return 0;
  }
  *(uint64_t *)out = v;
  return 1;
}

static PyObject *raise_nq(int rv, uint64_t conn, int64_t stream_id) {
  switch (rv) {
  case NQ_ENOCONN:
    return PyErr_Format(PyExc_ConnectionError, "connection %llu is closed or unknown",
                        (unsigned long long)conn);
  case NQ_ENOSTREAM:
    return PyErr_Format(PyExc_ValueError, "stream %lld is closed or unknown",
                        (long long)stream_id);
  case NQ_EBLOCKED:
    return PyErr_Format(PyExc_BlockingIOError, "connection %llu: limit reached (retry after "
                        "a stream_limit event)", (unsigned long long)conn);
  case NQ_ESTATE:
    return PyErr_Format(PyExc_ValueError, "stream %lld does not allow this in its state",
                        (long long)stream_id);
  case NQ_ENODGRAM:
    return PyErr_SetString(PyExc_ValueError, "the peer did not offer DATAGRAM"), NULL;
  case NQ_ETOOBIG:
    return PyErr_SetString(PyExc_ValueError, "datagram larger than max_datagram_payload"),
           NULL;
  case NQ_ENOMEM:
    return PyErr_NoMemory();
  default:
    return PyErr_SetString(PyExc_ValueError, "invalid argument"), NULL;
  }
}

/* ---- the lock ------------------------------------------------------------------------ */

static int refuse_closed(void) {
  PyErr_SetString(PyExc_ValueError, "endpoint is closed");
  return -1;
}

static void free_if_last(EndpointObject *self) {
  if (self->free_pending && self->inflight == 0) {
    nq_endpoint_free(self->ep);
    self->ep = NULL;
    self->free_pending = 0;
  }
}

/* Take the endpoint lock; without the GIL if it has to be waited for. */
static int ep_enter(EndpointObject *self) {
  nq_endpoint *ep = self->ep;
  if (ep == NULL || self->closing) {
    return refuse_closed();
  }
  if (nq_endpoint_trylock(ep)) {
    return 0;
  }
  ++self->inflight;
  Py_BEGIN_ALLOW_THREADS
  nq_endpoint_lock(ep);
  Py_END_ALLOW_THREADS
  --self->inflight;
  if (self->closing) {
    nq_endpoint_unlock(ep);
    free_if_last(self);
    return refuse_closed();
  }
  return 0;
}

/* Release the lock after a change: the network thread has work. */
static void ep_leave_wake(EndpointObject *self) {
  nq_endpoint_wake(self->ep);
  nq_endpoint_unlock(self->ep);
}

/* Release the buffers of held chunks ngtcp2 is done with (nq_release_held); needs the GIL. */
static void release_held(nq_chunk *c) {
  while (c != NULL) {
    nq_chunk *next = c->next;
    if (c->hold != NULL) {
      PyBuffer_Release((Py_buffer *)c->hold);
      PyMem_RawFree(c->hold);
    }
    free(c);
    c = next;
  }
}

/* ---- conversions to Python ---------------------------------------------------------------- */

static PyObject *bytes_from(const nq_bytes *b) {
  PyObject *o = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)b->len);
  uint8_t *dest;
  if (o == NULL) {
    return NULL;
  }
  dest = (uint8_t *)PyBytes_AS_STRING(o);
  if (b->len >= (1u << 20)) {
    Py_BEGIN_ALLOW_THREADS
    nq_bytes_copy_out(b, dest);
    Py_END_ALLOW_THREADS
  } else {
    nq_bytes_copy_out(b, dest);
  }
  return o;
}

static PyObject *text_from(const nq_bytes *b) {
  PyObject *raw = bytes_from(b);
  PyObject *text;
  if (raw == NULL) {
    return NULL;
  }
  text = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), "replace");
  Py_DECREF(raw);
  return text;
}

static PyObject *address_tuple(const struct sockaddr *sa, socklen_t len) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(sa, len, host, sizeof(host), serv, sizeof(serv),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return Py_BuildValue("(si)", "", 0);
  }
  return Py_BuildValue("(si)", host, atoi(serv));
}

static PyObject *event_tuple(module_state *st, const nq_event *ev) {
  PyObject *name = st->event_names[ev->type];
  unsigned long long conn = ev->conn;
  long long sid = ev->stream_id;
  switch (ev->type) {
  case NQ_EV_ESTABLISHED:
    return Py_BuildValue("(OKNN)", name, conn, text_from(&ev->data),
                         address_tuple((const struct sockaddr *)&ev->addr, ev->addrlen));
  case NQ_EV_STREAM:
    return Py_BuildValue("(OKLNN)", name, conn, sid, bytes_from(&ev->data),
                         PyBool_FromLong(ev->fin));
  case NQ_EV_RESET:
  case NQ_EV_STOP_SENDING:
    return Py_BuildValue("(OKLK)", name, conn, sid, (unsigned long long)ev->code);
  case NQ_EV_DATAGRAM:
    return Py_BuildValue("(OKN)", name, conn, bytes_from(&ev->data));
  case NQ_EV_ACKED:
    return Py_BuildValue("(OKLK)", name, conn, sid, (unsigned long long)ev->buffered);
  case NQ_EV_STREAM_LIMIT:
    return Py_BuildValue("(OK)", name, conn);
  case NQ_EV_CLOSED:
    return Py_BuildValue("(OKKNNN)", name, conn, (unsigned long long)ev->code,
                         text_from(&ev->data), PyBool_FromLong(ev->app),
                         PyBool_FromLong(ev->by_peer));
  case NQ_EV_PONG:
    return Py_BuildValue("(OKK)", name, conn, (unsigned long long)ev->code);
  case NQ_EV_OBJECT:
    return nqpy_object_event(name, conn, sid, &ev->obj, bytes_from(&ev->data));
  case NQ_EV_OBJECTS_END:
    return Py_BuildValue("(OKKLsKN)", name, conn, (unsigned long long)ev->obj.reg, sid,
                         nqpy_result_name(ev->obj.result), (unsigned long long)ev->code,
                         text_from(&ev->data));
  }
  PyErr_SetString(PyExc_SystemError, "unknown event");
  return NULL;
}

static PyObject *event_list(module_state *st, const nq_event *head) {
  PyObject *out = PyList_New(0);
  if (out == NULL) {
    return NULL;
  }
  for (const nq_event *ev = head; ev != NULL; ev = ev->next) {
    PyObject *t = event_tuple(st, ev);
    if (t == NULL || PyList_Append(out, t) != 0) {
      Py_XDECREF(t);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(t);
  }
  return out;
}

/* ---- Endpoint ------------------------------------------------------------------------------ */

static int parse_cc(const char *name, ngtcp2_cc_algo *out) {
  for (size_t i = 0; i < sizeof(CC_NAMES) / sizeof(CC_NAMES[0]); ++i) {
    if (strcmp(name, CC_NAMES[i]) == 0) {
      *out = CC_ALGOS[i];
      return 0;
    }
  }
  PyErr_Format(PyExc_ValueError, "unknown congestion controller '%s' (reno, cubic, bbr, bbr2)",
               name);
  return -1;
}

/* alpns: a non-empty list of str; the UTF-8 pointers live as long as the list. */
static const char **parse_alpns(PyObject *alpns, size_t *n) {
  const char **out;
  Py_ssize_t len;
  if (alpns == NULL || !PyList_Check(alpns) || (len = PyList_GET_SIZE(alpns)) == 0) {
    PyErr_SetString(PyExc_TypeError, "alpns must be a non-empty list of str");
    return NULL;
  }
  out = PyMem_Calloc((size_t)len, sizeof(*out));
  if (out == NULL) {
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < len; ++i) {
    PyObject *item = PyList_GET_ITEM(alpns, i);
    if (!PyUnicode_Check(item) || (out[i] = PyUnicode_AsUTF8(item)) == NULL) {
      PyMem_Free(out);
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "alpns must be a non-empty list of str");
      }
      return NULL;
    }
  }
  *n = (size_t)len;
  return out;
}

/* The numbers of the configuration: each in range or a ValueError naming it. */
static int check_range(const char *name, long long v, long long lo, long long hi) {
  if (v < lo || v > hi) {
    PyErr_Format(PyExc_ValueError, "%s must be in %lld..%lld (got %lld)", name, lo, hi, v);
    return -1;
  }
  return 0;
}

static int check_config(long long port, long long udp, long long idle, long long data,
                        long long stream_data, long long bidi, long long uni, long long dgram,
                        long long maxconn) {
  long long varint = (long long)NQ_VARINT_MAX;
  if (data < 0 || stream_data < 0 || bidi < 0 || uni < 0) {
    PyErr_SetString(PyExc_TypeError, "initial_max_data, initial_max_stream_data, "
                    "initial_max_streams_bidi and initial_max_streams_uni are required");
    return -1;
  }
  return check_range("port", port, 0, 65535) || check_range("max_udp_payload", udp, 1200, 65527) ||
                 check_range("idle_timeout_ms", idle, 0, 1LL << 40) ||
                 check_range("initial_max_data", data, 0, varint) ||
                 check_range("initial_max_stream_data", stream_data, 0, varint) ||
                 check_range("initial_max_streams_bidi", bidi, 0, 1LL << 60) ||
                 check_range("initial_max_streams_uni", uni, 0, 1LL << 60) ||
                 check_range("max_datagram_frame_size", dgram, 0, 65535) ||
                 check_range("max_connections", maxconn, 1, 1 << 20)
             ? -1
             : 0;
}

static PyObject *Endpoint_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"server", "host", "port", "alpns", "cert_file", "key_file",
                           "ca_file", "verify", "cc", "max_udp_payload", "idle_timeout_ms",
                           "initial_max_data", "initial_max_stream_data",
                           "initial_max_streams_bidi", "initial_max_streams_uni",
                           "max_datagram_frame_size", "gso", "gro", "max_connections",
                           "reuse_port", NULL};
  int server, verify = 1, gso = 1, gro = 1, reuse_port = 0;
  const char *host, *cert = NULL, *key = NULL, *ca = NULL, *cc = "bbr";
  long long port, udp = 1452, idle = 30000, data = -1, sdata = -1, bidi = -1, uni = -1;
  long long dgram = 65535, maxconn = 1024;
  PyObject *alpns = NULL;
  const char **alpnv;
  size_t nalpns = 0;
  nq_config cfg;
  char err[256] = "";
  EndpointObject *self;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "psL|$OzzzpsLLLLLLLppLp", kwlist, &server, &host,
                                   &port, &alpns, &cert, &key, &ca, &verify, &cc, &udp, &idle,
                                   &data, &sdata, &bidi, &uni, &dgram, &gso, &gro, &maxconn,
                                   &reuse_port) ||
      check_config(port, udp, idle, data, sdata, bidi, uni, dgram, maxconn) != 0) {
    return NULL;
  }
  memset(&cfg, 0, sizeof(cfg));
  if (parse_cc(cc, &cfg.cc) != 0 || (alpnv = parse_alpns(alpns, &nalpns)) == NULL) {
    return NULL;
  }
  cfg.server = server;
  cfg.max_udp_payload = (size_t)udp;
  cfg.idle_timeout_ms = (uint64_t)idle;
  cfg.initial_max_data = (uint64_t)data;
  cfg.initial_max_stream_data = (uint64_t)sdata;
  cfg.initial_max_streams_bidi = (uint64_t)bidi;
  cfg.initial_max_streams_uni = (uint64_t)uni;
  cfg.max_datagram_frame_size = (uint64_t)dgram;
  cfg.max_connections = (size_t)maxconn;
  cfg.reuse_port = reuse_port;
  cfg.log = getenv("KVSP_NQ_LOG") != NULL;
  self = (EndpointObject *)type->tp_alloc(type, 0);
  if (self == NULL) {
    PyMem_Free(alpnv);
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  self->ep = nq_endpoint_new(&cfg, host, (int)port, alpnv, nalpns, cert, key, ca, verify, gso,
                             gro, err, sizeof(err));
  Py_END_ALLOW_THREADS
  PyMem_Free(alpnv);
  if (self->ep == NULL) {
    Py_DECREF(self);
    return PyErr_Format(PyExc_OSError, "cannot create the endpoint: %s", err);
  }
  return (PyObject *)self;
}

static PyObject *Endpoint_close(EndpointObject *self, PyObject *Py_UNUSED(ignored)) {
  nq_endpoint *ep = self->ep;
  int rv;
  if (ep == NULL || self->closing) {
    Py_RETURN_NONE;
  }
  self->closing = 1;
  Py_BEGIN_ALLOW_THREADS
  rv = nq_endpoint_stop(ep, NQ_STOP_TIMEOUT_MS);
  Py_END_ALLOW_THREADS
  if (rv != 0) {
    /* The thread is still running: its memory cannot be freed (a bounded leak). */
    self->ep = NULL;
    return PyErr_WarnEx(PyExc_RuntimeWarning, "native QUIC network thread did not stop", 1)
               ? NULL
               : Py_NewRef(Py_None);
  }
  /* The thread closed every connection: every held send buffer is released now. */
  release_held(nq_released_detach(ep));
  self->free_pending = 1;
  free_if_last(self);
  /* The network thread is gone: nothing writes into the registered buffers any more. */
  while (self->regs != NULL) {
    pyreg *r = self->regs;
    self->regs = r->next;
    nqpy_dests_release(&r->dests);
    PyMem_Free(r);
  }
  Py_RETURN_NONE;
}

static void Endpoint_dealloc(EndpointObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject *rv;
  PyObject *exc_type, *exc_value, *exc_tb;
  PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
  rv = Endpoint_close(self, NULL);
  if (rv == NULL) {
    PyErr_WriteUnraisable((PyObject *)self);
  }
  Py_XDECREF(rv);
  PyErr_Restore(exc_type, exc_value, exc_tb);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

static PyObject *Endpoint_fileno(EndpointObject *self, PyObject *Py_UNUSED(ignored)) {
  if (self->ep == NULL || self->closing) {
    return refuse_closed(), NULL;
  }
  return PyLong_FromLong(self->ep->event_fd);
}

static PyObject *Endpoint_local_address(EndpointObject *self, PyObject *Py_UNUSED(ignored)) {
  if (self->ep == NULL || self->closing) {
    return refuse_closed(), NULL;
  }
  return address_tuple((const struct sockaddr *)&self->ep->udp.local, self->ep->udp.locallen);
}

/* Drain the events; the stream bytes handed over become the peer's flow-control credit, and
 * the held send buffers ngtcp2 is done with are released. */
static PyObject *Endpoint_events(EndpointObject *self, PyObject *Py_UNUSED(ignored)) {
  module_state *st = PyType_GetModuleState(Py_TYPE(self));
  nq_event *head;
  nq_chunk *held;
  PyObject *out, *exc_type, *exc_value, *exc_tb;
  if (ep_enter(self) < 0) {
    return NULL;
  }
  head = nq_events_detach(self->ep);
  held = nq_released_detach(self->ep);
  nq_endpoint_unlock(self->ep);
  release_held(held);
  out = event_list(st, head);
  PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
  if (ep_enter(self) == 0) {
    nq_api_credit(self->ep, head);
    ep_leave_wake(self);
  } else {
    PyErr_Clear(); /* closed meanwhile: nothing to credit */
  }
  PyErr_Restore(exc_type, exc_value, exc_tb);
  nq_events_free_list(head);
  return out;
}

static PyObject *Endpoint_connect(EndpointObject *self, PyObject *args) {
  const char *host, *server_name;
  int port, rv, gai;
  struct addrinfo hints, *res = NULL;
  char portstr[16], err[256] = "";
  uint64_t handle = 0;
  if (!PyArg_ParseTuple(args, "sis", &host, &port, &server_name)) {
    return NULL;
  }
  if (self->ep == NULL || self->closing) {
    return refuse_closed(), NULL;
  }
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = self->ep->udp.local.ss_family;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  snprintf(portstr, sizeof(portstr), "%d", port);
  Py_BEGIN_ALLOW_THREADS
  gai = getaddrinfo(host, portstr, &hints, &res);
  Py_END_ALLOW_THREADS
  if (gai != 0) {
    return PyErr_Format(PyExc_OSError, "cannot resolve %s: %s", host, gai_strerror(gai));
  }
  if (ep_enter(self) < 0) {
    freeaddrinfo(res);
    return NULL;
  }
  rv = nq_api_connect(self->ep, res->ai_addr, res->ai_addrlen, server_name, &handle, err,
                      sizeof(err));
  ep_leave_wake(self);
  freeaddrinfo(res);
  if (rv == NQ_EINVAL) {
    return PyErr_Format(PyExc_ValueError, "a server endpoint does not connect");
  }
  if (rv != NQ_OK) {
    return err[0] ? PyErr_Format(PyExc_OSError, "%s", err) : raise_nq(rv, 0, -1);
  }
  return PyLong_FromUnsignedLongLong(handle);
}

static PyObject *Endpoint_open_stream(EndpointObject *self, PyObject *args) {
  uint64_t conn;
  int uni, rv;
  int64_t sid = -1;
  if (!PyArg_ParseTuple(args, "O&p", conv_varint, &conn, &uni) || ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_open_stream(self->ep, conn, uni, &sid);
  ep_leave_wake(self);
  return rv == NQ_OK ? PyLong_FromLongLong(sid) : raise_nq(rv, conn, -1);
}

/* A chunk for a large send: a copy of buf made without the lock and without the GIL, or with
 * hold a held chunk, pointing into the exporter's memory, which a Py_buffer of its own keeps
 * alive (and unresizable) until ngtcp2 is done with the bytes (zero-copy send). */
static nq_chunk *send_chunk(PyObject *data, const Py_buffer *buf, int hold) {
  nq_chunk *chunk;
  Py_buffer *held;
  if (!hold) {
    chunk = nq_chunk_new((size_t)buf->len);
    if (chunk == NULL) {
      return (nq_chunk *)PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    memcpy(chunk->data, buf->buf, (size_t)buf->len);
    Py_END_ALLOW_THREADS
    chunk->len = (size_t)buf->len;
    return chunk;
  }
  held = PyMem_RawMalloc(sizeof(*held));
  chunk = nq_chunk_new(0);
  if (held == NULL || chunk == NULL) {
    PyMem_RawFree(held);
    free(chunk);
    return (nq_chunk *)PyErr_NoMemory();
  }
  if (PyObject_GetBuffer(data, held, PyBUF_SIMPLE) != 0) {
    PyMem_RawFree(held);
    free(chunk);
    return NULL;
  }
  chunk->ext = held->buf;
  chunk->len = (size_t)held->len;
  chunk->hold = held;
  return chunk;
}

/* send(conn, stream_id, data, fin=False, *, hold=False). Sends of NQ_HOLD_MIN bytes or more
 * with hold are not copied: see send_chunk. */
#define NQ_HOLD_MIN 4096
static PyObject *Endpoint_send(EndpointObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"conn", "stream_id", "data", "fin", "hold", NULL};
  uint64_t conn, sid;
  Py_buffer buf;
  int fin = 0, hold = 0, rv;
  nq_chunk *chunk = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&y*|p$p", kwlist, conv_varint, &conn,
                                   conv_varint, &sid, &buf, &fin, &hold)) {
    return NULL;
  }
  hold = hold && buf.len >= NQ_HOLD_MIN && buf.obj != NULL;
  if (buf.len >= NQ_TX_CHUNK || hold) {
    chunk = send_chunk(buf.obj, &buf, hold);
    if (chunk == NULL) {
      PyBuffer_Release(&buf);
      return NULL;
    }
  }
  if (ep_enter(self) < 0) {
    release_held(chunk);
    PyBuffer_Release(&buf);
    return NULL;
  }
  rv = nq_api_send(self->ep, conn, (int64_t)sid, buf.buf, (size_t)buf.len, &chunk, fin);
  ep_leave_wake(self);
  release_held(chunk); /* not queued (an error, or a stream the peer stopped) */
  PyBuffer_Release(&buf);
  if (rv != NQ_OK) {
    return raise_nq(rv, conn, (int64_t)sid);
  }
  Py_RETURN_NONE;
}

static PyObject *Endpoint_buffered(EndpointObject *self, PyObject *args) {
  uint64_t conn, sid, n = 0;
  int rv;
  if (!PyArg_ParseTuple(args, "O&O&", conv_varint, &conn, conv_varint, &sid) ||
      ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_buffered(self->ep, conn, (int64_t)sid, &n);
  nq_endpoint_unlock(self->ep);
  return rv == NQ_OK ? PyLong_FromUnsignedLongLong(n) : raise_nq(rv, conn, (int64_t)sid);
}

/* watch_acked(conn, stream_id, threshold) -> buffered: signal the event fd once the stream's
 * buffered count falls to threshold (nq_api_watch_acked); returns the count now. */
static PyObject *Endpoint_watch_acked(EndpointObject *self, PyObject *args) {
  uint64_t conn, sid, threshold, n = 0;
  int rv;
  if (!PyArg_ParseTuple(args, "O&O&K", conv_varint, &conn, conv_varint, &sid, &threshold) ||
      ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_watch_acked(self->ep, conn, (int64_t)sid, threshold, &n);
  nq_endpoint_unlock(self->ep);
  return rv == NQ_OK ? PyLong_FromUnsignedLongLong(n) : raise_nq(rv, conn, (int64_t)sid);
}

/* reset_stream and stop_sending: (conn, stream_id, code). */
static PyObject *stream_code_call(EndpointObject *self, PyObject *args,
                                  int (*op)(nq_endpoint *, uint64_t, int64_t, uint64_t)) {
  uint64_t conn, sid, code;
  int rv;
  if (!PyArg_ParseTuple(args, "O&O&O&", conv_varint, &conn, conv_varint, &sid, conv_varint,
                        &code) ||
      ep_enter(self) < 0) {
    return NULL;
  }
  rv = op(self->ep, conn, (int64_t)sid, code);
  ep_leave_wake(self);
  if (rv != NQ_OK) {
    return raise_nq(rv, conn, (int64_t)sid);
  }
  Py_RETURN_NONE;
}

static PyObject *Endpoint_reset_stream(EndpointObject *self, PyObject *args) {
  return stream_code_call(self, args, nq_api_reset_stream);
}

static PyObject *Endpoint_stop_sending(EndpointObject *self, PyObject *args) {
  return stream_code_call(self, args, nq_api_stop_sending);
}

static PyObject *Endpoint_send_datagram(EndpointObject *self, PyObject *args) {
  uint64_t conn;
  Py_buffer buf;
  int rv;
  if (!PyArg_ParseTuple(args, "O&y*", conv_varint, &conn, &buf)) {
    return NULL;
  }
  if (ep_enter(self) < 0) {
    PyBuffer_Release(&buf);
    return NULL;
  }
  rv = nq_api_send_datagram(self->ep, conn, buf.buf, (size_t)buf.len);
  ep_leave_wake(self);
  PyBuffer_Release(&buf);
  if (rv != NQ_OK) {
    return raise_nq(rv, conn, -1);
  }
  Py_RETURN_NONE;
}

static PyObject *Endpoint_close_connection(EndpointObject *self, PyObject *args,
                                           PyObject *kwds) {
  static char *kwlist[] = {"conn", "code", "reason", "app", NULL};
  uint64_t conn, code;
  Py_buffer reason = {0};
  int app = 1, rv;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&|y*p", kwlist, conv_varint, &conn,
                                   conv_varint, &code, &reason, &app)) {
    return NULL;
  }
  if (ep_enter(self) < 0) {
    PyBuffer_Release(&reason);
    return NULL;
  }
  rv = nq_api_close_connection(self->ep, conn, code, reason.buf, (size_t)reason.len, app);
  ep_leave_wake(self);
  PyBuffer_Release(&reason);
  if (rv != NQ_OK) {
    return raise_nq(rv, conn, -1);
  }
  Py_RETURN_NONE;
}

static PyObject *Endpoint_max_datagram_payload(EndpointObject *self, PyObject *args) {
  uint64_t conn;
  size_t n = 0;
  int rv;
  if (!PyArg_ParseTuple(args, "O&", conv_varint, &conn) || ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_max_datagram_payload(self->ep, conn, &n);
  nq_endpoint_unlock(self->ep);
  return rv == NQ_OK ? PyLong_FromSize_t(n) : raise_nq(rv, conn, -1);
}

static PyObject *Endpoint_ping(EndpointObject *self, PyObject *args) {
  uint64_t conn, seq = 0;
  int rv;
  if (!PyArg_ParseTuple(args, "O&", conv_varint, &conn) || ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_ping(self->ep, conn, &seq);
  ep_leave_wake(self);
  return rv == NQ_OK ? PyLong_FromUnsignedLongLong(seq) : raise_nq(rv, conn, -1);
}

static const char *cc_name(ngtcp2_cc_algo cc) {
  for (size_t i = 0; i < sizeof(CC_ALGOS) / sizeof(CC_ALGOS[0]); ++i) {
    if (CC_ALGOS[i] == cc) {
      return CC_NAMES[i];
    }
  }
  return "unknown";
}

static PyObject *Endpoint_stats(EndpointObject *self, PyObject *args) {
  uint64_t conn;
  nq_stats s;
  int rv;
  if (!PyArg_ParseTuple(args, "O&", conv_varint, &conn) || ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_stats(self->ep, conn, &s);
  nq_endpoint_unlock(self->ep);
  if (rv != NQ_OK) {
    return raise_nq(rv, conn, -1);
  }
  return Py_BuildValue(
      "{sdsdsdsdsKsKsdsKsKsKsKsnss}", "smoothed_rtt_ms", s.smoothed_rtt_ms, "min_rtt_ms",
      s.min_rtt_ms, "latest_rtt_ms", s.latest_rtt_ms, "pto_ms", s.pto_ms, "cwnd",
      (unsigned long long)s.cwnd,
      "bytes_in_flight", (unsigned long long)s.bytes_in_flight, "pacing_rate", s.pacing_rate,
      "delivery_rate", (unsigned long long)s.delivery_rate, "bytes_sent",
      (unsigned long long)s.bytes_sent, "bytes_received", (unsigned long long)s.bytes_recv,
      "packets_lost", (unsigned long long)s.stream_pkts_lost, "max_udp_payload",
      (Py_ssize_t)s.max_udp_payload, "cc", cc_name(s.cc));
}

/* receive_objects(conn, kind, id, group, first, dests, *, timed_out_range, descending,
 * max_properties_length) -> handle: the objects first.. of group of the FETCH (kind 2, id its
 * Request ID) or subscription (kind 1, id its Track Alias) land in dests (nq_objects.c). */
static PyObject *Endpoint_receive_objects(EndpointObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"conn", "kind", "id", "group", "first", "dests", "timed_out_range",
                           "descending", "max_properties_length", NULL};
  uint64_t conn;
  int kind, timed_out = 1, descending = 0, rv;
  unsigned long long id, group, first, max_props = 1ULL << 20;
  PyObject *dests;
  nq_objreg *reg;
  pyreg *r;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&iKKKO!|ppK", kwlist, conv_varint, &conn,
                                   &kind, &id, &group, &first, &PyList_Type, &dests, &timed_out,
                                   &descending, &max_props)) {
    return NULL;
  }
  if (kind != NQ_DSP_SUBGROUP && kind != NQ_DSP_FETCH) {
    return PyErr_Format(PyExc_ValueError, "kind must be 1 (subgroup) or 2 (fetch)");
  }
  reg = nq_objreg_new((nq_dsp_kind)kind, id, group, first, (size_t)PyList_GET_SIZE(dests),
                      timed_out, descending, max_props);
  r = PyMem_Calloc(1, sizeof(*r));
  if (reg == NULL || r == NULL) {
    nq_objreg_free(reg);
    PyMem_Free(r);
    return PyErr_NoMemory();
  }
  if (nqpy_dests_take(&r->dests, dests, reg) != 0) {
    nq_objreg_free(reg);
    PyMem_Free(r);
    return NULL;
  }
  nq_objreg_advise(reg); /* before the lock: a system call, no shared state */
  if (ep_enter(self) < 0) {
    rv = NQ_EINVAL;
  } else {
    rv = nq_api_objects_register(self->ep, conn, reg);
    nq_endpoint_unlock(self->ep);
    if (rv != NQ_OK) {
      raise_nq(rv, conn, -1);
    }
  }
  if (rv != NQ_OK) {
    nq_objreg_free(reg);
    nqpy_dests_release(&r->dests);
    PyMem_Free(r);
    if (rv == NQ_ESTATE) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "that request already has destinations");
    }
    return NULL;
  }
  r->conn = conn;
  r->handle = reg->handle;
  r->next = self->regs;
  self->regs = r;
  return PyLong_FromUnsignedLongLong(r->handle);
}

/* forget_objects(conn, handle): the registration ends; its buffers are released. */
static PyObject *Endpoint_forget_objects(EndpointObject *self, PyObject *args) {
  uint64_t conn, handle;
  pyreg **at, *r = NULL;
  if (!PyArg_ParseTuple(args, "O&O&", conv_varint, &conn, conv_varint, &handle)) {
    return NULL;
  }
  for (at = &self->regs; *at != NULL; at = &(*at)->next) {
    if ((*at)->conn == conn && (*at)->handle == handle) {
      r = *at;
      break;
    }
  }
  if (r == NULL) {
    Py_RETURN_NONE; /* forgotten already */
  }
  if (ep_enter(self) < 0) {
    return NULL; /* closing: close() releases the buffers once the thread stopped */
  }
  (void)nq_api_objects_unregister(self->ep, conn, handle); /* ENOCONN: the connection is gone */
  ep_leave_wake(self);
  /* The hash thread may still read the buffers: wait for what it was given (milliseconds). The
   * endpoint is used from one Python thread, so close() cannot run meanwhile. */
  ++self->inflight;
  Py_BEGIN_ALLOW_THREADS
  nq_hasher_drain(&self->ep->hasher);
  Py_END_ALLOW_THREADS
  --self->inflight;
  *at = r->next;
  nqpy_dests_release(&r->dests);
  PyMem_Free(r);
  Py_RETURN_NONE;
}

/* subscriptions_pending(conn, delta): a SUBSCRIBE is about to leave (1) or its answer is
 * settled (-1); SUBGROUP streams of unregistered aliases are parked meanwhile (nq_objects.c). */
static PyObject *Endpoint_subscriptions_pending(EndpointObject *self, PyObject *args) {
  uint64_t conn;
  int delta, rv;
  if (!PyArg_ParseTuple(args, "O&i", conv_varint, &conn, &delta) || ep_enter(self) < 0) {
    return NULL;
  }
  rv = nq_api_subscriptions_pending(self->ep, conn, delta);
  ep_leave_wake(self);
  if (rv != NQ_OK) {
    return raise_nq(rv, conn, -1);
  }
  Py_RETURN_NONE;
}

static PyMethodDef Endpoint_methods[] = {
    {"subscriptions_pending", (PyCFunction)Endpoint_subscriptions_pending, METH_VARARGS, NULL},
    {"receive_objects", (PyCFunction)(void (*)(void))Endpoint_receive_objects,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"forget_objects", (PyCFunction)Endpoint_forget_objects, METH_VARARGS, NULL},
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)Endpoint_fileno, METH_NOARGS, NULL},
    {"local_address", (PyCFunction)Endpoint_local_address, METH_NOARGS, NULL},
    {"events", (PyCFunction)Endpoint_events, METH_NOARGS, NULL},
    {"connect", (PyCFunction)Endpoint_connect, METH_VARARGS, NULL},
    {"open_stream", (PyCFunction)Endpoint_open_stream, METH_VARARGS, NULL},
    {"send", (PyCFunction)(void (*)(void))Endpoint_send, METH_VARARGS | METH_KEYWORDS, NULL},
    {"buffered", (PyCFunction)Endpoint_buffered, METH_VARARGS, NULL},
    {"watch_acked", (PyCFunction)Endpoint_watch_acked, METH_VARARGS, NULL},
    {"reset_stream", (PyCFunction)Endpoint_reset_stream, METH_VARARGS, NULL},
    {"stop_sending", (PyCFunction)Endpoint_stop_sending, METH_VARARGS, NULL},
    {"send_datagram", (PyCFunction)Endpoint_send_datagram, METH_VARARGS, NULL},
    {"close_connection", (PyCFunction)(void (*)(void))Endpoint_close_connection,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"max_datagram_payload", (PyCFunction)Endpoint_max_datagram_payload, METH_VARARGS, NULL},
    {"stats", (PyCFunction)Endpoint_stats, METH_VARARGS, NULL},
    {"ping", (PyCFunction)Endpoint_ping, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Endpoint_slots[] = {
    {Py_tp_doc, "A QUIC endpoint: one UDP socket and its network thread (see _ngtcp2.pyi)."},
    {Py_tp_new, Endpoint_new},
    {Py_tp_dealloc, Endpoint_dealloc},
    {Py_tp_methods, Endpoint_methods},
    {0, NULL},
};

static PyType_Spec Endpoint_spec = {
    .name = "kvsp_moq.transport.native._ngtcp2.Endpoint",
    .basicsize = sizeof(EndpointObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Endpoint_slots,
};

/* ---- the module ------------------------------------------------------------------------- */

static PyObject *module_version(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  const ngtcp2_info *info = ngtcp2_version(0);
  (void)module;
  return Py_BuildValue("{ssss}", "ngtcp2", info->version_str, "gnutls",
                       gnutls_check_version(NULL));
}

static PyMethodDef module_methods[] = {
    {"version", module_version, METH_NOARGS, "Versions of the ngtcp2 and GnuTLS in use."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module) {
  module_state *st = PyModule_GetState(module);
  st->endpoint_type = PyType_FromModuleAndSpec(module, &Endpoint_spec, NULL);
  if (st->endpoint_type == NULL) {
    return -1;
  }
  for (size_t i = 0; i < NQ_NEVENTS; ++i) {
    st->event_names[i] = PyUnicode_InternFromString(EVENT_NAMES[i]);
    if (st->event_names[i] == NULL) {
      return -1;
    }
  }
  if (nqpy_add_object_parser(module) != 0) {
    return -1;
  }
  return PyModule_AddObjectRef(module, "Endpoint", st->endpoint_type);
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  module_state *st = PyModule_GetState(module);
  Py_VISIT(st->endpoint_type);
  return 0;
}

static int module_clear(PyObject *module) {
  module_state *st = PyModule_GetState(module);
  Py_CLEAR(st->endpoint_type);
  for (size_t i = 0; i < NQ_NEVENTS; ++i) {
    Py_CLEAR(st->event_names[i]);
  }
  return 0;
}

static void module_free(void *module) {
  module_clear(module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvsp_moq.transport.native._ngtcp2",
    .m_doc = "QUIC v1 over ngtcp2 and GnuTLS in a network thread of its own.",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__ngtcp2(void) {
  return PyModuleDef_Init(&module_def);
}
