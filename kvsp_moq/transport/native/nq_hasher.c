/*
 * The hash thread of an endpoint: SHA-256 of object payloads as they land (DESIGN.md §6),
 * beside the network thread rather than on it.
 *
 * Measured on 2 cores (docs/benchmarks.md): with decrypt, copy and hash in series on the
 * network thread, acknowledgements wait behind the hashing and the block arrives later than
 * when Python hashed on a worker thread. So the network thread copies each payload into its
 * destination and hands the landed range to this thread (nq_hasher_update, in batches), which
 * hashes it in order and, once the object is complete (nq_hasher_finish), queues its OBJECT
 * event; a stream's OBJECTS_END goes through the same queue, so it follows its objects.
 *
 * Lifetimes: a job points into a destination Python registered. forget_objects waits for the
 * queue to drain (nq_hasher_drain, without the endpoint lock, which the hash thread takes only
 * to queue an event) before it releases the buffers; the endpoint stops this thread after the
 * network thread, before Python's buffers are released. The thread starts with the first
 * registration of the endpoint.
 */
#include "nq.h"

#include <stdlib.h>
#include <string.h>

typedef enum { JOB_UPDATE, JOB_FINISH, JOB_END } job_kind;

typedef struct nq_hjob {
  struct nq_hjob *next;
  job_kind kind;
  gnutls_hash_hd_t h;   /* UPDATE, FINISH */
  const uint8_t *ptr;   /* UPDATE */
  size_t len;
  int emit;             /* FINISH: queue the OBJECT event (0: the object was abandoned) */
  uint64_t conn;
  int64_t stream_id;
  nq_objinfo info;      /* FINISH, END */
  uint64_t code;        /* END */
  uint8_t *data;        /* FINISH: properties; END: reason */
  size_t datalen;
} nq_hjob;

static void *hasher_main(void *arg);

static int start(nq_hasher *hs, nq_endpoint *ep) {
  if (hs->started) {
    return 0;
  }
  hs->ep = ep;
  if (pthread_mutex_init(&hs->lock, NULL) != 0) {
    return -1;
  }
  if (pthread_cond_init(&hs->cond, NULL) != 0) {
    pthread_mutex_destroy(&hs->lock);
    return -1;
  }
  if (pthread_create(&hs->thread, NULL, hasher_main, hs) != 0) {
    pthread_cond_destroy(&hs->cond);
    pthread_mutex_destroy(&hs->lock);
    return -1;
  }
  hs->started = 1;
  (void)pthread_setname_np(hs->thread, "kvsp-nq-hash");
  return 0;
}

int nq_hasher_start(nq_endpoint *ep) {
  return start(&ep->hasher, ep);
}

static void job_free(nq_hjob *j) {
  free(j->data);
  free(j);
}

static int submit(nq_hasher *hs, nq_hjob *j) {
  pthread_mutex_lock(&hs->lock);
  j->next = NULL;
  if (hs->tail != NULL) {
    hs->tail->next = j;
  } else {
    hs->head = j;
  }
  hs->tail = j;
  ++hs->submitted;
  pthread_cond_broadcast(&hs->cond);
  pthread_mutex_unlock(&hs->lock);
  return 0;
}

static nq_hjob *job_new(job_kind kind, const uint8_t *data, size_t datalen) {
  nq_hjob *j = calloc(1, sizeof(*j));
  if (j == NULL) {
    return NULL;
  }
  j->kind = kind;
  if (datalen > 0) {
    j->data = malloc(datalen);
    if (j->data == NULL) {
      free(j);
      return NULL;
    }
    memcpy(j->data, data, datalen);
    j->datalen = datalen;
  }
  return j;
}

int nq_hasher_update(nq_hasher *hs, gnutls_hash_hd_t h, const uint8_t *ptr, size_t len) {
  nq_hjob *j = job_new(JOB_UPDATE, NULL, 0);
  if (j == NULL) {
    return -1;
  }
  j->h = h;
  j->ptr = ptr;
  j->len = len;
  return submit(hs, j);
}

/* The object is complete (emit) or abandoned (!emit): finish its hash context in order. Without
 * memory for the job the context is left (jobs may still use it; the network thread cannot wait
 * for them under the endpoint lock): a bounded leak, and the caller stops the stream. */
int nq_hasher_finish(nq_hasher *hs, gnutls_hash_hd_t h, int emit, uint64_t conn,
                     int64_t stream_id, const nq_objinfo *info, const uint8_t *props,
                     size_t propslen) {
  nq_hjob *j = job_new(JOB_FINISH, props, propslen);
  if (j == NULL) {
    return -1;
  }
  j->h = h;
  j->emit = emit;
  j->conn = conn;
  j->stream_id = stream_id;
  j->info = *info;
  return submit(hs, j);
}

int nq_hasher_end(nq_hasher *hs, uint64_t conn, int64_t stream_id, uint64_t reg, uint8_t result,
                  uint64_t code, const char *reason) {
  nq_hjob *j = job_new(JOB_END, (const uint8_t *)reason, strlen(reason) + 1);
  if (j == NULL) {
    return -1;
  }
  j->conn = conn;
  j->stream_id = stream_id;
  j->info.reg = reg;
  j->info.result = result;
  j->code = code;
  return submit(hs, j);
}

/* Queue the event of a finished job (under the endpoint lock; the connection may be gone). */
static void emit(nq_hasher *hs, nq_hjob *j) {
  nq_endpoint *ep = hs->ep;
  nq_conn *c;
  nq_endpoint_lock(ep);
  c = nq_endpoint_conn(ep, j->conn);
  if (c != NULL && c->state != NQ_DEAD) {
    int rv = j->kind == JOB_FINISH
                 ? nq_emit_object(c, j->stream_id, &j->info, j->data, j->datalen)
                 : nq_emit_objects_end(c, j->stream_id, j->info.reg, j->info.result, j->code,
                                       (const char *)j->data);
    /* The event reaches Python through the event fd (nq_events.c); the network thread has
     * nothing to do for it and is woken only to send the close this asks for. */
    if (rv != 0) {
      nq_conn_request_close(c, NGTCP2_INTERNAL_ERROR, 0, (const uint8_t *)"event queue full",
                            16);
      nq_endpoint_wake(ep);
    }
  }
  nq_endpoint_unlock(ep);
}

static void run(nq_hasher *hs, nq_hjob *j) {
  if (j->kind == JOB_UPDATE) {
    gnutls_hash(j->h, j->ptr, j->len);
    return;
  }
  if (j->kind == JOB_FINISH) {
    gnutls_hash_deinit(j->h, j->info.digest);
    j->info.has_digest = 1;
    if (!j->emit) {
      return;
    }
  }
  emit(hs, j);
}

static void *hasher_main(void *arg) {
  nq_hasher *hs = arg;
  pthread_mutex_lock(&hs->lock);
  for (;;) {
    nq_hjob *j;
    while (hs->head == NULL && !hs->stopping) {
      pthread_cond_wait(&hs->cond, &hs->lock);
    }
    if (hs->head == NULL) {
      break; /* stopping, and nothing left */
    }
    j = hs->head;
    hs->head = j->next;
    if (hs->head == NULL) {
      hs->tail = NULL;
    }
    pthread_mutex_unlock(&hs->lock);
    run(hs, j);
    job_free(j);
    pthread_mutex_lock(&hs->lock);
    ++hs->done;
    pthread_cond_broadcast(&hs->cond);
  }
  pthread_mutex_unlock(&hs->lock);
  return NULL;
}

/* Wait until every job submitted so far is done (the caller holds no endpoint lock). */
void nq_hasher_drain(nq_hasher *hs) {
  uint64_t target;
  if (!hs->started) {
    return;
  }
  pthread_mutex_lock(&hs->lock);
  target = hs->submitted;
  while (hs->done < target) {
    pthread_cond_wait(&hs->cond, &hs->lock);
  }
  pthread_mutex_unlock(&hs->lock);
}

/* After the network thread: finish what is queued, without emitting (the endpoint is going:
 * jobs that would emit find no connection), and join. */
void nq_hasher_stop(nq_hasher *hs) {
  if (!hs->started) {
    return;
  }
  pthread_mutex_lock(&hs->lock);
  hs->stopping = 1;
  pthread_cond_broadcast(&hs->cond);
  pthread_mutex_unlock(&hs->lock);
  pthread_join(hs->thread, NULL);
  pthread_cond_destroy(&hs->cond);
  pthread_mutex_destroy(&hs->lock);
  hs->started = 0;
}
