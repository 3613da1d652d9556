/*
 * The MOQT data-stream parser (nq_moqt.h): SUBGROUP and FETCH streams, one field at a time.
 *
 * Sections cited are draft-20's (shared/spec), as in kvsp_moq/moqt/data/; draft 18 has the
 * same bytes but for End of Timed-Out Range (0x20C, 20+), drafts 21 and 22 change nothing
 * here. The checks and their order follow kvsp_moq/moqt/data/subgroup.py and fetch.py: a field
 * is checked where the Python parser reads it, an object where it applies the unit.
 */
#include "nq_moqt.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* SUBGROUP_HEADER Type Flags (§"Subgroup Header"). */
#define SG_PROPERTIES 0x01
#define SG_ID_MODE(t) (((t) >> 1) & 0x03) /* 0 zero, 1 first Object ID, 2 field, 3 invalid */
#define SG_HEADER_BIT 0x10
#define SG_DEFAULT_PRIORITY 0x20
/* Fetch object Serialization Flags (§"Fetch Header", §"Flags"). */
#define F_SUBGROUP_MASK 0x03
#define F_OBJECT_ID 0x04
#define F_GROUP_ID 0x08
#define F_PRIORITY 0x10
#define F_PROPERTIES 0x20
#define F_DATAGRAM 0x40
/* End of Range (§"End of Range"). */
#define EOR_NON_EXISTENT 0x8C
#define EOR_UNKNOWN 0x10C
#define EOR_TIMED_OUT 0x20C
/* §"Key-Value-Pair Structure": an odd type's value is at most 65535 bytes. */
#define KVP_MAX_VALUE 65535

enum {
  S_TYPE,
  SG_ALIAS, SG_GROUP, SG_SUB, SG_PRIO,
  SG_DELTA, SG_PLEN, SG_PROPS, SG_LEN, SG_STATUS,
  F_RID,
  F_FLAGS, F_GROUP, F_SUB, F_OBJ, F_PRIO, F_PLEN, F_PROPS, F_LEN,
  F_EOR_GROUP, F_EOR_OBJ, F_EOR_LEN,
  S_PAYLOAD,
  S_STOPPED,
};

static int is_subgroup_type(uint64_t t) {
  return t < 0x80 && (t & SG_HEADER_BIT) && SG_ID_MODE(t) != 3;
}

void nq_dsp_init(nq_dsp *p, nq_dsp_kind want, int timed_out_range, int descending,
                 uint64_t max_props, const nq_dsp_cbs *cbs, void *arg) {
  memset(p, 0, sizeof(*p));
  p->want = want;
  p->timed_out_range = timed_out_range;
  p->descending = descending;
  p->max_props = max_props;
  p->cbs = cbs;
  p->arg = arg;
  p->state = S_TYPE;
}

static void end_hash(nq_dsp *p, uint8_t *digest) {
  if (p->hashing) {
    gnutls_hash_deinit(p->hash, digest);
    p->hashing = 0;
  }
}

void nq_dsp_free(nq_dsp *p) {
  uint8_t scratch[NQ_DIGEST_LEN];
  end_hash(p, scratch);
  free(p->props);
  p->props = NULL;
  p->propslen = p->propscap = 0;
}

static nq_dsp_result stop(nq_dsp *p, nq_dsp_result r, uint64_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->reason, sizeof(p->reason), fmt, ap);
  va_end(ap);
  p->result = r;
  p->err_code = code;
  p->state = S_STOPPED;
  return r;
}

#define VIOLATION(p, ...) stop((p), NQ_DSP_VIOLATION, NQ_MOQT_PROTOCOL_VIOLATION, __VA_ARGS__)

void nq_dsp_refuse(nq_dsp *p, uint64_t code, const char *reason) {
  stop(p, NQ_DSP_REFUSED, code, "%s", reason);
}

void nq_dsp_drop_dest(nq_dsp *p) {
  uint8_t scratch[NQ_DIGEST_LEN];
  if (p->state == S_PAYLOAD && !p->discard) {
    end_hash(p, scratch);
    p->discard = 1;
    p->dest = NULL;
  }
}

/* ---- fields ----------------------------------------------------------------------------- */

/* Length of the vi64 whose first byte is b (§"Variable-Length Integers"): leading 1-bits + 1. */
static unsigned vi64_len(uint8_t b) {
  unsigned n = 1;
  while (n < 9 && (b & (0x80u >> (n - 1)))) {
    ++n;
  }
  return n;
}

static uint64_t vi64_value(const uint8_t *b, unsigned n) {
  uint64_t v = 0;
  if (n == 9) {
    for (unsigned i = 1; i < 9; ++i) {
      v = (v << 8) | b[i];
    }
    return v;
  }
  for (unsigned i = 0; i < n; ++i) {
    v = (v << 8) | b[i];
  }
  return n == 8 ? v & ((1ULL << 56) - 1) : v & ((1ULL << (7 * n)) - 1);
}

/* One vi64 from the input, through the carry-over when it straddles chunks: 1 read, 0 more. */
static int pull_vi64(nq_dsp *p, const uint8_t **pos, const uint8_t *end, uint64_t *out) {
  const uint8_t *d = *pos;
  unsigned n;
  if (p->vlen == 0) {
    if (d >= end) {
      return 0;
    }
    n = vi64_len(d[0]);
    if ((size_t)(end - d) >= n) {
      *out = vi64_value(d, n);
      *pos = d + n;
      return 1;
    }
  }
  while (d < end) {
    p->vbuf[p->vlen++] = *d++;
    n = vi64_len(p->vbuf[0]);
    if (p->vlen == n) {
      *out = vi64_value(p->vbuf, n);
      p->vlen = 0;
      *pos = d;
      return 1;
    }
  }
  *pos = d;
  return 0;
}

/* Object Properties (§"Object Properties"): a well-formed key-value pair list, as
 * kvsp_moq.wire.kvp.read_kvps reads it. Returns NULL or why not. */
static const char *check_kvps(const uint8_t *d, size_t len) {
  size_t pos = 0;
  uint64_t prev = 0;
  while (pos < len) {
    unsigned n = vi64_len(d[pos]);
    uint64_t delta, v;
    if (len - pos < n) {
      return "key-value pair runs past the end of its list";
    }
    delta = vi64_value(d + pos, n);
    pos += n;
    if (delta > UINT64_MAX - prev) {
      return "KVP type exceeds 2**64-1";
    }
    prev += delta;
    if (pos >= len) {
      return "key-value pair runs past the end of its list";
    }
    n = vi64_len(d[pos]);
    if (len - pos < n) {
      return "key-value pair runs past the end of its list";
    }
    v = vi64_value(d + pos, n);
    pos += n;
    if (prev & 1) {
      if (v > KVP_MAX_VALUE) {
        return "KVP value length exceeds 65535";
      }
      if (len - pos < v) {
        return "key-value pair runs past the end of its list";
      }
      pos += (size_t)v;
    }
  }
  return NULL;
}

/* Properties bytes, stored as they arrive (never more than arrived: max_props bounds it). */
static int pull_props(nq_dsp *p, const uint8_t **pos, const uint8_t *end) {
  size_t avail = (size_t)(end - *pos);
  size_t take = p->props_need - p->propslen < avail ? (size_t)(p->props_need - p->propslen)
                                                    : avail;
  if (take == 0) {
    return 0; /* the input is spent (props_need > propslen here) */
  }
  if (p->propslen + take > p->propscap) {
    size_t cap = p->propscap ? p->propscap * 2 : 256;
    uint8_t *grown;
    while (cap < p->propslen + take) {
      cap *= 2;
    }
    if (cap > p->props_need) {
      cap = (size_t)p->props_need;
    }
    grown = realloc(p->props, cap);
    if (grown == NULL) {
      return -1;
    }
    p->props = grown;
    p->propscap = cap;
  }
  memcpy(p->props + p->propslen, *pos, take);
  p->propslen += take;
  *pos += take;
  return p->propslen == p->props_need ? 1 : 0;
}

/* ---- objects ---------------------------------------------------------------------------- */

/* The object's payload is complete: its owner hears of it (and may stop the parse). */
static nq_dsp_result end_object(nq_dsp *p) {
  uint8_t digest[NQ_DIGEST_LEN];
  end_hash(p, digest);
  p->cbs->end(p->arg, &p->cur, p->discard || p->cbs->landed != NULL ? NULL : digest);
  if (p->state == S_STOPPED) {
    return p->result;
  }
  p->propslen = 0;
  p->state = p->kind == NQ_DSP_FETCH ? F_FLAGS : SG_DELTA;
  return NQ_DSP_MORE;
}

/* The object's header is complete: ask its owner where the payload goes. */
static nq_dsp_result begin_object(nq_dsp *p) {
  const char *bad;
  nq_dsp_dest d;
  if (p->propslen && (bad = check_kvps(p->props, p->propslen)) != NULL) {
    return VIOLATION(p, "%s", bad);
  }
  p->cur.props = p->propslen ? p->props : NULL;
  p->cur.propslen = p->propslen;
  p->dest = NULL;
  d = p->cbs->begin(p->arg, p, &p->cur, &p->dest);
  if (p->state == S_STOPPED) {
    return p->result;
  }
  if (d == NQ_DEST_REFUSE) {
    return stop(p, NQ_DSP_REFUSED, NQ_MOQT_CANCELLED, "object refused");
  }
  p->discard = d != NQ_DEST_WRITE || p->dest == NULL;
  if (!p->discard && p->cbs->landed == NULL) {
    if (gnutls_hash_init(&p->hash, GNUTLS_DIG_SHA256) != 0) {
      return stop(p, NQ_DSP_LIMIT, NQ_MOQT_EXCESSIVE_LOAD, "cannot hash");
    }
    p->hashing = 1;
  }
  p->left = p->cur.length;
  if (p->left > 0) {
    p->state = S_PAYLOAD;
    return NQ_DSP_MORE;
  }
  return end_object(p);
}

/* A subgroup object's fields are read (subgroup.py _apply_unit). */
static nq_dsp_result apply_subgroup_object(nq_dsp *p, uint64_t delta, uint8_t status) {
  uint64_t object;
  if (p->terminal) {
    return VIOLATION(p, "object after %s on the same subgroup stream",
                     p->terminal == 3 ? "END_OF_GROUP" : "END_OF_TRACK");
  }
  if (!p->have_prev) {
    object = delta;
  } else {
    if (delta > UINT64_MAX - p->prev_object || p->prev_object + delta == UINT64_MAX) {
      return VIOLATION(p, "Object ID exceeds 2**64-1");
    }
    object = p->prev_object + delta + 1;
  }
  if (p->propslen && status != 0) {
    return VIOLATION(p, "properties on an object with status %u", status);
  }
  if (!p->hdr_sub_known) { /* SUBGROUP_ID_MODE 0b01: the first Object ID */
    p->hdr_subgroup = object;
    p->hdr_sub_known = 1;
  }
  p->have_prev = 1;
  p->prev_object = object;
  if (status != 0) {
    p->terminal = status;
  }
  p->cur.group = p->hdr_group;
  p->cur.subgroup = p->hdr_subgroup;
  p->cur.has_subgroup = 1;
  p->cur.object = object;
  p->cur.has_priority = (uint8_t)p->hdr_prio_present;
  p->cur.priority = p->hdr_prio;
  p->cur.status = status;
  return begin_object(p);
}

/* A fetch object's fields are read (fetch.py _apply_unit, _resolve_location,
 * _resolve_subgroup). */
static nq_dsp_result apply_fetch_object(nq_dsp *p) {
  uint64_t group, object, sub = 0;
  int has_sub = 1;
  if (!p->have_loc) {
    if (!p->f_has_group || !p->f_has_obj) {
      return VIOLATION(p, "first fetch object must carry Group ID and Object ID");
    }
    group = p->f_group;
    object = p->f_obj;
  } else {
    if (!p->f_has_group) {
      group = p->prior_group;
    } else if (p->descending) {
      if (p->f_group >= p->prior_group) {
        return VIOLATION(p, "Group ID delta goes below 0");
      }
      group = p->prior_group - p->f_group - 1;
    } else {
      if (p->f_group > UINT64_MAX - p->prior_group || p->prior_group + p->f_group == UINT64_MAX) {
        return VIOLATION(p, "Group ID exceeds 2**64-1");
      }
      group = p->prior_group + p->f_group + 1;
    }
    if (!p->f_has_obj) {
      if (p->prior_object == UINT64_MAX) {
        return VIOLATION(p, "Object ID exceeds 2**64-1");
      }
      object = p->prior_object + 1; /* "regardless of which group it belongs to" */
    } else if (p->f_has_group) {
      object = p->f_obj;
    } else {
      if (p->f_obj > UINT64_MAX - p->prior_object) {
        return VIOLATION(p, "Object ID exceeds 2**64-1");
      }
      object = p->prior_object + p->f_obj; /* no +1 here, unlike subgroup streams */
    }
  }
  if (p->flags & F_DATAGRAM) {
    has_sub = 0;
  } else {
    uint64_t mode = p->flags & F_SUBGROUP_MASK;
    if (mode == 3) {
      sub = p->f_sub;
    } else if (mode != 0) {
      if (!p->have_sub) {
        return VIOLATION(p, "fetch object references the Subgroup ID of no prior object");
      }
      if (mode == 2 && p->prior_sub == UINT64_MAX) {
        return VIOLATION(p, "Subgroup ID exceeds 2**64-1");
      }
      sub = p->prior_sub + mode - 1; /* 1: prior, 2: prior + 1 */
    }
  }
  if (!p->f_has_prio && !p->have_prio) {
    return VIOLATION(p, "fetch object inherits the Priority of no prior object");
  }
  p->cur.priority = p->f_has_prio ? p->f_prio : p->prior_prio;
  p->have_loc = 1;
  p->prior_group = group;
  p->prior_object = object;
  if (has_sub) {
    p->have_sub = 1;
    p->prior_sub = sub;
  }
  p->have_prio = 1;
  p->prior_prio = p->cur.priority;
  p->cur.group = group;
  p->cur.subgroup = sub;
  p->cur.has_subgroup = (uint8_t)has_sub;
  p->cur.object = object;
  p->cur.has_priority = 1;
  p->cur.status = 0; /* fetch objects carry no Object Status (§"Object Status") */
  return begin_object(p);
}

/* ---- the driver ------------------------------------------------------------------------- */

/* Start reading Properties Length bytes (pull_properties: the limit is checked first). */
static nq_dsp_result props_length(nq_dsp *p, uint64_t v, int next_state, int props_state) {
  if (v > p->max_props) {
    return stop(p, NQ_DSP_LIMIT, NQ_MOQT_EXCESSIVE_LOAD,
                "Object Properties of %llu bytes > local limit %llu", (unsigned long long)v,
                (unsigned long long)p->max_props);
  }
  p->props_need = v;
  p->propslen = 0;
  p->state = v ? props_state : next_state;
  return NQ_DSP_MORE;
}

static nq_dsp_result header_type(nq_dsp *p, uint64_t t) {
  p->type = t;
  if (t == NQ_MOQT_FETCH_HEADER && p->want != NQ_DSP_SUBGROUP) {
    p->kind = NQ_DSP_FETCH;
    p->state = F_RID;
  } else if (is_subgroup_type(t) && p->want != NQ_DSP_FETCH) {
    p->kind = NQ_DSP_SUBGROUP;
    p->hdr_props = (t & SG_PROPERTIES) != 0;
    p->hdr_prio_present = !(t & SG_DEFAULT_PRIORITY);
    p->hdr_sub_known = SG_ID_MODE(t) != 1;
    p->state = SG_ALIAS;
  } else if (p->want == NQ_DSP_FETCH) {
    return VIOLATION(p, "not a FETCH_HEADER: stream type %#llx", (unsigned long long)t);
  } else if (p->want == NQ_DSP_SUBGROUP) {
    return VIOLATION(p, "invalid SUBGROUP_HEADER type %#llx", (unsigned long long)t);
  } else {
    return VIOLATION(p, "stream type %#llx is not a subgroup or fetch stream",
                     (unsigned long long)t);
  }
  return NQ_DSP_MORE;
}

static void header_done(nq_dsp *p, int next) {
  p->state = next;
  if (p->cbs->header != NULL) {
    p->cbs->header(p->arg, p->kind, p->id);
  }
}

/* One step on the field the state names; 0: the input is spent. */
static int step(nq_dsp *p, const uint8_t **pos, const uint8_t *end) {
  uint64_t v;
  int st = p->state;
  if (st == S_PAYLOAD) {
    size_t avail = (size_t)(end - *pos);
    size_t take = p->left < avail ? (size_t)p->left : avail;
    if (take == 0) {
      return 0;
    }
    if (!p->discard) {
      uint8_t *at = p->dest + (p->cur.length - p->left);
      memcpy(at, *pos, take);
      if (p->cbs->landed != NULL) {
        p->cbs->landed(p->arg, at, take); /* the owner hashes what landed */
      } else {
        gnutls_hash(p->hash, at, take); /* what lands is what is hashed */
      }
    }
    *pos += take;
    p->left -= take;
    if (p->left == 0) {
      end_object(p);
    }
    return 1;
  }
  if (st == SG_PROPS || st == F_PROPS) {
    int r = pull_props(p, pos, end);
    if (r < 0) {
      stop(p, NQ_DSP_LIMIT, NQ_MOQT_EXCESSIVE_LOAD, "out of memory for Object Properties");
      return 1;
    }
    if (r == 0) {
      return 0;
    }
    p->state = st == SG_PROPS ? SG_LEN : F_LEN;
    return 1;
  }
  if (st == SG_PRIO || st == F_PRIO) { /* one byte */
    if (*pos >= end) {
      return 0;
    }
    v = *(*pos)++;
    if (st == SG_PRIO) {
      p->hdr_prio = (uint8_t)v;
      header_done(p, SG_DELTA);
    } else {
      p->f_prio = (uint8_t)v;
      p->f_has_prio = 1;
      p->state = (p->flags & F_PROPERTIES) ? F_PLEN : F_LEN;
    }
    return 1;
  }
  if (!pull_vi64(p, pos, end, &v)) {
    return 0;
  }
  switch (st) {
  case S_TYPE:
    header_type(p, v);
    break;
  case SG_ALIAS:
    p->id = v;
    p->state = SG_GROUP;
    break;
  case SG_GROUP:
    p->hdr_group = v;
    if (SG_ID_MODE(p->type) == 2) {
      p->state = SG_SUB;
    } else if (p->hdr_prio_present) {
      p->state = SG_PRIO;
    } else {
      header_done(p, SG_DELTA);
    }
    break;
  case SG_SUB:
    p->hdr_subgroup = v;
    if (p->hdr_prio_present) {
      p->state = SG_PRIO;
    } else {
      header_done(p, SG_DELTA);
    }
    break;
  case SG_DELTA:
    p->f_obj = v; /* the Object ID Delta, kept until the object applies */
    p->propslen = 0;
    if (p->hdr_props) {
      p->state = SG_PLEN;
    } else {
      p->state = SG_LEN;
    }
    break;
  case SG_PLEN:
    props_length(p, v, SG_LEN, SG_PROPS);
    break;
  case SG_LEN:
    p->cur.length = v;
    if (v == 0) {
      p->state = SG_STATUS; /* the Object Status is sent only for an empty payload */
    } else {
      apply_subgroup_object(p, p->f_obj, 0);
    }
    break;
  case SG_STATUS:
    if (v != 0 && v != 3 && v != 4) {
      VIOLATION(p, "unknown Object Status %#llx", (unsigned long long)v);
      break;
    }
    apply_subgroup_object(p, p->f_obj, (uint8_t)v);
    break;
  case F_RID:
    p->id = v;
    header_done(p, F_FLAGS);
    break;
  case F_FLAGS:
    p->flags = v;
    p->f_has_group = p->f_has_obj = p->f_has_prio = p->f_has_sub = 0;
    p->propslen = 0;
    if (v >= 0x80) {
      if (v == EOR_NON_EXISTENT || v == EOR_UNKNOWN || (v == EOR_TIMED_OUT && p->timed_out_range)) {
        p->eor_kind = v;
        p->state = F_EOR_GROUP;
      } else {
        VIOLATION(p, "invalid fetch Serialization Flags %#llx", (unsigned long long)v);
      }
    } else if (v & F_GROUP_ID) {
      p->state = F_GROUP;
    } else if (!(v & F_DATAGRAM) && (v & F_SUBGROUP_MASK) == 3) {
      p->state = F_SUB;
    } else if (v & F_OBJECT_ID) {
      p->state = F_OBJ;
    } else if (v & F_PRIORITY) {
      p->state = F_PRIO;
    } else {
      p->state = (v & F_PROPERTIES) ? F_PLEN : F_LEN;
    }
    break;
  case F_GROUP:
    p->f_group = v;
    p->f_has_group = 1;
    if (!(p->flags & F_DATAGRAM) && (p->flags & F_SUBGROUP_MASK) == 3) {
      p->state = F_SUB;
      break;
    }
    /* fall through */
  case F_SUB:
    if (st == F_SUB) {
      p->f_sub = v;
      p->f_has_sub = 1;
    }
    if (p->flags & F_OBJECT_ID) {
      p->state = F_OBJ;
      break;
    }
    /* fall through */
  case F_OBJ:
    if (st == F_OBJ) {
      p->f_obj = v;
      p->f_has_obj = 1;
    }
    if (p->flags & F_PRIORITY) {
      p->state = F_PRIO;
    } else {
      p->state = (p->flags & F_PROPERTIES) ? F_PLEN : F_LEN;
    }
    break;
  case F_PLEN:
    props_length(p, v, F_LEN, F_PROPS);
    break;
  case F_LEN:
    p->cur.length = v;
    apply_fetch_object(p);
    break;
  case F_EOR_GROUP:
    p->f_group = v;
    p->state = F_EOR_OBJ;
    break;
  case F_EOR_OBJ:
    p->f_obj = v;
    p->state = F_EOR_LEN;
    break;
  case F_EOR_LEN:
    if (v != 0) {
      VIOLATION(p, "End of Range with a non-zero Object Payload Length");
      break;
    }
    /* Prior Group/Object become the marker's; Subgroup and Priority stay (§"End of Range"). */
    p->have_loc = 1;
    p->prior_group = p->f_group;
    p->prior_object = p->f_obj;
    if (p->cbs->end_of_range != NULL) {
      p->cbs->end_of_range(p->arg, p->eor_kind, p->f_group, p->f_obj);
    }
    p->state = F_FLAGS;
    break;
  default:
    break;
  }
  return 1;
}

nq_dsp_result nq_dsp_feed(nq_dsp *p, const uint8_t *data, size_t len, int fin) {
  const uint8_t *pos = data, *end = data + len;
  if (p->state == S_STOPPED) {
    return p->result;
  }
  while (p->state != S_STOPPED && step(p, &pos, end)) {
  }
  if (p->state == S_STOPPED) {
    return p->result;
  }
  if (fin) {
    /* §"Streams": the stream may end only between units, after its header. */
    if ((p->state != SG_DELTA && p->state != F_FLAGS) || p->vlen != 0) {
      return VIOLATION(p, p->state == S_TYPE ? "stream ended inside its type"
                                             : "stream ended inside a unit");
    }
    p->state = S_STOPPED;
    p->result = NQ_DSP_FIN;
    return NQ_DSP_FIN;
  }
  return NQ_DSP_MORE;
}

int nq_dsp_peek(const uint8_t *data, size_t len, nq_dsp_kind *kind, uint64_t *id) {
  unsigned n;
  uint64_t t;
  size_t pos;
  if (len == 0) {
    return 0;
  }
  n = vi64_len(data[0]);
  if (len < n) {
    return 0;
  }
  t = vi64_value(data, n);
  pos = n;
  if (t != NQ_MOQT_FETCH_HEADER && !is_subgroup_type(t)) {
    *kind = NQ_DSP_ANY;
    return 1;
  }
  if (pos >= len || len - pos < vi64_len(data[pos])) {
    return 0;
  }
  *id = vi64_value(data + pos, vi64_len(data[pos]));
  *kind = t == NQ_MOQT_FETCH_HEADER ? NQ_DSP_FETCH : NQ_DSP_SUBGROUP;
  return 1;
}
