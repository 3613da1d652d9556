/*
 * Connections: creation (client and server), the ngtcp2 callbacks that are not about streams,
 * packets in, timers, and freeing.
 */
#include "nq.h"

#include <gnutls/crypto.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ngtcp2_conn *get_conn(ngtcp2_crypto_conn_ref *ref) {
  nq_conn *c = ref->user_data;
  return c->qc;
}

static void cb_rand(uint8_t *dest, size_t destlen, const ngtcp2_rand_ctx *rand_ctx) {
  (void)rand_ctx;
  (void)gnutls_rnd(GNUTLS_RND_RANDOM, dest, destlen);
}

static void log_printf(void *user_data, const char *fmt, ...) {
  va_list ap;
  (void)user_data;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

/* A fresh connection ID of ours, routed to c (RFC 9000 §5.1.1), with a random stateless
 * reset token (RFC 9000 §10.3). */
static int cb_get_new_connection_id(ngtcp2_conn *qc, ngtcp2_cid *cid, uint8_t *token,
                                    size_t cidlen, void *user_data) {
  nq_conn *c = user_data;
  (void)qc;
  for (int tries = 0;; ++tries) {
    if (tries == 4 || gnutls_rnd(GNUTLS_RND_RANDOM, cid->data, cidlen) != 0) {
      return NGTCP2_ERR_CALLBACK_FAILURE;
    }
    cid->datalen = cidlen;
    if (nq_cidmap_add(&c->ep->cids, c, cid->data, cidlen) == 0) {
      break;
    }
  }
  if (gnutls_rnd(GNUTLS_RND_RANDOM, token, NGTCP2_STATELESS_RESET_TOKENLEN) != 0) {
    return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  return 0;
}

static int cb_remove_connection_id(ngtcp2_conn *qc, const ngtcp2_cid *cid, void *user_data) {
  nq_conn *c = user_data;
  (void)qc;
  nq_cidmap_remove(&c->ep->cids, c, cid->data, cid->datalen);
  return 0;
}

/* The handshake is done (RFC 9001 §4.1.1): the connection is established, with the ALPN
 * protocol TLS agreed (RFC 9001 §8.1 requires one). */
static int cb_handshake_completed(ngtcp2_conn *qc, void *user_data) {
  nq_conn *c = user_data;
  const uint8_t *alpn;
  size_t alpnlen = nq_tls_selected_alpn(c->tls, &alpn);
  (void)qc;
  if (alpnlen == 0) {
    nq_conn_request_close(c, NGTCP2_CRYPTO_ERROR + GNUTLS_A_NO_APPLICATION_PROTOCOL, 0,
                          (const uint8_t *)"no application protocol", 23);
    return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  c->state = NQ_OPEN;
  c->established = 1;
  return nq_emit_established(c, alpn, alpnlen) == 0 ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

static int cb_recv_datagram(ngtcp2_conn *qc, uint32_t flags, const uint8_t *data,
                            size_t datalen, void *user_data) {
  (void)qc;
  (void)flags;
  return nq_emit_datagram(user_data, data, datalen) == 0 ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

static void callbacks_init(ngtcp2_callbacks *cb, int server) {
  memset(cb, 0, sizeof(*cb));
  if (server) {
    cb->recv_client_initial = ngtcp2_crypto_recv_client_initial_cb;
  } else {
    cb->client_initial = ngtcp2_crypto_client_initial_cb;
    cb->recv_retry = ngtcp2_crypto_recv_retry_cb;
  }
  cb->recv_crypto_data = ngtcp2_crypto_recv_crypto_data_cb;
  cb->encrypt = ngtcp2_crypto_encrypt_cb;
  cb->decrypt = ngtcp2_crypto_decrypt_cb;
  cb->hp_mask = ngtcp2_crypto_hp_mask_cb;
  cb->update_key = ngtcp2_crypto_update_key_cb;
  cb->delete_crypto_aead_ctx = ngtcp2_crypto_delete_crypto_aead_ctx_cb;
  cb->delete_crypto_cipher_ctx = ngtcp2_crypto_delete_crypto_cipher_ctx_cb;
  cb->get_path_challenge_data = ngtcp2_crypto_get_path_challenge_data_cb;
  cb->version_negotiation = ngtcp2_crypto_version_negotiation_cb;
  cb->rand = cb_rand;
  cb->get_new_connection_id = cb_get_new_connection_id;
  cb->remove_connection_id = cb_remove_connection_id;
  cb->handshake_completed = cb_handshake_completed;
  cb->recv_datagram = cb_recv_datagram;
  cb->recv_stream_data = nq_cb_recv_stream_data;
  cb->acked_stream_data_offset = nq_cb_acked_stream_data_offset;
  cb->stream_close = nq_cb_stream_close;
  cb->stream_reset = nq_cb_stream_reset;
  cb->extend_max_stream_data = nq_cb_extend_max_stream_data;
  cb->extend_max_local_streams_bidi = nq_cb_extend_max_local_streams;
  cb->extend_max_local_streams_uni = nq_cb_extend_max_local_streams;
}

static void settings_init(const nq_endpoint *ep, ngtcp2_settings *s, ngtcp2_tstamp ts) {
  ngtcp2_settings_default(s);
  s->initial_ts = ts;
  s->cc_algo = ep->cfg.cc;
  s->max_tx_udp_payload_size = ep->cfg.max_udp_payload;
  /* Below 1452 bytes, ngtcp2 starts at 1200 and probes the path (DPLPMTUD, RFC 9000 §14.3,
   * in ngtcp2's fixed steps: 1406, 1342, 1232, 1444); from 1452 (what a 1500-byte MTU
   * carries over IPv4 and IPv6, and more than any of those steps reaches) the configured size
   * is taken as what the path carries, as the other backends take max_datagram_size. */
  s->no_tx_udp_payload_size_shaping =
      ep->cfg.max_udp_payload >= NGTCP2_MAX_PMTUD_UDP_PAYLOAD_SIZE;
  s->handshake_timeout = NQ_HANDSHAKE_TIMEOUT;
  s->log_printf = ep->cfg.log ? log_printf : NULL;
}

/* Our transport parameters (RFC 9000 §18.2). The windows are fixed (no auto-tuning): they
 * bound what one connection may make us hold for Python. */
static void params_init(const nq_endpoint *ep, ngtcp2_transport_params *p) {
  ngtcp2_transport_params_default(p);
  p->initial_max_data = ep->cfg.initial_max_data;
  p->initial_max_stream_data_bidi_local = ep->cfg.initial_max_stream_data;
  p->initial_max_stream_data_bidi_remote = ep->cfg.initial_max_stream_data;
  p->initial_max_stream_data_uni = ep->cfg.initial_max_stream_data;
  p->initial_max_streams_bidi = ep->cfg.initial_max_streams_bidi;
  p->initial_max_streams_uni = ep->cfg.initial_max_streams_uni;
  p->max_idle_timeout = ep->cfg.idle_timeout_ms * NGTCP2_MILLISECONDS;
  p->max_datagram_frame_size = ep->cfg.max_datagram_frame_size;
}

static nq_conn *conn_alloc(nq_endpoint *ep, const struct sockaddr *remote,
                           socklen_t remotelen) {
  nq_conn *c;
  if (remotelen > sizeof(c->remote)) {
    return NULL;
  }
  c = calloc(1, sizeof(*c));
  if (c == NULL) {
    return NULL;
  }
  c->ep = ep;
  c->handle = ++ep->next_handle;
  c->conn_ref.get_conn = get_conn;
  c->conn_ref.user_data = c;
  c->state = NQ_HANDSHAKING;
  memcpy(&c->remote, remote, remotelen);
  c->remotelen = remotelen;
  return c;
}

static ngtcp2_path path_of(nq_endpoint *ep, const struct sockaddr *remote, socklen_t len) {
  ngtcp2_path path;
  memset(&path, 0, sizeof(path));
  path.local.addr = (struct sockaddr *)&ep->udp.local;
  path.local.addrlen = ep->udp.locallen;
  path.remote.addr = (struct sockaddr *)remote;
  path.remote.addrlen = len;
  return path;
}

static int random_cid(ngtcp2_cid *cid) {
  cid->datalen = NQ_SCID_LEN;
  return gnutls_rnd(GNUTLS_RND_RANDOM, cid->data, cid->datalen);
}

/* TLS session, routing of our first connection ID, the endpoint's tables. */
static int conn_finish(nq_conn *c, const char *server_name, const ngtcp2_cid *scid) {
  if (nq_tls_session_new(&c->ep->tls, server_name, &c->conn_ref, &c->tls) != 0) {
    return -1;
  }
  ngtcp2_conn_set_tls_native_handle(c->qc, c->tls);
  if (nq_cidmap_add(&c->ep->cids, c, scid->data, scid->datalen) != 0) {
    return -1;
  }
  nq_endpoint_add_conn(c->ep, c);
  c->want_write = 1;
  return 0;
}

/* Connections not yet in the endpoint's tables are freed here, without events. */
static void conn_discard(nq_conn *c) {
  nq_cidmap_remove_conn(&c->ep->cids, c);
  if (c->qc != NULL) {
    ngtcp2_conn_del(c->qc);
  }
  if (c->tls != NULL) {
    gnutls_deinit(c->tls);
  }
  free(c);
}

nq_conn *nq_conn_new_client(nq_endpoint *ep, const struct sockaddr *remote,
                            socklen_t remotelen, const char *server_name, char *err,
                            size_t errlen) {
  ngtcp2_callbacks cb;
  ngtcp2_settings settings;
  ngtcp2_transport_params params;
  ngtcp2_cid dcid, scid;
  ngtcp2_path path;
  ngtcp2_tstamp ts = nq_now();
  nq_conn *c = conn_alloc(ep, remote, remotelen);
  int rv;
  if (c == NULL || random_cid(&dcid) != 0 || random_cid(&scid) != 0) {
    snprintf(err, errlen, "out of memory");
    free(c);
    return NULL;
  }
  callbacks_init(&cb, 0);
  settings_init(ep, &settings, ts);
  params_init(ep, &params);
  path = path_of(ep, (const struct sockaddr *)&c->remote, c->remotelen);
  rv = ngtcp2_conn_client_new(&c->qc, &dcid, &scid, &path, NGTCP2_PROTO_VER_V1, &cb, &settings,
                              &params, NULL, c);
  if (rv != 0) {
    snprintf(err, errlen, "ngtcp2_conn_client_new: %s", ngtcp2_strerror(rv));
    c->qc = NULL;
    conn_discard(c);
    return NULL;
  }
  if (conn_finish(c, server_name, &scid) != 0) {
    snprintf(err, errlen, "cannot set up TLS for %s", server_name);
    conn_discard(c);
    return NULL;
  }
  return c;
}

/* A server's new connection, from a client Initial that ngtcp2_accept found acceptable. */
nq_conn *nq_conn_new_server(nq_endpoint *ep, const struct sockaddr *remote,
                            socklen_t remotelen, const ngtcp2_pkt_hd *hd) {
  ngtcp2_callbacks cb;
  ngtcp2_settings settings;
  ngtcp2_transport_params params;
  ngtcp2_cid scid;
  ngtcp2_path path;
  nq_conn *c = conn_alloc(ep, remote, remotelen);
  if (c == NULL || random_cid(&scid) != 0) {
    free(c);
    return NULL;
  }
  callbacks_init(&cb, 1);
  settings_init(ep, &settings, nq_now());
  params_init(ep, &params);
  /* RFC 9000 §7.3: the server echoes the client's first Destination Connection ID. */
  params.original_dcid = hd->dcid;
  params.stateless_reset_token_present = 1;
  (void)gnutls_rnd(GNUTLS_RND_RANDOM, params.stateless_reset_token,
                   sizeof(params.stateless_reset_token));
  path = path_of(ep, (const struct sockaddr *)&c->remote, c->remotelen);
  if (ngtcp2_conn_server_new(&c->qc, &hd->scid, &scid, &path, hd->version, &cb, &settings,
                             &params, NULL, c) != 0) {
    c->qc = NULL;
    conn_discard(c);
    return NULL;
  }
  /* The client keeps using its first DCID until it hears our SCID (RFC 9000 §7.2). */
  if (nq_cidmap_add(&ep->cids, c, hd->dcid.data, hd->dcid.datalen) != 0 ||
      conn_finish(c, NULL, &scid) != 0) {
    conn_discard(c);
    return NULL;
  }
  return c;
}

void nq_conn_free(nq_conn *c) {
  nq_endpoint *ep = c->ep;
  nq_dgram *d = c->dgram_head;
  nq_stream_free_all(c);
  nq_objects_free_conn(c);
  while (d != NULL) {
    nq_dgram *next = d->next;
    free(d);
    d = next;
  }
  free(c->req_reason);
  free(c->cc_pkt);
  nq_u64map_del(&ep->conns_by_handle, c->handle);
  if (c->prev != NULL) {
    c->prev->next = c->next;
  } else {
    ep->conns = c->next;
  }
  if (c->next != NULL) {
    c->next->prev = c->prev;
  }
  --ep->nconns;
  conn_discard(c);
}

/* Was the outstanding PING acknowledged by the packet just read at ts? ngtcp2 0.12 reports no
 * acknowledgement of a PING, so: yes when nothing is in flight any more (the PING counted in
 * bytes in flight until then), or when the packet gave a new RTT sample whose packet was
 * sent at or after the PING (ngtcp2 takes latest_rtt = ts - the largest newly acknowledged
 * packet's send time, RFC 9002 §5.1): the peer acknowledged something sent after the ping. */
static void check_ping(nq_conn *c, const ngtcp2_conn_stat *before, ngtcp2_tstamp ts) {
  ngtcp2_conn_stat cs;
  int sample;
  ngtcp2_conn_get_conn_stat(c->qc, &cs);
  sample = cs.latest_rtt != before->latest_rtt && cs.latest_rtt <= ts &&
           ts - cs.latest_rtt >= c->ping_ts;
  if (cs.bytes_in_flight == 0 || sample) {
    c->ping_acked = c->ping_sent;
    (void)nq_emit_pong(c, c->ping_acked);
  }
}

/* A datagram for this connection (RFC 9000 §12.2: possibly several coalesced packets). */
void nq_conn_on_packet(nq_conn *c, const struct sockaddr *remote, socklen_t remotelen,
                       const uint8_t *pkt, size_t len, ngtcp2_tstamp ts) {
  ngtcp2_path path;
  ngtcp2_pkt_info pi;
  ngtcp2_conn_stat before;
  int rv;
  if (c->state == NQ_CLOSING) {
    nq_conn_repeat_close(c);
    return;
  }
  if (c->state == NQ_DRAINING || c->state == NQ_DEAD) {
    return; /* RFC 9000 §10.2.2: a draining endpoint sends nothing */
  }
  memset(&pi, 0, sizeof(pi));
  path = path_of(c->ep, remote, remotelen);
  c->bytes_recv += len;
  if (c->ping_sent > c->ping_acked) {
    ngtcp2_conn_get_conn_stat(c->qc, &before);
  }
  rv = ngtcp2_conn_read_pkt(c->qc, &path, &pi, pkt, len, ts);
  if (rv != 0) {
    nq_conn_on_read_error(c, rv, ts);
    return;
  }
  if (c->ping_sent > c->ping_acked) {
    check_ping(c, &before, ts);
  }
  c->want_write = 1;
}

/* ngtcp2's timers: loss detection, ACK delay, pacing, idle and handshake timeouts. */
void nq_conn_on_timer(nq_conn *c, ngtcp2_tstamp ts) {
  int rv;
  if (c->state == NQ_CLOSING || c->state == NQ_DRAINING) {
    if (ts >= c->close_deadline) {
      c->state = NQ_DEAD;
    }
    return;
  }
  if (c->state == NQ_DEAD || ngtcp2_conn_get_expiry(c->qc) > ts) {
    return;
  }
  rv = ngtcp2_conn_handle_expiry(c->qc, ts);
  if (rv == 0) {
    c->want_write = 1;
  } else if (rv == NGTCP2_ERR_IDLE_CLOSE) {
    nq_conn_drop(c, "idle timeout"); /* RFC 9000 §10.1: closed silently */
  } else if (rv == NGTCP2_ERR_HANDSHAKE_TIMEOUT) {
    nq_conn_drop(c, "handshake timeout");
  } else {
    nq_conn_close_liberr(c, rv, ts);
  }
}

/* When c next needs the network thread (UINT64_MAX: never). */
ngtcp2_tstamp nq_conn_deadline(nq_conn *c) {
  switch (c->state) {
  case NQ_CLOSING:
  case NQ_DRAINING:
    return c->close_deadline;
  case NQ_DEAD:
    return 0;
  default:
    return ngtcp2_conn_get_expiry(c->qc);
  }
}

int nq_conn_usable(const nq_conn *c) {
  return (c->state == NQ_HANDSHAKING || c->state == NQ_OPEN) && !c->close_requested;
}

/* Grant the MAX_STREAMS credit of the peer's streams that closed (RFC 9000 §4.6). */
void nq_conn_grant_streams(nq_conn *c) {
  if (c->state != NQ_OPEN && c->state != NQ_HANDSHAKING) {
    return;
  }
  if (c->grant_bidi > 0) {
    ngtcp2_conn_extend_max_streams_bidi(c->qc, (size_t)c->grant_bidi);
    c->grant_bidi = 0;
    c->want_write = 1;
  }
  if (c->grant_uni > 0) {
    ngtcp2_conn_extend_max_streams_uni(c->qc, (size_t)c->grant_uni);
    c->grant_uni = 0;
    c->want_write = 1;
  }
}

/* The largest DATAGRAM payload that fits both the peer's max_datagram_frame_size (RFC 9221
 * §3) and one packet on the current path (RFC 9221 §5: a DATAGRAM frame is never split). */
size_t nq_conn_max_datagram_payload(nq_conn *c) {
  const ngtcp2_transport_params *rp = ngtcp2_conn_get_remote_transport_params(c->qc);
  /* frame: type and a length varint (4 bytes up to 2^30); packet: short header byte, DCID,
   * packet number (up to 4 bytes), AEAD tag (16 bytes). */
  size_t frame_overhead = 1 + 4;
  size_t pkt_overhead = 1 + ngtcp2_conn_get_dcid(c->qc)->datalen + 4 + 16;
  size_t frame_max, pkt_max;
  if (rp == NULL || rp->max_datagram_frame_size == 0) {
    return 0;
  }
  frame_max = rp->max_datagram_frame_size > 65535 ? 65535 : (size_t)rp->max_datagram_frame_size;
  pkt_max = ngtcp2_conn_get_path_max_tx_udp_payload_size(c->qc);
  if (rp->max_udp_payload_size < pkt_max) {
    pkt_max = (size_t)rp->max_udp_payload_size;
  }
  if (frame_max <= frame_overhead || pkt_max <= pkt_overhead + frame_overhead) {
    return 0;
  }
  frame_max -= frame_overhead;
  pkt_max -= pkt_overhead + frame_overhead;
  return frame_max < pkt_max ? frame_max : pkt_max;
}
