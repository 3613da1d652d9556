/*
 * nq_moqt: the MOQT data-stream parser of the native data plane (DESIGN.md §6).
 *
 * SUBGROUP and FETCH streams of drafts 18, 20, 21 and 22 (draft-20 §"Subgroup Header",
 * §"Fetch Header", §"Object Status", §"Object Properties", §"End of Range"), byte for byte
 * what kvsp_moq/moqt/data/ parses, with the same limits and the same errors:
 *
 *   - every malformed field is a PROTOCOL_VIOLATION (0x3), as in the Python parser;
 *   - Object Properties longer than max_props are a local limit (LimitExceeded there:
 *     the stream is cancelled with EXCESSIVE_LOAD, 0x9);
 *   - nothing is allocated from a declared length: a field is read through a 9-byte
 *     carry-over, properties grow only with the bytes that arrived (at most max_props), and a
 *     payload is written into the destination its object's owner registered (nq_dsp_cbs.begin),
 *     never buffered here.
 *
 * The parser is driven by chunks of any size (nq_dsp_feed) and calls back once per object
 * (begin: where its payload goes; end: its SHA-256, computed with GnuTLS while the bytes land).
 * It knows no socket and no Python: nq_objects.c drives it from the network thread, and the
 * module's ObjectParser type drives it from Python (tests, the sanitizer build).
 */
#ifndef KVSP_NQ_MOQT_H
#define KVSP_NQ_MOQT_H

#include <stddef.h>
#include <stdint.h>

#include <gnutls/crypto.h>

/* Stream types (§"Unidirectional Stream Types"). */
#define NQ_MOQT_FETCH_HEADER 0x05
/* SHA-256 (binding v1: the layer digest). */
#define NQ_DIGEST_LEN 32
/* Session / stream error codes (draft-22 §"Session Termination", §"Stream Reset Error Codes"). */
#define NQ_MOQT_PROTOCOL_VIOLATION 0x3
#define NQ_MOQT_CANCELLED 0x1
#define NQ_MOQT_EXCESSIVE_LOAD 0x9

typedef enum nq_dsp_kind { NQ_DSP_ANY = 0, NQ_DSP_SUBGROUP = 1, NQ_DSP_FETCH = 2 } nq_dsp_kind;

/* How a stream ended for the parser. */
typedef enum nq_dsp_result {
  NQ_DSP_MORE = 0,      /* fine so far */
  NQ_DSP_FIN = 1,       /* FIN between units: the stream is complete */
  NQ_DSP_VIOLATION = 2, /* PROTOCOL_VIOLATION: the session must be closed */
  NQ_DSP_LIMIT = 3,     /* a local limit: cancel the stream with EXCESSIVE_LOAD */
  NQ_DSP_REFUSED = 4,   /* the owner refused an object: cancel the stream (code in err_code) */
} nq_dsp_result;

/* An object as its header is complete. */
typedef struct nq_dsp_object {
  uint64_t group, subgroup, object, length;
  uint8_t has_subgroup; /* 0: forwarding preference Datagram (fetch flag 0x40) */
  uint8_t has_priority; /* 0: the subgroup header's default priority */
  uint8_t priority;
  uint8_t status;       /* Object Status: 0 Normal, 3 End of Group, 4 End of Track */
  const uint8_t *props; /* raw Object Properties (validated key-value pairs) */
  size_t propslen;
} nq_dsp_object;

/* What the owner of a stream answers for an object (nq_dsp_cbs.begin). */
typedef enum nq_dsp_dest { NQ_DEST_WRITE, NQ_DEST_DISCARD, NQ_DEST_REFUSE } nq_dsp_dest;

struct nq_dsp;

typedef struct nq_dsp_cbs {
  /* The header of the stream: its kind and its Track Alias / Request ID. */
  void (*header)(void *arg, nq_dsp_kind kind, uint64_t id);
  /* An object begins. NQ_DEST_WRITE: *dest holds exactly o->length bytes for the payload.
   * NQ_DEST_REFUSE: say why with nq_dsp_refuse (the parser stops). */
  nq_dsp_dest (*begin)(void *arg, struct nq_dsp *p, const nq_dsp_object *o, uint8_t **dest);
  /* The object ended; digest: the SHA-256 of its payload (NULL when it was discarded). */
  void (*end)(void *arg, const nq_dsp_object *o, const uint8_t *digest);
  /* An End of Range marker of a fetch stream (kind 0x8C, 0x10C, 0x20C). */
  void (*end_of_range)(void *arg, uint64_t kind, uint64_t group, uint64_t object);
  /* Set: the owner hashes (n bytes landed at `at`), and end's digest is always NULL. */
  void (*landed)(void *arg, const uint8_t *at, size_t n);
} nq_dsp_cbs;

typedef struct nq_dsp {
  /* configuration */
  nq_dsp_kind want;      /* ANY, or the one kind this stream may be */
  int timed_out_range;   /* End of Timed-Out Range (0x20C) exists: drafts 20+ */
  int descending;        /* the FETCH's Group Order is DESCENDING */
  uint64_t max_props;    /* the Object Properties limit (DEFAULT_MAX_PROPERTIES_LENGTH) */
  const nq_dsp_cbs *cbs;
  void *arg;
  /* where the parse is */
  nq_dsp_kind kind;
  int state;
  nq_dsp_result result;
  uint64_t err_code;
  char reason[160];
  /* one vi64 field, carried over chunks */
  uint8_t vbuf[9];
  uint8_t vlen;
  /* the stream header */
  uint64_t type, id, hdr_group, hdr_subgroup;
  int hdr_props, hdr_sub_known, hdr_prio_present;
  uint8_t hdr_prio;
  /* subgroup objects */
  int have_prev;
  uint64_t prev_object;
  int terminal;
  /* fetch objects: the prior object's fields (§"Fetch Header") */
  int have_loc, have_sub, have_prio;
  uint64_t prior_group, prior_object, prior_sub;
  uint8_t prior_prio;
  /* the unit being read */
  uint64_t flags, f_group, f_sub, f_obj, eor_kind;
  int f_has_group, f_has_obj, f_has_prio, f_has_sub;
  uint8_t f_prio;
  uint64_t props_need;
  uint8_t *props;
  size_t propslen, propscap;
  nq_dsp_object cur;
  /* the payload landing */
  uint8_t *dest;
  uint64_t left;
  int discard;
  gnutls_hash_hd_t hash;
  int hashing;
} nq_dsp;

void nq_dsp_init(nq_dsp *p, nq_dsp_kind want, int timed_out_range, int descending,
                 uint64_t max_props, const nq_dsp_cbs *cbs, void *arg);
/* Feed the next bytes (fin: the stream's FIN follows them). Returns the result so far; after
 * anything but NQ_DSP_MORE the parser takes nothing more. */
nq_dsp_result nq_dsp_feed(nq_dsp *p, const uint8_t *data, size_t len, int fin);
/* Called from begin: the object is refused with this stream code and reason. */
void nq_dsp_refuse(nq_dsp *p, uint64_t code, const char *reason);
/* The payload in progress goes nowhere from now on (its owner went away). */
void nq_dsp_drop_dest(nq_dsp *p);
void nq_dsp_free(nq_dsp *p);

/* The kind and ID of a stream from its first bytes: 1 known (kind NQ_DSP_ANY: neither a
 * subgroup nor a fetch stream), 0 more bytes needed. */
int nq_dsp_peek(const uint8_t *data, size_t len, nq_dsp_kind *kind, uint64_t *id);

#endif /* KVSP_NQ_MOQT_H */
