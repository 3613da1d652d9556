/*
 * The endpoint: its creation and teardown, the network thread's loop (receive a batch,
 * service timers and requests, write, sleep in ppoll until a datagram, a timer or Python),
 * and the dispatch of each received datagram to its connection (RFC 9000 §5.2).
 */
#include "nq.h"

#include <errno.h>
#include <gnutls/crypto.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

ngtcp2_tstamp nq_now(void) {
  struct timespec tp;
  clock_gettime(CLOCK_MONOTONIC, &tp);
  return (ngtcp2_tstamp)tp.tv_sec * NGTCP2_SECONDS + (ngtcp2_tstamp)tp.tv_nsec;
}

/* ---- the lock ------------------------------------------------------------------------ */

void nq_endpoint_lock(nq_endpoint *ep) {
  atomic_fetch_add(&ep->waiters, 1);
  pthread_mutex_lock(&ep->lock);
  atomic_fetch_sub(&ep->waiters, 1);
}

int nq_endpoint_trylock(nq_endpoint *ep) {
  return pthread_mutex_trylock(&ep->lock) == 0;
}

void nq_endpoint_unlock(nq_endpoint *ep) {
  pthread_mutex_unlock(&ep->lock);
}

/* The network thread lets waiting Python calls in before it takes the lock again (a mutex
 * does not queue: the thread would otherwise win every time it loops). */
static void thread_unlock(nq_endpoint *ep) {
  pthread_mutex_unlock(&ep->lock);
  for (int i = 0; i < 1000 && atomic_load(&ep->waiters) > 0; ++i) {
    sched_yield();
  }
}

void nq_endpoint_wake(nq_endpoint *ep) {
  uint64_t one = 1;
  ssize_t rv = write(ep->wake_fd, &one, sizeof(one));
  (void)rv;
}

/* ---- connections ---------------------------------------------------------------------- */

void nq_endpoint_add_conn(nq_endpoint *ep, nq_conn *c) {
  c->prev = NULL;
  c->next = ep->conns;
  if (ep->conns != NULL) {
    ep->conns->prev = c;
  }
  ep->conns = c;
  ++ep->nconns;
  if (nq_u64map_put(&ep->conns_by_handle, c->handle, c) != 0) {
    c->state = NQ_DEAD; /* out of memory: Python cannot reach it; it goes at once */
  }
}

nq_conn *nq_endpoint_conn(nq_endpoint *ep, uint64_t handle) {
  return nq_u64map_get(&ep->conns_by_handle, handle);
}

/* ---- datagrams in ---------------------------------------------------------------------- */

/* RFC 9000 §6.1: a server answers a version it does not support with Version Negotiation,
 * only for a datagram a client could have sent as its first (at least 1200 bytes, §14.1),
 * and never for a Version Negotiation packet. */
static void send_version_negotiation(nq_endpoint *ep, const ngtcp2_version_cid *vc,
                                     const struct sockaddr *to, socklen_t tolen, size_t len) {
  uint8_t buf[1 + 4 + 1 + 255 + 1 + 255 + 8];
  uint32_t versions[] = {NGTCP2_PROTO_VER_V1};
  uint8_t unused;
  ngtcp2_ssize n;
  if (!ep->cfg.server || len < NGTCP2_MAX_UDP_PAYLOAD_SIZE || vc->version == 0) {
    return;
  }
  (void)gnutls_rnd(GNUTLS_RND_NONCE, &unused, 1);
  n = ngtcp2_pkt_write_version_negotiation(buf, sizeof(buf), unused, vc->scid, vc->scidlen,
                                           vc->dcid, vc->dcidlen, versions, 1);
  if (n > 0) {
    nq_udp_send(&ep->udp, to, tolen, buf, (size_t)n, 0);
  }
}

/* A datagram for no connection of ours: a server takes a valid client Initial as a new
 * connection (unless it is full, or Python is not draining events); the rest is dropped. */
static void accept_connection(nq_endpoint *ep, const struct sockaddr *from, socklen_t fromlen,
                              const uint8_t *pkt, size_t len, ngtcp2_tstamp ts) {
  ngtcp2_pkt_hd hd;
  nq_conn *c;
  if (!ep->cfg.server || ep->nconns >= ep->cfg.max_connections ||
      ep->ev_bytes > NQ_ACCEPT_QUEUE_BYTES + ep->cfg.initial_max_data) {
    return;
  }
  if (ngtcp2_accept(&hd, pkt, len) != 0) {
    return; /* not an acceptable first Initial (RFC 9000 §14.1, §17.2.2) */
  }
  c = nq_conn_new_server(ep, from, fromlen, &hd);
  if (c != NULL) {
    nq_conn_on_packet(c, from, fromlen, pkt, len, ts);
  }
}

static void on_datagram(void *arg, const struct sockaddr *from, socklen_t fromlen,
                        const uint8_t *data, size_t len) {
  nq_endpoint *ep = arg;
  ngtcp2_version_cid vc;
  nq_conn *c;
  ngtcp2_tstamp ts = nq_now();
  int rv = ngtcp2_pkt_decode_version_cid(&vc, data, len, NQ_SCID_LEN);
  if (rv == NGTCP2_ERR_VERSION_NEGOTIATION) {
    send_version_negotiation(ep, &vc, from, fromlen, len);
    return;
  }
  if (rv != 0 || vc.dcidlen > NGTCP2_MAX_CIDLEN) {
    return; /* not a QUIC packet we can route */
  }
  c = nq_cidmap_get(&ep->cids, vc.dcid, vc.dcidlen);
  if (c == NULL) {
    accept_connection(ep, from, fromlen, data, len, ts);
    return;
  }
  nq_conn_on_packet(c, from, fromlen, data, len, ts);
}

/* ---- the network thread ----------------------------------------------------------------- */

/* Timers, Python's requests and writes for every connection; returns 1 when one still has
 * packets to send now (the thread comes back without sleeping). */
static int service(nq_endpoint *ep) {
  ngtcp2_tstamp ts = nq_now();
  int busy = 0;
  nq_conn *c = ep->conns;
  while (c != NULL) {
    nq_conn *next = c->next;
    if (nq_conn_deadline(c) <= ts) {
      nq_conn_on_timer(c, ts);
    }
    nq_conn_process_request(c, ts);
    if (c->want_write) {
      busy |= nq_conn_write(c, ts);
    }
    if (c->state == NQ_DEAD) {
      nq_conn_free(c);
    }
    c = next;
  }
  return busy;
}

/* How long the thread may sleep: until the earliest connection deadline. */
static int sleep_for(nq_endpoint *ep, struct timespec *tv) {
  ngtcp2_tstamp ts = nq_now();
  ngtcp2_tstamp earliest = UINT64_MAX;
  for (nq_conn *c = ep->conns; c != NULL; c = c->next) {
    ngtcp2_tstamp d = nq_conn_deadline(c);
    if (d < earliest) {
      earliest = d;
    }
  }
  if (earliest == UINT64_MAX) {
    return 0; /* no deadline: sleep until a datagram or Python */
  }
  earliest = earliest > ts ? earliest - ts : 0;
  tv->tv_sec = (time_t)(earliest / NGTCP2_SECONDS);
  tv->tv_nsec = (long)(earliest % NGTCP2_SECONDS);
  return 1;
}

static void wait_for_work(nq_endpoint *ep, const struct timespec *tv) {
  struct pollfd fds[2] = {{ep->udp.fd, POLLIN, 0}, {ep->wake_fd, POLLIN, 0}};
  uint64_t counter;
  if (ppoll(fds, 2, tv, NULL) > 0 && (fds[1].revents & POLLIN)) {
    ssize_t rv = read(ep->wake_fd, &counter, sizeof(counter));
    (void)rv;
  }
}

/* On the way out: CONNECTION_CLOSE (NO_ERROR) to every open connection, then free them. */
static void close_all(nq_endpoint *ep) {
  ngtcp2_tstamp ts = nq_now();
  while (ep->conns != NULL) {
    nq_conn *c = ep->conns;
    nq_conn_close_local(c, NGTCP2_NO_ERROR, 0, (const uint8_t *)"endpoint closed", 15, ts);
    nq_conn_free(c);
  }
}

static void *thread_main(void *arg) {
  nq_endpoint *ep = arg;
  static const struct timespec zero = {0, 0};
  struct timespec tv;
  /* Pacing sleeps are tens of microseconds: the default timer slack (50 us) would add as
   * much to each (prctl(2) PR_SET_TIMERSLACK; 1 ns: the timer fires when due). */
  (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  nq_endpoint_lock(ep);
  while (!ep->stopping) {
    int more = nq_udp_recv_batch(&ep->udp, on_datagram, ep) == NQ_RECV_BATCH;
    int busy = service(ep);
    int timed = sleep_for(ep, &tv);
    thread_unlock(ep);
    wait_for_work(ep, more || busy ? &zero : timed ? &tv : NULL);
    nq_endpoint_lock(ep);
  }
  close_all(ep);
  nq_endpoint_unlock(ep);
  return NULL;
}

/* ---- creation and teardown ------------------------------------------------------------- */

static int endpoint_init(nq_endpoint *ep, const char *host, int port,
                         const char *const *alpns, size_t nalpns, const char *cert_file,
                         const char *key_file, const char *ca_file, int verify, int gso,
                         int gro, char *err, size_t errlen) {
  if (nq_tls_init(&ep->tls, ep->cfg.server, alpns, nalpns, cert_file, key_file, ca_file,
                  verify, err, errlen) != 0) {
    return -1;
  }
  ep->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  ep->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (ep->wake_fd < 0 || ep->event_fd < 0) {
    snprintf(err, errlen, "eventfd: %s", strerror(errno));
    return -1;
  }
  if (nq_cidmap_init(&ep->cids, ep->cfg.max_connections * 4) != 0) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  ep->txbuf_size = NQ_GSO_MAX_BYTES + ep->cfg.max_udp_payload;
  ep->txbuf = malloc(ep->txbuf_size);
  if (ep->txbuf == NULL) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  return nq_udp_open(&ep->udp, host, port, gso, gro, ep->cfg.reuse_port, err, errlen);
}

nq_endpoint *nq_endpoint_new(const nq_config *cfg, const char *host, int port,
                             const char *const *alpns, size_t nalpns, const char *cert_file,
                             const char *key_file, const char *ca_file, int verify, int gso,
                             int gro, char *err, size_t errlen) {
  nq_endpoint *ep = calloc(1, sizeof(*ep));
  int rv;
  if (ep == NULL) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  ep->cfg = *cfg;
  ep->remote_uni_lingers = ngtcp2_version(0)->version_num < 0x000e00;
  ep->wake_fd = ep->event_fd = ep->udp.fd = -1;
  pthread_mutex_init(&ep->lock, NULL);
  atomic_init(&ep->waiters, 0);
  if (endpoint_init(ep, host, port, alpns, nalpns, cert_file, key_file, ca_file, verify, gso,
                    gro, err, errlen) != 0) {
    nq_endpoint_free(ep);
    return NULL;
  }
  rv = pthread_create(&ep->thread, NULL, thread_main, ep);
  if (rv != 0) {
    snprintf(err, errlen, "pthread_create: %s", strerror(rv));
    nq_endpoint_free(ep);
    return NULL;
  }
  ep->thread_started = 1;
  (void)pthread_setname_np(ep->thread, "kvsp-nq-net"); /* per-thread CPU in /proc, top -H */
  return ep;
}

/* Stop the network thread (it closes every connection first) and wait for it, at most
 * timeout_ms. Returns 0 once it is gone, -1 if it did not finish in time. */
int nq_endpoint_stop(nq_endpoint *ep, int timeout_ms) {
  struct timespec deadline;
  if (!ep->thread_started) {
    return 0;
  }
  nq_endpoint_lock(ep);
  ep->stopping = 1;
  nq_endpoint_unlock(ep);
  nq_endpoint_wake(ep);
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  if (pthread_timedjoin_np(ep->thread, NULL, &deadline) != 0) {
    return -1;
  }
  ep->thread_started = 0;
  nq_hasher_stop(&ep->hasher); /* after the network thread: nothing submits any more */
  return 0;
}

/* Free everything; the thread must be gone (nq_endpoint_stop returned 0). */
void nq_endpoint_free(nq_endpoint *ep) {
  while (ep->conns != NULL) {
    nq_conn_free(ep->conns);
  }
  nq_events_free_list(ep->ev_head);
  /* Held chunks not released by the binding (it releases them after nq_endpoint_stop): their
   * Python buffers cannot be released without the GIL, so they stay held (a bounded leak). */
  while (ep->released != NULL) {
    nq_chunk *c = ep->released;
    ep->released = c->next;
    free(c);
  }
  nq_u64map_free(&ep->conns_by_handle);
  nq_cidmap_free(&ep->cids);
  nq_udp_close(&ep->udp);
  nq_tls_free(&ep->tls);
  if (ep->wake_fd >= 0) {
    close(ep->wake_fd);
  }
  if (ep->event_fd >= 0) {
    close(ep->event_fd);
  }
  free(ep->txbuf);
  pthread_mutex_destroy(&ep->lock);
  free(ep);
}
