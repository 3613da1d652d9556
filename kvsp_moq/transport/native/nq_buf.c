/*
 * Byte chunks: received stream bytes waiting for Python (nq_bytes), and a stream's send
 * buffer (nq_sendbuf), which must keep every byte ngtcp2 was given until the peer
 * acknowledges it (ngtcp2 retransmits from our memory; RFC 9000 §13.3).
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>

nq_chunk *nq_chunk_new(size_t cap) {
  nq_chunk *c;
  if (cap > SIZE_MAX - sizeof(*c)) {
    return NULL;
  }
  c = malloc(sizeof(*c) + cap);
  if (c == NULL) {
    return NULL;
  }
  c->next = NULL;
  c->len = 0;
  c->cap = cap;
  c->ext = NULL;
  c->hold = NULL;
  return c;
}

/* Copy len bytes to the end of b, filling the tail chunk first; new chunks hold at least
 * chunk_size bytes. */
int nq_bytes_append(nq_bytes *b, const uint8_t *data, size_t len, size_t chunk_size) {
  while (len > 0) {
    nq_chunk *t = b->tail;
    size_t n;
    if (t == NULL || t->len == t->cap) {
      t = nq_chunk_new(len > chunk_size ? len : chunk_size);
      if (t == NULL) {
        return -1;
      }
      if (b->tail != NULL) {
        b->tail->next = t;
      } else {
        b->head = t;
      }
      b->tail = t;
    }
    n = t->cap - t->len;
    if (n > len) {
      n = len;
    }
    memcpy(t->data + t->len, data, n);
    t->len += n;
    b->len += n;
    data += n;
    len -= n;
  }
  return 0;
}

/* Copy every byte of b to dest, which holds b->len bytes. */
void nq_bytes_copy_out(const nq_bytes *b, uint8_t *dest) {
  for (const nq_chunk *c = b->head; c != NULL; c = c->next) {
    memcpy(dest, c->data, c->len);
    dest += c->len;
  }
}

void nq_bytes_clear(nq_bytes *b) {
  nq_chunk *c = b->head;
  while (c != NULL) {
    nq_chunk *next = c->next;
    free(c);
    c = next;
  }
  b->head = b->tail = NULL;
  b->len = 0;
}

/* ---- send buffers ------------------------------------------------------------------------ */

/* A chunk ngtcp2 no longer points into: a held one goes back to Python (its buffer is
 * released under the GIL, nq_release_held), the others are freed here. */
static void sendbuf_drop(nq_sendbuf *sb, nq_chunk *c) {
  if (c->hold != NULL && sb->ep != NULL) {
    nq_release_held(sb->ep, c);
  } else {
    free(c);
  }
}

static void sendbuf_link(nq_sendbuf *sb, nq_chunk *c) {
  if (sb->tail != NULL) {
    sb->tail->next = c;
  } else {
    sb->head = c;
    sb->base = sb->end;
  }
  sb->tail = c;
  if (sb->cursor == NULL) {
    /* Everything before was sent: the new chunk starts at offset end. */
    sb->cursor = c;
    sb->cursor_base = sb->end;
  }
}

/* Queue len bytes (copied). Bytes go into the free tail of the last chunk first: ngtcp2 holds
 * pointers only to bytes already written, which never move. */
int nq_sendbuf_append(nq_sendbuf *sb, const uint8_t *data, size_t len) {
  while (len > 0) {
    nq_chunk *t = sb->tail;
    size_t n;
    if (t == NULL || t->len == t->cap) {
      t = nq_chunk_new(len > NQ_TX_CHUNK ? len : NQ_TX_CHUNK);
      if (t == NULL) {
        return -1;
      }
      sendbuf_link(sb, t);
    }
    n = t->cap - t->len;
    if (n > len) {
      n = len;
    }
    memcpy(t->data + t->len, data, n);
    t->len += n;
    sb->end += n;
    if (sb->cursor == NULL) {
      sb->cursor = t;
      sb->cursor_base = sb->end - t->len;
    }
    data += n;
    len -= n;
  }
  return 0;
}

/* Queue a chunk that is already filled: a large send() copied without the lock, or a held
 * chunk (zero-copy send: its bytes stay in the caller's buffer until acknowledged). */
void nq_sendbuf_append_chunk(nq_sendbuf *sb, nq_chunk *chunk) {
  chunk->cap = chunk->len; /* nothing may be appended after it: the next send() starts anew */
  chunk->next = NULL;
  if (chunk->len == 0) {
    sendbuf_drop(sb, chunk);
    return;
  }
  sendbuf_link(sb, chunk);
  sb->end += chunk->len;
}

/* Fill vec with the bytes not yet given to ngtcp2; *all says whether they reach end. */
size_t nq_sendbuf_unsent(const nq_sendbuf *sb, ngtcp2_vec *vec, size_t nvec, int *all) {
  size_t n = 0;
  const nq_chunk *c = sb->cursor;
  uint64_t skip = sb->sent - sb->cursor_base;
  *all = 1;
  for (; c != NULL; c = c->next) {
    if (skip < c->len) {
      if (n == nvec) {
        *all = 0;
        break;
      }
      vec[n].base = (uint8_t *)nq_chunk_bytes(c) + skip; /* ngtcp2 only reads it */
      vec[n].len = c->len - (size_t)skip;
      ++n;
    }
    skip = 0;
  }
  return n;
}

/* ngtcp2 took len more bytes. */
void nq_sendbuf_consume(nq_sendbuf *sb, size_t len) {
  sb->sent += len;
  while (sb->cursor != NULL && sb->sent >= sb->cursor_base + sb->cursor->len) {
    if (sb->cursor->next == NULL && sb->cursor->len < sb->cursor->cap) {
      break; /* the tail chunk may still grow: keep the cursor on it */
    }
    sb->cursor_base += sb->cursor->len;
    sb->cursor = sb->cursor->next;
  }
}

/* The peer acknowledged [offset, offset + len); ngtcp2 reports acknowledged bytes in order
 * and without gaps, so everything below offset + len can go. */
void nq_sendbuf_ack(nq_sendbuf *sb, uint64_t offset, uint64_t len) {
  uint64_t upto = offset + len;
  if (upto <= sb->acked || upto > sb->sent) {
    return;
  }
  sb->acked = upto;
  while (sb->head != NULL && sb->base + sb->head->len <= sb->acked) {
    nq_chunk *c = sb->head;
    if (c == sb->tail && c->len < c->cap) {
      break; /* the tail chunk may still be appended to */
    }
    sb->base += c->len;
    sb->head = c->next;
    if (sb->head == NULL) {
      sb->tail = NULL;
    }
    if (sb->cursor == c) {
      sb->cursor = c->next;
      sb->cursor_base = sb->base;
    }
    sendbuf_drop(sb, c);
  }
}

void nq_sendbuf_free(nq_sendbuf *sb) {
  nq_chunk *c = sb->head;
  while (c != NULL) {
    nq_chunk *next = c->next;
    sendbuf_drop(sb, c);
    c = next;
  }
  memset(sb, 0, sizeof(*sb));
}
