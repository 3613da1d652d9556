/*
 * Hash maps: uint64 -> pointer (connection handles, stream IDs) and connection ID ->
 * connection (datagram dispatch, RFC 9000 §5.2).
 */
#include "nq.h"

#include <gnutls/crypto.h>
#include <stdlib.h>
#include <string.h>

/* ---- uint64 -> pointer: linear probing, backward-shift deletion -------------------------- */

static uint64_t mix64(uint64_t x) {
  /* splitmix64's finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

static size_t u64map_find(const nq_u64map *m, uint64_t key) {
  size_t mask = m->cap - 1;
  size_t i = (size_t)mix64(key) & mask;
  while (m->vals[i] != NULL && m->keys[i] != key) {
    i = (i + 1) & mask;
  }
  return i;
}

void *nq_u64map_get(const nq_u64map *m, uint64_t key) {
  if (m->cap == 0) {
    return NULL;
  }
  return m->vals[u64map_find(m, key)];
}

static int u64map_grow(nq_u64map *m) {
  size_t cap = m->cap ? m->cap * 2 : 16;
  nq_u64map bigger = {0};
  if (cap < m->cap) {
    return -1;
  }
  bigger.keys = calloc(cap, sizeof(*bigger.keys));
  bigger.vals = calloc(cap, sizeof(*bigger.vals));
  if (bigger.keys == NULL || bigger.vals == NULL) {
    free(bigger.keys);
    free(bigger.vals);
    return -1;
  }
  bigger.cap = cap;
  for (size_t i = 0; i < m->cap; ++i) {
    if (m->vals[i] != NULL) {
      size_t j = u64map_find(&bigger, m->keys[i]);
      bigger.keys[j] = m->keys[i];
      bigger.vals[j] = m->vals[i];
      ++bigger.len;
    }
  }
  nq_u64map_free(m);
  *m = bigger;
  return 0;
}

int nq_u64map_put(nq_u64map *m, uint64_t key, void *val) {
  size_t i;
  if ((m->len + 1) * 2 > m->cap && u64map_grow(m) != 0) {
    return -1;
  }
  i = u64map_find(m, key);
  if (m->vals[i] == NULL) {
    ++m->len;
  }
  m->keys[i] = key;
  m->vals[i] = val;
  return 0;
}

void nq_u64map_del(nq_u64map *m, uint64_t key) {
  size_t mask, i, j;
  if (m->cap == 0) {
    return;
  }
  mask = m->cap - 1;
  i = u64map_find(m, key);
  if (m->vals[i] == NULL) {
    return;
  }
  m->vals[i] = NULL;
  --m->len;
  /* Move later entries of the probe run back into the hole, so lookups need no tombstones. */
  for (j = (i + 1) & mask; m->vals[j] != NULL; j = (j + 1) & mask) {
    size_t home = (size_t)mix64(m->keys[j]) & mask;
    int movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
    if (movable) {
      m->keys[i] = m->keys[j];
      m->vals[i] = m->vals[j];
      m->vals[j] = NULL;
      i = j;
    }
  }
}

void nq_u64map_free(nq_u64map *m) {
  free(m->keys);
  free(m->vals);
  memset(m, 0, sizeof(*m));
}

/* ---- connection ID -> connection: keyed hash, chained buckets ---------------------------- */

int nq_cidmap_init(nq_cidmap *m, size_t nbuckets) {
  size_t n = 64;
  while (n < nbuckets && n < ((size_t)1 << 20)) {
    n *= 2;
  }
  m->buckets = calloc(n, sizeof(*m->buckets));
  if (m->buckets == NULL) {
    return -1;
  }
  m->nbuckets = n;
  if (gnutls_rnd(GNUTLS_RND_NONCE, m->key, sizeof(m->key)) != 0) {
    free(m->buckets);
    m->buckets = NULL;
    return -1;
  }
  return 0;
}

static size_t cid_bucket(const nq_cidmap *m, const uint8_t *id, size_t len) {
  uint64_t k0, k1, h;
  memcpy(&k0, m->key, 8);
  memcpy(&k1, m->key + 8, 8);
  h = k0 ^ len;
  while (len > 0) { /* eight bytes per round */
    uint64_t w = 0;
    size_t n = len < 8 ? len : 8;
    memcpy(&w, id, n);
    h = mix64(h ^ w ^ k1);
    id += n;
    len -= n;
  }
  return (size_t)h & (m->nbuckets - 1);
}

nq_conn *nq_cidmap_get(const nq_cidmap *m, const uint8_t *id, size_t len) {
  const nq_cident *e;
  if (len > NGTCP2_MAX_CIDLEN) {
    return NULL;
  }
  for (e = m->buckets[cid_bucket(m, id, len)]; e != NULL; e = e->bucket_next) {
    if (e->len == len && memcmp(e->id, id, len) == 0) {
      return e->conn;
    }
  }
  return NULL;
}

int nq_cidmap_add(nq_cidmap *m, nq_conn *conn, const uint8_t *id, size_t len) {
  nq_cident *e;
  size_t b;
  if (len > NGTCP2_MAX_CIDLEN) {
    return -1;
  }
  if (nq_cidmap_get(m, id, len) != NULL) {
    return -1; /* taken (by chance, or a client reusing another connection's ID) */
  }
  e = calloc(1, sizeof(*e));
  if (e == NULL) {
    return -1;
  }
  e->conn = conn;
  e->len = (uint8_t)len;
  memcpy(e->id, id, len);
  b = cid_bucket(m, id, len);
  e->bucket_next = m->buckets[b];
  m->buckets[b] = e;
  e->conn_next = conn->cids;
  conn->cids = e;
  return 0;
}

static void cidmap_unlink_bucket(nq_cidmap *m, nq_cident *e) {
  nq_cident **pp = &m->buckets[cid_bucket(m, e->id, e->len)];
  while (*pp != NULL && *pp != e) {
    pp = &(*pp)->bucket_next;
  }
  if (*pp == e) {
    *pp = e->bucket_next;
  }
}

void nq_cidmap_remove(nq_cidmap *m, nq_conn *conn, const uint8_t *id, size_t len) {
  nq_cident **pp = &conn->cids;
  while (*pp != NULL) {
    nq_cident *e = *pp;
    if (e->len == len && memcmp(e->id, id, len) == 0) {
      *pp = e->conn_next;
      cidmap_unlink_bucket(m, e);
      free(e);
      return;
    }
    pp = &e->conn_next;
  }
}

void nq_cidmap_remove_conn(nq_cidmap *m, nq_conn *conn) {
  nq_cident *e = conn->cids;
  while (e != NULL) {
    nq_cident *next = e->conn_next;
    cidmap_unlink_bucket(m, e);
    free(e);
    e = next;
  }
  conn->cids = NULL;
}

void nq_cidmap_free(nq_cidmap *m) {
  free(m->buckets); /* entries belong to connections, freed with them */
  m->buckets = NULL;
  m->nbuckets = 0;
}
