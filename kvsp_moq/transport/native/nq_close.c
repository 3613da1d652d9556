/*
 * The end of a connection, in one place: our close (CONNECTION_CLOSE sent, then the closing
 * period, RFC 9000 §10.2.1), the peer's (the draining period, RFC 9000 §10.2.2), and drops
 * without a packet (idle timeout, RFC 9000 §10.1; a handshake that timed out; what ngtcp2
 * says to drop). Each queues the connection's one "closed" event.
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>

/* Closing and draining last three times the PTO (RFC 9000 §10.2). */
static ngtcp2_tstamp end_of_period(nq_conn *c, ngtcp2_tstamp ts) {
  return ts + 3 * ngtcp2_conn_get_pto(c->qc);
}

static void send_close_packet(nq_conn *c) {
  const ngtcp2_path *path = ngtcp2_conn_get_path(c->qc);
  nq_udp_send(&c->ep->udp, path->remote.addr, path->remote.addrlen, c->cc_pkt, c->cc_pktlen,
              0);
  c->bytes_sent += c->cc_pktlen;
}

/* Send CONNECTION_CLOSE with ccerr and enter the closing period; without a packet to send
 * (ngtcp2 has nothing to protect it with yet), the connection just goes. */
static void close_with(nq_conn *c, const ngtcp2_connection_close_error *ccerr,
                       ngtcp2_tstamp ts) {
  size_t cap = c->ep->cfg.max_udp_payload;
  ngtcp2_path_storage ps;
  ngtcp2_pkt_info pi;
  ngtcp2_ssize n;
  if (c->state == NQ_CLOSING || c->state == NQ_DRAINING || c->state == NQ_DEAD) {
    return;
  }
  (void)nq_emit_closed(c, ccerr->error_code, ccerr->reason, ccerr->reasonlen,
                       ccerr->type == NGTCP2_CONNECTION_CLOSE_ERROR_CODE_TYPE_APPLICATION, 0);
  c->state = NQ_DEAD;
  c->cc_pkt = malloc(cap);
  if (c->cc_pkt == NULL) {
    return;
  }
  ngtcp2_path_storage_zero(&ps);
  n = ngtcp2_conn_write_connection_close(c->qc, &ps.path, &pi, c->cc_pkt, cap, ccerr, ts);
  if (n <= 0) {
    return;
  }
  c->cc_pktlen = (size_t)n;
  send_close_packet(c);
  c->state = NQ_CLOSING;
  c->close_deadline = end_of_period(c, ts);
}

void nq_conn_close_local(nq_conn *c, uint64_t code, int app, const uint8_t *reason,
                         size_t reasonlen, ngtcp2_tstamp ts) {
  ngtcp2_connection_close_error ccerr;
  ngtcp2_connection_close_error_default(&ccerr);
  if (reasonlen > NQ_MAX_REASON) {
    reasonlen = NQ_MAX_REASON;
  }
  if (app) {
    ngtcp2_connection_close_error_set_application_error(&ccerr, code, reason, reasonlen);
  } else {
    ngtcp2_connection_close_error_set_transport_error(&ccerr, code, reason, reasonlen);
  }
  close_with(c, &ccerr, ts);
}

/* Close for an ngtcp2 error: its QUIC transport error code (RFC 9000 §20.1). */
void nq_conn_close_liberr(nq_conn *c, int liberr, ngtcp2_tstamp ts) {
  ngtcp2_connection_close_error ccerr;
  const char *why = ngtcp2_strerror(liberr);
  ngtcp2_connection_close_error_default(&ccerr);
  ngtcp2_connection_close_error_set_transport_error_liberr(&ccerr, liberr, (const uint8_t *)why,
                                                           strlen(why));
  close_with(c, &ccerr, ts);
}

/* A TLS failure: CRYPTO_ERROR carrying the alert (0x100 + alert, RFC 9001 §4.8), the alert's
 * name as the reason. */
static void close_tls(nq_conn *c, ngtcp2_tstamp ts) {
  ngtcp2_connection_close_error ccerr;
  uint8_t alert = ngtcp2_conn_get_tls_alert(c->qc);
  const char *name = gnutls_alert_get_name((gnutls_alert_description_t)alert);
  if (name == NULL) {
    name = "TLS handshake failed";
  }
  ngtcp2_connection_close_error_default(&ccerr);
  ngtcp2_connection_close_error_set_transport_error_tls_alert(&ccerr, alert,
                                                              (const uint8_t *)name,
                                                              strlen(name));
  close_with(c, &ccerr, ts);
}

/* Ask the network thread to close c (from Python, or from inside an ngtcp2 callback where
 * ngtcp2 may not be called). The first request wins. */
int nq_conn_request_close(nq_conn *c, uint64_t code, int app, const uint8_t *reason,
                          size_t reasonlen) {
  if (c->close_requested) {
    return 0;
  }
  if (reasonlen > NQ_MAX_REASON) {
    reasonlen = NQ_MAX_REASON;
  }
  free(c->req_reason);
  c->req_reason = NULL;
  if (reasonlen > 0) {
    c->req_reason = malloc(reasonlen);
    if (c->req_reason == NULL) {
      return -1;
    }
    memcpy(c->req_reason, reason, reasonlen);
  }
  c->req_reasonlen = reasonlen;
  c->req_code = code;
  c->req_app = app;
  c->close_requested = 1;
  c->want_write = 1;
  return 0;
}

void nq_conn_process_request(nq_conn *c, ngtcp2_tstamp ts) {
  if (c->close_requested) {
    nq_conn_close_local(c, c->req_code, c->req_app, c->req_reason, c->req_reasonlen, ts);
  }
}

/* The peer closed (CONNECTION_CLOSE or a stateless reset): report its code and reason, then
 * stay silent for the draining period. */
void nq_conn_enter_draining(nq_conn *c, ngtcp2_tstamp ts) {
  ngtcp2_connection_close_error ccerr;
  ngtcp2_conn_get_connection_close_error(c->qc, &ccerr);
  (void)nq_emit_closed(c, ccerr.error_code, ccerr.reason, ccerr.reasonlen,
                       ccerr.type == NGTCP2_CONNECTION_CLOSE_ERROR_CODE_TYPE_APPLICATION, 1);
  c->state = NQ_DRAINING;
  c->close_deadline = end_of_period(c, ts);
}

/* Discard c without a packet. */
void nq_conn_drop(nq_conn *c, const char *why) {
  (void)nq_emit_closed(c, 0, (const uint8_t *)why, strlen(why), 0, 0);
  c->state = NQ_DEAD;
}

/* In the closing period, answer what still arrives with our CONNECTION_CLOSE again, less and
 * less often (RFC 9000 §10.2.1: an endpoint SHOULD limit the rate): on the 1st, 2nd, 4th,
 * 8th... packet. */
void nq_conn_repeat_close(nq_conn *c) {
  uint64_t n = ++c->cc_rx_count;
  if ((n & (n - 1)) == 0) {
    send_close_packet(c);
  }
}

/* What ngtcp2_conn_read_pkt's error means for the connection. */
void nq_conn_on_read_error(nq_conn *c, int liberr, ngtcp2_tstamp ts) {
  switch (liberr) {
  case NGTCP2_ERR_DRAINING:
    nq_conn_enter_draining(c, ts);
    break;
  case NGTCP2_ERR_DROP_CONN:
    nq_conn_drop(c, "dropped");
    break;
  case NGTCP2_ERR_RETRY:
    nq_conn_drop(c, "address validation required");
    break;
  case NGTCP2_ERR_RECV_VERSION_NEGOTIATION:
    nq_conn_drop(c, "version negotiation");
    break;
  case NGTCP2_ERR_CRYPTO:
    close_tls(c, ts);
    break;
  case NGTCP2_ERR_CALLBACK_FAILURE:
    if (c->close_requested) {
      nq_conn_process_request(c, ts);
      break;
    }
    nq_conn_close_liberr(c, NGTCP2_ERR_INTERNAL, ts);
    break;
  default:
    nq_conn_close_liberr(c, liberr, ts);
    break;
  }
}
