/*
 * The endpoint's UDP socket: batched receive (recvmmsg, with UDP_GRO coalescing datagrams of
 * one size into one message) and batched send (one sendmsg carries many QUIC packets of one
 * size with UDP_SEGMENT, the kernel's GSO).
 *
 * Sends are blocking with a short timeout (SO_SNDTIMEO): a full socket buffer is a brief wait
 * for the kernel, not a queue of our own; past the timeout the batch counts as lost (QUIC
 * recovers it, RFC 9002 §6).
 */
#include "nq.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

#define NQ_SOCKBUF (8 << 20)
#define NQ_SEND_TIMEOUT_US 20000

static void set_buffer(int fd, int force_opt, int opt) {
  int size = NQ_SOCKBUF;
  /* Beyond net.core.[rw]mem_max only with CAP_NET_ADMIN (the *FORCE options). */
  if (setsockopt(fd, SOL_SOCKET, force_opt, &size, sizeof(size)) != 0) {
    (void)setsockopt(fd, SOL_SOCKET, opt, &size, sizeof(size));
  }
}

/* Don't fragment (RFC 9000 §14: QUIC datagrams are sent with DF; ngtcp2's PMTUD probes rely
 * on the kernel refusing what does not fit). */
static void set_dont_fragment(int fd, int family) {
  int val;
  if (family == AF_INET6) {
    val = IPV6_PMTUDISC_DO;
    (void)setsockopt(fd, IPPROTO_IPV6, IPV6_MTU_DISCOVER, &val, sizeof(val));
  } else {
    val = IP_PMTUDISC_DO;
    (void)setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &val, sizeof(val));
  }
}

static int gso_supported(int fd) {
  int val = 0;
  socklen_t len = sizeof(val);
  return getsockopt(fd, SOL_UDP, UDP_SEGMENT, &val, &len) == 0;
}

static int enable_gro(int fd) {
  int one = 1;
  return setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof(one)) == 0;
}

static int open_bound(const struct addrinfo *ai, int reuse_port, char *err, size_t errlen) {
  struct timeval tv = {0, NQ_SEND_TIMEOUT_US};
  int one = 1;
  int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, IPPROTO_UDP);
  if (fd < 0) {
    snprintf(err, errlen, "socket: %s", strerror(errno));
    return -1;
  }
  if (reuse_port && setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) != 0) {
    snprintf(err, errlen, "SO_REUSEPORT: %s", strerror(errno));
    close(fd);
    return -1;
  }
  set_buffer(fd, SO_RCVBUFFORCE, SO_RCVBUF);
  set_buffer(fd, SO_SNDBUFFORCE, SO_SNDBUF);
  set_dont_fragment(fd, ai->ai_family);
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    snprintf(err, errlen, "bind: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

int nq_udp_open(nq_udp *u, const char *host, int port, int gso, int gro, int reuse_port,
                char *err, size_t errlen) {
  struct addrinfo hints, *res = NULL;
  char portstr[16];
  int rv;
  memset(u, 0, sizeof(*u));
  u->fd = -1;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  snprintf(portstr, sizeof(portstr), "%d", port);
  rv = getaddrinfo(host, portstr, &hints, &res);
  if (rv != 0) {
    snprintf(err, errlen, "cannot resolve %s: %s", host, gai_strerror(rv));
    return -1;
  }
  u->fd = open_bound(res, reuse_port, err, errlen);
  freeaddrinfo(res);
  if (u->fd < 0) {
    return -1;
  }
  u->locallen = sizeof(u->local);
  if (getsockname(u->fd, (struct sockaddr *)&u->local, &u->locallen) != 0) {
    snprintf(err, errlen, "getsockname: %s", strerror(errno));
    nq_udp_close(u);
    return -1;
  }
  u->gso = gso && gso_supported(u->fd);
  u->gro = gro && enable_gro(u->fd);
  u->rxbuf = malloc((size_t)NQ_RECV_BATCH * NQ_RECV_BUFSIZE);
  if (u->rxbuf == NULL) {
    snprintf(err, errlen, "out of memory");
    nq_udp_close(u);
    return -1;
  }
  return 0;
}

void nq_udp_close(nq_udp *u) {
  if (u->fd >= 0) {
    close(u->fd);
    u->fd = -1;
  }
  free(u->rxbuf);
  u->rxbuf = NULL;
}

/* The segment size of a GRO message (0: one datagram). */
static size_t gro_segment_size(struct msghdr *msg) {
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm != NULL; cm = CMSG_NXTHDR(msg, cm)) {
    if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO &&
        cm->cmsg_len >= CMSG_LEN(sizeof(int))) {
      int size;
      memcpy(&size, CMSG_DATA(cm), sizeof(size));
      return size > 0 ? (size_t)size : 0;
    }
  }
  return 0;
}

/* Hand each datagram of one message to cb: a GRO message is split at its segment size. */
static void deliver(struct mmsghdr *m, const uint8_t *buf, nq_datagram_cb cb, void *arg) {
  size_t len = m->msg_len;
  size_t seg = gro_segment_size(&m->msg_hdr);
  const struct sockaddr *from = m->msg_hdr.msg_name;
  socklen_t fromlen = m->msg_hdr.msg_namelen;
  if (m->msg_hdr.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    return; /* never whole: drop it */
  }
  if (seg == 0 || seg > len) {
    seg = len;
  }
  while (len > 0) {
    size_t n = len < seg ? len : seg;
    cb(arg, from, fromlen, buf, n);
    buf += n;
    len -= n;
  }
}

/* Read up to NQ_RECV_BATCH messages without blocking and deliver them; returns how many were
 * read (NQ_RECV_BATCH: there may be more), 0 when none. */
int nq_udp_recv_batch(nq_udp *u, nq_datagram_cb cb, void *arg) {
  struct mmsghdr msgs[NQ_RECV_BATCH];
  struct iovec iov[NQ_RECV_BATCH];
  struct sockaddr_storage from[NQ_RECV_BATCH];
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctrl[NQ_RECV_BATCH];
  int n;
  memset(msgs, 0, sizeof(msgs));
  for (int i = 0; i < NQ_RECV_BATCH; ++i) {
    iov[i].iov_base = u->rxbuf + (size_t)i * NQ_RECV_BUFSIZE;
    iov[i].iov_len = NQ_RECV_BUFSIZE;
    msgs[i].msg_hdr.msg_name = &from[i];
    msgs[i].msg_hdr.msg_namelen = sizeof(from[i]);
    msgs[i].msg_hdr.msg_iov = &iov[i];
    msgs[i].msg_hdr.msg_iovlen = 1;
    msgs[i].msg_hdr.msg_control = ctrl[i].buf;
    msgs[i].msg_hdr.msg_controllen = sizeof(ctrl[i].buf);
  }
  do {
    n = recvmmsg(u->fd, msgs, NQ_RECV_BATCH, MSG_DONTWAIT, NULL);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) {
    return 0;
  }
  for (int i = 0; i < n; ++i) {
    deliver(&msgs[i], iov[i].iov_base, cb, arg);
  }
  return n;
}

static ssize_t send_one(int fd, const struct sockaddr *to, socklen_t tolen, const uint8_t *data,
                        size_t len, size_t gso_size) {
  struct iovec iov = {(void *)data, len};
  struct msghdr msg;
  union {
    char buf[CMSG_SPACE(sizeof(uint16_t))];
    struct cmsghdr align;
  } ctrl;
  ssize_t rv;
  memset(&msg, 0, sizeof(msg));
  msg.msg_name = (void *)to;
  msg.msg_namelen = tolen;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (gso_size > 0 && len > gso_size) {
    uint16_t seg = (uint16_t)gso_size;
    struct cmsghdr *cm;
    memset(&ctrl, 0, sizeof(ctrl));
    msg.msg_control = ctrl.buf;
    msg.msg_controllen = sizeof(ctrl.buf);
    cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof(seg));
    memcpy(CMSG_DATA(cm), &seg, sizeof(seg));
  }
  do {
    rv = sendmsg(fd, &msg, 0);
  } while (rv < 0 && errno == EINTR);
  return rv;
}

/* Send len bytes of packets of gso_size bytes each (the last may be shorter) to one peer. */
void nq_udp_send(nq_udp *u, const struct sockaddr *to, socklen_t tolen, const uint8_t *data,
                 size_t len, size_t gso_size) {
  if (gso_size == 0 || gso_size >= len) {
    if (send_one(u->fd, to, tolen, data, len, 0) < 0) {
      ++u->tx_dropped;
    }
    return;
  }
  if (u->gso) {
    if (send_one(u->fd, to, tolen, data, len, gso_size) >= 0) {
      return;
    }
    if (errno != EIO && errno != EINVAL) {
      ++u->tx_dropped;
      return;
    }
    u->gso = 0; /* the device cannot segment: one packet per sendmsg from now on */
  }
  while (len > 0) {
    size_t n = len < gso_size ? len : gso_size;
    if (send_one(u->fd, to, tolen, data, n, 0) < 0) {
      ++u->tx_dropped;
    }
    data += n;
    len -= n;
  }
}
