/*
 * TLS 1.3 for QUIC over GnuTLS (RFC 9001): the endpoint's credentials, and a session per
 * connection configured for ngtcp2_crypto_gnutls (which carries the handshake in CRYPTO
 * frames and installs the packet protection keys).
 *
 * ALPN is mandatory (RFC 9001 §8.1): a server selects the first of its protocols the client
 * offers and refuses a client offering none of them with no_application_protocol (which
 * ngtcp2 sends as CRYPTO_ERROR 0x100 + 120 = 0x178). A client verifies the server's
 * certificate chain and name during the handshake unless told not to.
 */
#include "nq.h"

#include <arpa/inet.h>
#include <ngtcp2/ngtcp2_crypto_gnutls.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* TLS 1.3 only (RFC 9001 §4.2), the AEADs QUIC defines header protection for (RFC 9001
 * §5.3, §5.4), no middlebox compatibility mode (RFC 9001 §8.4). */
static const char PRIORITY[] =
    "NORMAL:-VERS-ALL:+VERS-TLS1.3:-CIPHER-ALL:+AES-128-GCM:+AES-256-GCM:"
    "+CHACHA20-POLY1305:+AES-128-CCM:-GROUP-ALL:+GROUP-X25519:+GROUP-SECP256R1:"
    "+GROUP-SECP384R1:+GROUP-SECP521R1:%DISABLE_TLS13_COMPAT_MODE";

static int set_alpns(nq_tls *t, const char *const *alpns, size_t nalpns, char *err,
                     size_t errlen) {
  t->alpns = calloc(nalpns, sizeof(*t->alpns));
  if (t->alpns == NULL) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  for (size_t i = 0; i < nalpns; ++i) {
    size_t len = strlen(alpns[i]);
    if (len == 0 || len > 255) {
      snprintf(err, errlen, "an ALPN protocol name is 1 to 255 bytes");
      return -1;
    }
    t->alpns[i].data = (unsigned char *)strdup(alpns[i]);
    if (t->alpns[i].data == NULL) {
      snprintf(err, errlen, "out of memory");
      return -1;
    }
    t->alpns[i].size = (unsigned)len;
    t->nalpns = i + 1;
  }
  return 0;
}

static int load_credentials(nq_tls *t, const char *cert_file, const char *key_file,
                            const char *ca_file, char *err, size_t errlen) {
  int rv = gnutls_certificate_allocate_credentials(&t->cred);
  if (rv != 0) {
    snprintf(err, errlen, "gnutls: %s", gnutls_strerror(rv));
    return -1;
  }
  if (t->server) {
    rv = gnutls_certificate_set_x509_key_file(t->cred, cert_file, key_file,
                                              GNUTLS_X509_FMT_PEM);
    if (rv != 0) {
      snprintf(err, errlen, "cannot load %s / %s: %s", cert_file, key_file,
               gnutls_strerror(rv));
      return -1;
    }
    return 0;
  }
  if (!t->verify) {
    return 0;
  }
  rv = ca_file != NULL
           ? gnutls_certificate_set_x509_trust_file(t->cred, ca_file, GNUTLS_X509_FMT_PEM)
           : gnutls_certificate_set_x509_system_trust(t->cred);
  if (rv <= 0) {
    snprintf(err, errlen, "no trust anchors from %s%s%s", ca_file ? ca_file : "the system",
             rv < 0 ? ": " : "", rv < 0 ? gnutls_strerror(rv) : "");
    return -1;
  }
  return 0;
}

int nq_tls_init(nq_tls *t, int server, const char *const *alpns, size_t nalpns,
                const char *cert_file, const char *key_file, const char *ca_file, int verify,
                char *err, size_t errlen) {
  int rv;
  memset(t, 0, sizeof(*t));
  t->server = server;
  t->verify = verify;
  if (nalpns == 0) {
    snprintf(err, errlen, "at least one ALPN protocol is needed (RFC 9001 §8.1)");
    return -1;
  }
  if (server && (cert_file == NULL || key_file == NULL)) {
    snprintf(err, errlen, "a server needs cert_file and key_file");
    return -1;
  }
  if (set_alpns(t, alpns, nalpns, err, errlen) != 0 ||
      load_credentials(t, cert_file, key_file, ca_file, err, errlen) != 0) {
    return -1;
  }
  rv = gnutls_priority_init(&t->prio, PRIORITY, NULL);
  if (rv != 0) {
    snprintf(err, errlen, "gnutls priority: %s", gnutls_strerror(rv));
    return -1;
  }
  return 0;
}

void nq_tls_free(nq_tls *t) {
  for (size_t i = 0; i < t->nalpns; ++i) {
    free(t->alpns[i].data);
  }
  free(t->alpns);
  if (t->cred != NULL) {
    gnutls_certificate_free_credentials(t->cred);
  }
  if (t->prio != NULL) {
    gnutls_priority_deinit(t->prio);
  }
  memset(t, 0, sizeof(*t));
}

/* Server: after the ClientHello, refuse a client whose ALPN list shares nothing with ours
 * (or that sent none): RFC 9001 §8.1. */
static int client_hello_hook(gnutls_session_t s, unsigned int htype, unsigned when,
                             unsigned int incoming, const gnutls_datum_t *msg) {
  gnutls_datum_t alpn;
  (void)htype;
  (void)when;
  (void)incoming;
  (void)msg;
  if (gnutls_alpn_get_selected_protocol(s, &alpn) != 0 || alpn.size == 0) {
    return GNUTLS_E_NO_APPLICATION_PROTOCOL;
  }
  return 0;
}

static int is_ip_literal(const char *name) {
  unsigned char buf[sizeof(struct in6_addr)];
  return inet_pton(AF_INET, name, buf) == 1 || inet_pton(AF_INET6, name, buf) == 1;
}

/* Client: SNI (never an IP literal, RFC 6066 §3) and, unless verify is off, verification of
 * the chain and of the name (or IP address) during the handshake. */
static int client_identity(const nq_tls *t, gnutls_session_t s, const char *server_name) {
  if (server_name == NULL || server_name[0] == '\0') {
    return t->verify ? -1 : 0;
  }
  if (!is_ip_literal(server_name) &&
      gnutls_server_name_set(s, GNUTLS_NAME_DNS, server_name, strlen(server_name)) != 0) {
    return -1;
  }
  if (t->verify) {
    gnutls_session_set_verify_cert(s, server_name, 0);
  }
  return 0;
}

static int session_configure(const nq_tls *t, gnutls_session_t s, const char *server_name,
                             ngtcp2_crypto_conn_ref *ref) {
  unsigned alpn_flags = GNUTLS_ALPN_MANDATORY;
  int rv = t->server ? ngtcp2_crypto_gnutls_configure_server_session(s)
                     : ngtcp2_crypto_gnutls_configure_client_session(s);
  if (rv != 0 || gnutls_priority_set(s, t->prio) != 0 ||
      gnutls_credentials_set(s, GNUTLS_CRD_CERTIFICATE, t->cred) != 0) {
    return -1;
  }
  if (t->server) {
    alpn_flags |= GNUTLS_ALPN_SERVER_PRECEDENCE;
    gnutls_handshake_set_hook_function(s, GNUTLS_HANDSHAKE_CLIENT_HELLO, GNUTLS_HOOK_POST,
                                       client_hello_hook);
  } else if (client_identity(t, s, server_name) != 0) {
    return -1;
  }
  if (gnutls_alpn_set_protocols(s, t->alpns, (unsigned)t->nalpns, alpn_flags) != 0) {
    return -1;
  }
  gnutls_session_set_ptr(s, ref);
  return 0;
}

int nq_tls_session_new(const nq_tls *t, const char *server_name, ngtcp2_crypto_conn_ref *ref,
                       gnutls_session_t *out) {
  gnutls_session_t s;
  /* No 0-RTT and no session tickets: every connection does a full handshake. */
  unsigned flags = (t->server ? GNUTLS_SERVER | GNUTLS_NO_AUTO_SEND_TICKET : GNUTLS_CLIENT) |
                   GNUTLS_NO_END_OF_EARLY_DATA;
  if (gnutls_init(&s, flags) != 0) {
    return -1;
  }
  if (session_configure(t, s, server_name, ref) != 0) {
    gnutls_deinit(s);
    return -1;
  }
  *out = s;
  return 0;
}

/* The negotiated ALPN protocol (length 0: none). */
size_t nq_tls_selected_alpn(gnutls_session_t s, const uint8_t **alpn) {
  gnutls_datum_t d;
  if (gnutls_alpn_get_selected_protocol(s, &d) != 0) {
    *alpn = NULL;
    return 0;
  }
  *alpn = d.data;
  return d.size;
}
