/*
 * nq: the native QUIC data plane behind kvsp_moq.transport.native._ngtcp2.
 *
 * One endpoint is one UDP socket, one network thread and the ngtcp2 connections on it. The
 * network thread owns the socket and every ngtcp2 call that moves packets; the Python-facing
 * calls (nq_api.c, called by _ngtcp2module.c) take the endpoint's mutex briefly, change state
 * and wake the thread through an eventfd. What the thread learns is queued as C events
 * (nq_events.c) that Python drains; the thread never touches a Python object.
 *
 * Files, one job each:
 *   nq_buf.c      byte chunks: received bytes waiting for Python, send buffers until acked
 *   nq_map.c      hash maps: handle -> connection, stream id -> stream, connection ID -> conn
 *   nq_events.c   the event queue Python drains
 *   nq_udp.c      the socket: options, recvmmsg + GRO, sendmsg + GSO
 *   nq_tls.c      GnuTLS credentials and sessions (ALPN, certificate verification)
 *   nq_stream.c   streams: records, the send queue, the ngtcp2 callbacks about streams
 *   nq_conn.c     connections: creation, the other ngtcp2 callbacks, packets in, timers
 *   nq_close.c    connection close: ours, the peer's, drops; closing and draining periods
 *   nq_write.c    packets out for one connection (streams, datagrams, GSO batches, pacing)
 *   nq_endpoint.c the endpoint: creation, the network thread, datagram dispatch, timers
 *   nq_api.c      the operations Python calls (under the mutex)
 *   nq_moqt.c     the MOQT data-stream parser (SUBGROUP, FETCH; nq_moqt.h)
 *   nq_objects.c  object destinations Python registers, and the streams parsed into them
 *   nq_hasher.c   the hash thread: SHA-256 of landed payloads beside the network thread
 */
#ifndef KVSP_NQ_H
#define KVSP_NQ_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include <gnutls/gnutls.h>
#include <ngtcp2/ngtcp2.h>
#include <ngtcp2/ngtcp2_crypto.h>

#include "nq_moqt.h"

/* Our connection IDs (RFC 9000 §5.1: at most 20 bytes; 16 is plenty to be unguessable). A
 * short header does not carry the length, so every endpoint uses this one length. */
#define NQ_SCID_LEN 16
/* recvmmsg batch: messages per call and bytes per message (a GRO message holds up to 64 KiB).
 * 4, not 16: the network thread acknowledges after each batch, and with BBR's small window on
 * loopback (a few hundred KiB) a 1 MiB batch made sender and receiver take turns; a 256 KiB
 * batch also stays in the cache between the copy out of the socket and the decryption
 * (measured: docs/benchmarks.md, "what bounds one connection"). */
#define NQ_RECV_BATCH 4
#define NQ_RECV_BUFSIZE 65536
/* GSO: the kernel's UDP_MAX_SEGMENTS, and the bytes one sendmsg may carry (one IP datagram). */
#define NQ_GSO_MAX_SEGS 64
#define NQ_GSO_MAX_BYTES 65000
/* ngtcp2_vec entries offered to ngtcp2 per STREAM frame. */
#define NQ_MAX_VECS 16
/* Received stream bytes are kept in chunks of this size until Python drains them. */
#define NQ_RX_CHUNK 262144
/* Small send() calls share tail chunks of this size. */
#define NQ_TX_CHUNK 65536
/* Per connection: received datagrams waiting for Python (RFC 9221 §5: a receiver may drop
 * them), queued outgoing datagrams, and control events (a peer that makes us queue more of
 * those than this while Python is not draining is closed with INTERNAL_ERROR). */
#define NQ_RX_DGRAM_BYTES (1u << 20)
#define NQ_TX_DGRAM_BYTES (1u << 20)
#define NQ_CTL_EVENT_BYTES (1u << 20)
/* A server accepts no new connection while this many bytes of events wait for Python. */
#define NQ_ACCEPT_QUEUE_BYTES (64u << 20)
/* The longest CONNECTION_CLOSE reason phrase we send (ngtcp2 keeps 1024 bytes of a peer's). */
#define NQ_MAX_REASON 1024
/* A handshake not done in this time is abandoned (ngtcp2's handshake_timeout). */
#define NQ_HANDSHAKE_TIMEOUT (10 * NGTCP2_SECONDS)

/* Results of the operations nq_api.c offers; the binding maps each to one Python exception. */
enum nq_err {
  NQ_OK = 0,
  NQ_ENOCONN = -1,   /* no such connection, or it is closing */
  NQ_ENOSTREAM = -2, /* no such stream (never opened, or closed) */
  NQ_EBLOCKED = -3,  /* the peer's stream limit, or a full datagram queue */
  NQ_ESTATE = -4,    /* not allowed in the stream's state (after FIN, on a receive-only side) */
  NQ_ENODGRAM = -5,  /* the peer did not offer DATAGRAM (RFC 9221 §3) */
  NQ_ETOOBIG = -6,   /* a datagram larger than max_datagram_payload */
  NQ_ENOMEM = -7,
  NQ_EINVAL = -8,
};

/* ---- byte chunks (nq_buf.c) ---------------------------------------------------------- */

typedef struct nq_chunk {
  struct nq_chunk *next;
  size_t len; /* bytes used */
  size_t cap; /* bytes allocated in data */
  /* A held chunk (send buffers only): its len bytes are the caller's memory at ext, not data;
   * hold is what keeps that memory alive (the binding's Py_buffer). Such a chunk is never
   * freed by nq_buf.c: it goes to its endpoint's released list, for Python to release. */
  const uint8_t *ext;
  void *hold;
  uint8_t data[];
} nq_chunk;

static inline const uint8_t *nq_chunk_bytes(const nq_chunk *c) {
  return c->ext != NULL ? c->ext : c->data;
}

/* A FIFO of bytes in chunks. */
typedef struct nq_bytes {
  nq_chunk *head;
  nq_chunk *tail;
  uint64_t len;
} nq_bytes;

nq_chunk *nq_chunk_new(size_t cap);
int nq_bytes_append(nq_bytes *b, const uint8_t *data, size_t len, size_t chunk_size);
void nq_bytes_copy_out(const nq_bytes *b, uint8_t *dest);
void nq_bytes_clear(nq_bytes *b);

/* A stream's outgoing bytes: offsets [acked, end) are held; [sent, end) not yet given to
 * ngtcp2. ngtcp2 keeps pointers into [acked, sent) until they are acknowledged or the stream
 * closes, so a chunk is freed only once every byte in it is acknowledged. */
typedef struct nq_sendbuf {
  nq_chunk *head;        /* starts at stream offset base */
  nq_chunk *tail;
  uint64_t base;
  uint64_t end;
  uint64_t sent;
  uint64_t acked;
  nq_chunk *cursor;      /* the chunk holding offset sent (NULL: sent == end) */
  uint64_t cursor_base;  /* stream offset of cursor->data[0] */
  struct nq_endpoint *ep; /* where held chunks go once ngtcp2 is done with them */
} nq_sendbuf;

int nq_sendbuf_append(nq_sendbuf *sb, const uint8_t *data, size_t len);
void nq_sendbuf_append_chunk(nq_sendbuf *sb, nq_chunk *chunk);
size_t nq_sendbuf_unsent(const nq_sendbuf *sb, ngtcp2_vec *vec, size_t nvec, int *all);
void nq_sendbuf_consume(nq_sendbuf *sb, size_t len);
void nq_sendbuf_ack(nq_sendbuf *sb, uint64_t offset, uint64_t len);
void nq_sendbuf_free(nq_sendbuf *sb);

/* ---- hash maps (nq_map.c) ------------------------------------------------------------ */

/* uint64 key -> pointer, open addressing, grows to keep the load under one half. */
typedef struct nq_u64map {
  uint64_t *keys;
  void **vals; /* NULL: empty slot */
  size_t cap;  /* a power of two, or 0 */
  size_t len;
} nq_u64map;

void *nq_u64map_get(const nq_u64map *m, uint64_t key);
int nq_u64map_put(nq_u64map *m, uint64_t key, void *val);
void nq_u64map_del(nq_u64map *m, uint64_t key);
void nq_u64map_free(nq_u64map *m);

struct nq_conn;

/* Connection ID -> connection. Each entry is also on its connection's list, so a connection
 * that goes away takes every ID that routes to it along. */
typedef struct nq_cident {
  struct nq_cident *bucket_next;
  struct nq_cident *conn_next;
  struct nq_conn *conn;
  uint8_t len;
  uint8_t id[NGTCP2_MAX_CIDLEN];
} nq_cident;

typedef struct nq_cidmap {
  nq_cident **buckets;
  size_t nbuckets; /* a power of two */
  uint8_t key[16]; /* random, so a peer cannot aim IDs at one bucket */
} nq_cidmap;

int nq_cidmap_init(nq_cidmap *m, size_t nbuckets);
struct nq_conn *nq_cidmap_get(const nq_cidmap *m, const uint8_t *id, size_t len);
int nq_cidmap_add(nq_cidmap *m, struct nq_conn *conn, const uint8_t *id, size_t len);
void nq_cidmap_remove(nq_cidmap *m, struct nq_conn *conn, const uint8_t *id, size_t len);
void nq_cidmap_remove_conn(nq_cidmap *m, struct nq_conn *conn);
void nq_cidmap_free(nq_cidmap *m);

/* ---- events (nq_events.c) ------------------------------------------------------------ */

typedef enum nq_event_type {
  NQ_EV_ESTABLISHED,
  NQ_EV_STREAM,
  NQ_EV_RESET,
  NQ_EV_STOP_SENDING,
  NQ_EV_DATAGRAM,
  NQ_EV_ACKED,
  NQ_EV_STREAM_LIMIT,
  NQ_EV_CLOSED,
  NQ_EV_PONG,
  NQ_EV_OBJECT,      /* an object of a registered data stream landed (nq_objects.c) */
  NQ_EV_OBJECTS_END, /* a registered data stream ended: FIN, reset or error */
} nq_event_type;

/* OBJECT and OBJECTS_END: what Python hears once per object, and once per stream. */
typedef struct nq_objinfo {
  uint64_t reg;                /* the registration's handle */
  uint64_t group, subgroup, object, length;
  uint8_t has_subgroup, has_priority, priority, status, has_digest;
  uint8_t digest[NQ_DIGEST_LEN];
  uint8_t result;              /* OBJECTS_END: an nq_dsp_result, or NQ_OBJ_RESET */
} nq_objinfo;
#define NQ_OBJ_RESET 5

struct nq_stream;

typedef struct nq_event {
  struct nq_event *next;
  nq_event_type type;
  uint64_t conn;              /* the connection's handle */
  int64_t stream_id;
  uint64_t code;              /* RESET, STOP_SENDING, CLOSED; PONG: the ping's number */
  uint64_t buffered;          /* ACKED: filled in when the queue is detached */
  struct nq_stream *stream;   /* STREAM, ACKED: the live stream this event still collects for */
  nq_bytes data;              /* STREAM, DATAGRAM payload; CLOSED reason; ESTABLISHED ALPN */
  uint8_t fin, app, by_peer;
  struct sockaddr_storage addr; /* ESTABLISHED: the peer */
  socklen_t addrlen;
  size_t cost;                /* bytes charged to the connection's control/datagram budget */
  nq_objinfo obj;             /* OBJECT (data: its properties), OBJECTS_END (data: reason) */
} nq_event;

struct nq_endpoint;

int nq_emit_established(struct nq_conn *c, const uint8_t *alpn, size_t alpnlen);
int nq_emit_stream_data(struct nq_stream *s, const uint8_t *data, size_t len, int fin);
int nq_emit_reset(struct nq_conn *c, int64_t stream_id, uint64_t code);
int nq_emit_stop_sending(struct nq_conn *c, int64_t stream_id, uint64_t code);
int nq_emit_datagram(struct nq_conn *c, const uint8_t *data, size_t len);
int nq_emit_acked(struct nq_stream *s);
int nq_emit_stream_limit(struct nq_conn *c);
int nq_emit_closed(struct nq_conn *c, uint64_t code, const uint8_t *reason, size_t reasonlen,
                   int app, int by_peer);
int nq_emit_pong(struct nq_conn *c, uint64_t seq);
int nq_emit_object(struct nq_conn *c, int64_t stream_id, const nq_objinfo *info,
                   const uint8_t *props, size_t propslen);
int nq_emit_objects_end(struct nq_conn *c, int64_t stream_id, uint64_t reg, uint8_t result,
                        uint64_t code, const char *reason);
void nq_events_forget_stream(struct nq_stream *s);
void nq_release_held(struct nq_endpoint *ep, nq_chunk *chunk);
nq_chunk *nq_released_detach(struct nq_endpoint *ep);
nq_event *nq_events_detach(struct nq_endpoint *ep);
void nq_events_free_list(nq_event *ev);

/* ---- streams and connections (nq_stream.c, nq_conn.c, nq_close.c) -------------------- */

typedef struct nq_stream {
  int64_t id;
  struct nq_conn *conn;
  nq_sendbuf tx;
  unsigned fin_queued : 1;    /* send(fin=True) was called */
  unsigned fin_sent : 1;      /* ngtcp2 took the FIN */
  unsigned local_reset : 1;   /* we sent RESET_STREAM (reset_stream) */
  unsigned peer_stopped : 1;  /* ngtcp2 refused to write: the peer sent STOP_SENDING */
  unsigned read_stopped : 1;  /* we sent STOP_SENDING (stop_sending) */
  unsigned seen : 1;          /* Python has been told about this stream */
  unsigned blocked : 1;       /* stream flow control: waiting for MAX_STREAM_DATA */
  unsigned in_txq : 1;
  unsigned ended : 1;         /* a peer's uni stream finished (nq_stream.c, ngtcp2 < 0.14) */
  unsigned routed : 1;        /* its bytes go to Python (not a registered data stream) */
  unsigned native_done : 1;   /* a registered data stream that ended: later bytes dropped */
  unsigned parked : 1;        /* a SUBGROUP stream of an alias not registered yet, while a
                               * SUBSCRIBE is unanswered: its bytes wait here (nq_objects.c) */
  unsigned parked_fin : 1;
  unsigned ack_watched : 1;   /* Python waits on acknowledgements (nq_api_watch_acked) */
  unsigned ack_armed : 1;     /* and does now, until buffered <= ack_wake (nq_emit_acked) */
  uint64_t ack_wake;
  uint64_t parked_alias;
  nq_bytes parked_data;       /* uncredited: bounded by the stream's flow-control window */
  uint8_t peeklen;
  uint8_t peek[18];           /* a peer's uni stream's first bytes: type and ID (2 vi64) */
  struct nq_rx *rx;           /* a registered data stream being parsed (nq_objects.c) */
  struct nq_stream *txq_prev, *txq_next;
  nq_event *rx_ev;            /* the queued STREAM event received bytes join */
  nq_event *acked_ev;         /* the queued ACKED event */
} nq_stream;

typedef enum nq_conn_state {
  NQ_HANDSHAKING,
  NQ_OPEN,
  NQ_CLOSING,  /* we sent CONNECTION_CLOSE (RFC 9000 §10.2.1) */
  NQ_DRAINING, /* the peer did (RFC 9000 §10.2.2) */
  NQ_DEAD,     /* to be freed */
} nq_conn_state;

typedef struct nq_dgram {
  struct nq_dgram *next;
  size_t len;
  uint8_t data[];
} nq_dgram;

typedef struct nq_conn {
  struct nq_endpoint *ep;
  uint64_t handle;
  ngtcp2_conn *qc;
  gnutls_session_t tls;
  ngtcp2_crypto_conn_ref conn_ref;
  nq_conn_state state;
  unsigned established : 1;   /* the established event was queued */
  unsigned closed_emitted : 1;
  unsigned want_write : 1;
  unsigned close_requested : 1;
  unsigned stream_limit_queued : 1;
  struct sockaddr_storage remote;
  socklen_t remotelen;
  struct nq_conn *prev, *next; /* the endpoint's list */
  nq_cident *cids;             /* IDs routing to this connection */
  nq_u64map streams;           /* stream id -> nq_stream */
  nq_stream *txq_head, *txq_tail; /* streams with bytes (or a FIN) to send, round robin */
  nq_dgram *dgram_head, *dgram_tail;
  size_t dgram_bytes;
  /* The close Python asked for (close_connection). */
  uint64_t req_code;
  int req_app;
  uint8_t *req_reason;
  size_t req_reasonlen;
  /* CLOSING: the packet that carries our CONNECTION_CLOSE, to repeat (RFC 9000 §10.2.1). */
  uint8_t *cc_pkt;
  size_t cc_pktlen;
  uint64_t cc_rx_count;
  ngtcp2_tstamp close_deadline;
  /* Bytes of events waiting for Python, by budget; events queued since the last drain. */
  size_t ctl_bytes;
  size_t rx_dgram_bytes;
  size_t queued_events;
  /* Remote streams closed while Python still had their events: MAX_STREAMS credit to grant
   * when it drains them (RFC 9000 §4.6). */
  uint64_t grant_bidi, grant_uni;
  /* PING (Endpoint.ping), numbered requests: the latest one requested, the one whose packet
   * went out (at ping_ts) and the last one acknowledged (nq_conn.c, nq_write.c). */
  uint64_t ping_requested, ping_sent, ping_acked;
  ngtcp2_tstamp ping_ts;
  /* Statistics. */
  uint64_t bytes_sent, bytes_recv, stream_pkts_lost;
  struct nq_objreg *objregs;   /* object destinations Python registered (nq_objects.c) */
  uint64_t subs_pending;       /* SUBSCRIBEs Python announced whose answer is not settled */
} nq_conn;

nq_conn *nq_conn_new_client(struct nq_endpoint *ep, const struct sockaddr *remote,
                            socklen_t remotelen, const char *server_name, char *err,
                            size_t errlen);
nq_conn *nq_conn_new_server(struct nq_endpoint *ep, const struct sockaddr *remote,
                            socklen_t remotelen, const ngtcp2_pkt_hd *hd);
void nq_conn_free(nq_conn *c);
void nq_conn_on_packet(nq_conn *c, const struct sockaddr *remote, socklen_t remotelen,
                       const uint8_t *pkt, size_t len, ngtcp2_tstamp ts);
void nq_conn_on_timer(nq_conn *c, ngtcp2_tstamp ts);
ngtcp2_tstamp nq_conn_deadline(nq_conn *c);
void nq_conn_close_local(nq_conn *c, uint64_t code, int app, const uint8_t *reason,
                         size_t reasonlen, ngtcp2_tstamp ts);
void nq_conn_close_liberr(nq_conn *c, int liberr, ngtcp2_tstamp ts);
int nq_conn_request_close(nq_conn *c, uint64_t code, int app, const uint8_t *reason,
                          size_t reasonlen);
void nq_conn_grant_streams(nq_conn *c);
int nq_conn_usable(const nq_conn *c);
void nq_conn_on_read_error(nq_conn *c, int liberr, ngtcp2_tstamp ts);
void nq_conn_process_request(nq_conn *c, ngtcp2_tstamp ts);
void nq_conn_enter_draining(nq_conn *c, ngtcp2_tstamp ts);
void nq_conn_drop(nq_conn *c, const char *why);
void nq_conn_repeat_close(nq_conn *c);

/* ---- streams (nq_stream.c) ----------------------------------------------------------- */

nq_stream *nq_stream_get(nq_conn *c, int64_t stream_id);
void nq_stream_free_all(nq_conn *c);
nq_stream *nq_stream_attach(nq_conn *c, int64_t stream_id);
void nq_stream_txq_add(nq_stream *s);
void nq_stream_txq_remove(nq_stream *s);
int nq_stream_sendable(const nq_stream *s);
uint64_t nq_stream_buffered(const nq_stream *s);
size_t nq_conn_max_datagram_payload(nq_conn *c);

int nq_cb_recv_stream_data(ngtcp2_conn *qc, uint32_t flags, int64_t stream_id, uint64_t offset,
                           const uint8_t *data, size_t datalen, void *user_data,
                           void *stream_user_data);
int nq_cb_acked_stream_data_offset(ngtcp2_conn *qc, int64_t stream_id, uint64_t offset,
                                   uint64_t datalen, void *user_data, void *stream_user_data);
int nq_cb_stream_close(ngtcp2_conn *qc, uint32_t flags, int64_t stream_id,
                       uint64_t app_error_code, void *user_data, void *stream_user_data);
int nq_cb_stream_reset(ngtcp2_conn *qc, int64_t stream_id, uint64_t final_size,
                       uint64_t app_error_code, void *user_data, void *stream_user_data);
int nq_cb_extend_max_stream_data(ngtcp2_conn *qc, int64_t stream_id, uint64_t max_data,
                                 void *user_data, void *stream_user_data);
int nq_cb_extend_max_local_streams(ngtcp2_conn *qc, uint64_t max_streams, void *user_data);

/* ---- registered object destinations (nq_objects.c) ---------------------------------- */

/* Destinations of the objects of one FETCH (its Request ID) or one subscription (its Track
 * Alias): objects first .. first + n - 1 of one group, each a buffer of exactly its payload
 * length (or none: the object is discarded). Python keeps the buffers alive while registered. */
typedef struct nq_objreg {
  struct nq_objreg *next;
  uint64_t handle;
  nq_dsp_kind kind;
  uint64_t id;
  int timed_out_range, descending;
  uint64_t max_props;
  uint64_t group, first;
  size_t n;
  uint8_t **ptr;
  size_t *len;
  uint8_t *state; /* 0 not begun, 1 landing, 2 landed */
} nq_objreg;

nq_objreg *nq_objreg_new(nq_dsp_kind kind, uint64_t id, uint64_t group, uint64_t first, size_t n,
                         int timed_out_range, int descending, uint64_t max_props);
void nq_objreg_free(nq_objreg *r);
void nq_objreg_advise(const nq_objreg *r);
nq_dsp_dest nq_objreg_begin(nq_objreg *r, nq_dsp *p, const nq_dsp_object *o, uint8_t **dest,
                            size_t *slot);
void nq_objreg_end(nq_objreg *r, size_t slot, const uint8_t *digest);
/* The OBJECT event's fields of a parsed object header (``reg``: its registration's handle). */
void nq_objinfo_of(const nq_dsp_object *o, uint64_t reg, nq_objinfo *info);
int nq_objects_recv(nq_conn *c, nq_stream *s, const uint8_t *data, size_t len, int fin);
void nq_objects_reset(nq_conn *c, nq_stream *s, uint64_t code);
void nq_objects_stream_free(nq_stream *s);
void nq_objects_free_conn(nq_conn *c);
int nq_api_objects_register(struct nq_endpoint *ep, uint64_t conn, nq_objreg *r);
int nq_api_objects_unregister(struct nq_endpoint *ep, uint64_t conn, uint64_t handle);
int nq_api_subscriptions_pending(struct nq_endpoint *ep, uint64_t conn, int delta);
int nq_objects_parked_reset(nq_conn *c, nq_stream *s);

/* ---- packets out (nq_write.c) -------------------------------------------------------- */

int nq_conn_write(nq_conn *c, ngtcp2_tstamp ts);

/* ---- TLS (nq_tls.c) ------------------------------------------------------------------- */

typedef struct nq_tls {
  gnutls_certificate_credentials_t cred;
  gnutls_priority_t prio;
  gnutls_datum_t *alpns;
  size_t nalpns;
  int server;
  int verify;
} nq_tls;

int nq_tls_init(nq_tls *t, int server, const char *const *alpns, size_t nalpns,
                const char *cert_file, const char *key_file, const char *ca_file, int verify,
                char *err, size_t errlen);
void nq_tls_free(nq_tls *t);
int nq_tls_session_new(const nq_tls *t, const char *server_name, ngtcp2_crypto_conn_ref *ref,
                       gnutls_session_t *out);
size_t nq_tls_selected_alpn(gnutls_session_t s, const uint8_t **alpn);

/* ---- the socket (nq_udp.c) ----------------------------------------------------------- */

typedef struct nq_udp {
  int fd;
  int gso;  /* UDP_SEGMENT usable */
  int gro;  /* UDP_GRO enabled */
  struct sockaddr_storage local;
  socklen_t locallen;
  uint8_t *rxbuf;  /* NQ_RECV_BATCH * NQ_RECV_BUFSIZE */
  uint64_t tx_dropped; /* batches the kernel refused (counted as loss) */
} nq_udp;

typedef void (*nq_datagram_cb)(void *arg, const struct sockaddr *from, socklen_t fromlen,
                               const uint8_t *data, size_t len);

int nq_udp_open(nq_udp *u, const char *host, int port, int gso, int gro, int reuse_port,
                char *err, size_t errlen);
void nq_udp_close(nq_udp *u);
int nq_udp_recv_batch(nq_udp *u, nq_datagram_cb cb, void *arg);
void nq_udp_send(nq_udp *u, const struct sockaddr *to, socklen_t tolen, const uint8_t *data,
                 size_t len, size_t gso_size);

/* ---- the endpoint (nq_endpoint.c) ---------------------------------------------------- */

typedef struct nq_config {
  int server;
  ngtcp2_cc_algo cc;
  size_t max_udp_payload;
  uint64_t idle_timeout_ms;
  uint64_t initial_max_data;
  uint64_t initial_max_stream_data;
  uint64_t initial_max_streams_bidi;
  uint64_t initial_max_streams_uni;
  uint64_t max_datagram_frame_size;
  size_t max_connections;
  int reuse_port; /* SO_REUSEPORT: several endpoints (processes) share the port */
  int log; /* ngtcp2's debug log on stderr ($KVSP_NQ_LOG) */
} nq_config;

/* The hash thread (nq_hasher.c). */
struct nq_hjob;
typedef struct nq_hasher {
  struct nq_endpoint *ep;
  pthread_t thread;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct nq_hjob *head, *tail;
  uint64_t submitted, done;
  int started, stopping;
} nq_hasher;

int nq_hasher_start(struct nq_endpoint *ep);
int nq_hasher_update(nq_hasher *hs, gnutls_hash_hd_t h, const uint8_t *ptr, size_t len);
int nq_hasher_finish(nq_hasher *hs, gnutls_hash_hd_t h, int emit, uint64_t conn,
                     int64_t stream_id, const nq_objinfo *info, const uint8_t *props,
                     size_t propslen);
int nq_hasher_end(nq_hasher *hs, uint64_t conn, int64_t stream_id, uint64_t reg, uint8_t result,
                  uint64_t code, const char *reason);
void nq_hasher_drain(nq_hasher *hs);
void nq_hasher_stop(nq_hasher *hs);

typedef struct nq_endpoint {
  nq_config cfg;
  nq_tls tls;
  nq_udp udp;
  pthread_mutex_t lock;
  atomic_int waiters;  /* Python threads waiting for the lock: the network thread yields */
  pthread_t thread;
  int thread_started;
  int stopping;        /* under lock: the network thread closes everything and exits */
  int wake_fd;         /* eventfd: Python -> network thread */
  int event_fd;        /* eventfd: network thread -> Python (events pending) */
  int event_signalled;
  nq_event *ev_head, *ev_tail;
  size_t ev_bytes;     /* bytes of queued events (stream data included) */
  /* Held send chunks (zero-copy send) ngtcp2 no longer points into: acknowledged, or their
   * stream closed (reset included). Python releases their buffers when it drains events. */
  nq_chunk *released;
  nq_u64map conns_by_handle;
  nq_cidmap cids;
  nq_conn *conns;      /* every connection, any state */
  size_t nconns;
  uint64_t next_handle;
  uint64_t next_objreg; /* handles of object registrations (nq_objects.c) */
  nq_hasher hasher;     /* started with the first registration */
  int remote_uni_lingers; /* ngtcp2 < 0.14: a peer's uni stream never closes (nq_stream.c) */
  uint8_t *txbuf;      /* one GSO batch */
  size_t txbuf_size;
} nq_endpoint;

nq_endpoint *nq_endpoint_new(const nq_config *cfg, const char *host, int port,
                             const char *const *alpns, size_t nalpns, const char *cert_file,
                             const char *key_file, const char *ca_file, int verify, int gso,
                             int gro, char *err, size_t errlen);
int nq_endpoint_stop(nq_endpoint *ep, int timeout_ms);
void nq_endpoint_free(nq_endpoint *ep);
void nq_endpoint_lock(nq_endpoint *ep);
int nq_endpoint_trylock(nq_endpoint *ep);
void nq_endpoint_unlock(nq_endpoint *ep);
void nq_endpoint_wake(nq_endpoint *ep);
void nq_endpoint_add_conn(nq_endpoint *ep, nq_conn *c);
nq_conn *nq_endpoint_conn(nq_endpoint *ep, uint64_t handle);
ngtcp2_tstamp nq_now(void);

/* ---- operations for Python (nq_api.c); the caller holds the lock -------------------- */

int nq_api_connect(nq_endpoint *ep, const struct sockaddr *remote, socklen_t remotelen,
                   const char *server_name, uint64_t *handle, char *err, size_t errlen);
int nq_api_open_stream(nq_endpoint *ep, uint64_t conn, int uni, int64_t *stream_id);
int nq_api_send(nq_endpoint *ep, uint64_t conn, int64_t stream_id, const uint8_t *data,
                size_t len, nq_chunk **prefilled, int fin);
int nq_api_buffered(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t *out);
int nq_api_watch_acked(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t threshold,
                       uint64_t *buffered);
int nq_api_reset_stream(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t code);
int nq_api_stop_sending(nq_endpoint *ep, uint64_t conn, int64_t stream_id, uint64_t code);
int nq_api_send_datagram(nq_endpoint *ep, uint64_t conn, const uint8_t *data, size_t len);
int nq_api_close_connection(nq_endpoint *ep, uint64_t conn, uint64_t code,
                            const uint8_t *reason, size_t reasonlen, int app);
int nq_api_max_datagram_payload(nq_endpoint *ep, uint64_t conn, size_t *out);
int nq_api_ping(nq_endpoint *ep, uint64_t conn, uint64_t *seq);
void nq_api_credit(nq_endpoint *ep, const nq_event *drained);

typedef struct nq_stats {
  double smoothed_rtt_ms, min_rtt_ms, latest_rtt_ms, pto_ms, pacing_rate;
  uint64_t cwnd, bytes_in_flight, bytes_sent, bytes_recv, stream_pkts_lost, delivery_rate;
  size_t max_udp_payload;
  ngtcp2_cc_algo cc;
} nq_stats;

int nq_api_stats(nq_endpoint *ep, uint64_t conn, nq_stats *out);

#endif /* KVSP_NQ_H */
