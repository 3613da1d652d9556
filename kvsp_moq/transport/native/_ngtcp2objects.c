/*
 * The Python side of object destinations (nq_objects.c) for _ngtcp2module.c: the buffers a
 * registration holds, the OBJECT / OBJECTS_END event tuples, and ObjectParser - the data-stream
 * parser of the network thread (nq_moqt.c, with the same destination rules, nq_objreg_begin)
 * driven from Python, so that every parser test runs without a socket, and under ASan/UBSan.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "_ngtcp2objects.h"

static const char *const RESULT_NAMES[] = {"more", "fin", "violation", "limit", "refused",
                                           "reset"};

const char *nqpy_result_name(unsigned result) {
  return result < sizeof(RESULT_NAMES) / sizeof(RESULT_NAMES[0]) ? RESULT_NAMES[result] : "?";
}

/* ---- destinations -------------------------------------------------------------------------- */

void nqpy_dests_release(nqpy_dests *d) {
  if (d->bufs != NULL) {
    for (Py_ssize_t i = 0; i < d->n; ++i) {
      if (d->bufs[i].obj != NULL) {
        PyBuffer_Release(&d->bufs[i]);
      }
    }
    PyMem_Free(d->bufs);
  }
  d->bufs = NULL;
  d->n = 0;
}

/* dests: a list whose items are writable C-contiguous buffers or None; fills reg's slots. */
int nqpy_dests_take(nqpy_dests *d, PyObject *dests, nq_objreg *reg) {
  Py_ssize_t n;
  if (!PyList_Check(dests)) {
    PyErr_SetString(PyExc_TypeError, "dests must be a list of writable buffers or None");
    return -1;
  }
  n = PyList_GET_SIZE(dests);
  d->bufs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
  if (d->bufs == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  d->n = n;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *item = PyList_GET_ITEM(dests, i);
    if (item == Py_None) {
      continue;
    }
    if (PyObject_GetBuffer(item, &d->bufs[i], PyBUF_CONTIG) != 0) {
      d->bufs[i].obj = NULL;
      nqpy_dests_release(d);
      return -1;
    }
    reg->ptr[i] = d->bufs[i].buf;
    reg->len[i] = (size_t)d->bufs[i].len;
  }
  return 0;
}

/* ---- event tuples ---------------------------------------------------------------------------- */

static PyObject *opt_u64(int has, uint64_t v) {
  return has ? PyLong_FromUnsignedLongLong(v) : Py_NewRef(Py_None);
}

static PyObject *object_fields(const nq_objinfo *o, PyObject *props) {
  return Py_BuildValue("KNKKKNNN", (unsigned long long)o->group,
                       opt_u64(o->has_subgroup, o->subgroup), (unsigned long long)o->object,
                       (unsigned long long)o->length, (unsigned long long)o->status,
                       opt_u64(o->has_priority, o->priority),
                       o->has_digest ? PyBytes_FromStringAndSize((const char *)o->digest,
                                                                 NQ_DIGEST_LEN)
                                     : Py_NewRef(Py_None),
                       props);
}

/* ("object", conn, reg, stream_id, group, subgroup, object, length, status, priority, digest,
 * properties) */
PyObject *nqpy_object_event(PyObject *name, uint64_t conn, int64_t sid, const nq_objinfo *o,
                            PyObject *props) {
  PyObject *fields = object_fields(o, props);
  PyObject *head, *out;
  if (fields == NULL) {
    return NULL;
  }
  head = Py_BuildValue("(OKKL)", name, (unsigned long long)conn, (unsigned long long)o->reg,
                       (long long)sid);
  out = head == NULL ? NULL : PySequence_Concat(head, fields);
  Py_XDECREF(head);
  Py_DECREF(fields);
  return out;
}

/* ---- ObjectParser ---------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  nq_dsp dsp;
  nq_objreg *reg;
  nqpy_dests dests;
  PyObject *events; /* the list feed() is filling */
  size_t slot;
  int landing;
  int failed;       /* a Python error inside a callback */
} ObjectParserObject;

static int append(ObjectParserObject *self, PyObject *item) {
  if (item == NULL || PyList_Append(self->events, item) != 0) {
    Py_XDECREF(item);
    self->failed = 1;
    return -1;
  }
  Py_DECREF(item);
  return 0;
}

static void op_header(void *arg, nq_dsp_kind kind, uint64_t id) {
  ObjectParserObject *self = arg;
  if (!self->failed) {
    append(self, Py_BuildValue("(sK)", kind == NQ_DSP_FETCH ? "fetch" : "subgroup",
                               (unsigned long long)id));
  }
}

static nq_dsp_dest op_begin(void *arg, nq_dsp *p, const nq_dsp_object *o, uint8_t **dest) {
  ObjectParserObject *self = arg;
  nq_dsp_dest d = nq_objreg_begin(self->reg, p, o, dest, &self->slot);
  self->landing = d == NQ_DEST_WRITE;
  return d;
}

static void op_end(void *arg, const nq_dsp_object *o, const uint8_t *digest) {
  ObjectParserObject *self = arg;
  nq_objinfo info;
  PyObject *props, *fields, *out;
  if (self->landing) {
    nq_objreg_end(self->reg, self->slot, digest);
  }
  self->landing = 0;
  if (self->failed) {
    return;
  }
  nq_objinfo_of(o, 0, &info);
  info.has_digest = digest != NULL;
  if (digest != NULL) {
    memcpy(info.digest, digest, NQ_DIGEST_LEN);
  }
  props = PyBytes_FromStringAndSize((const char *)o->props, (Py_ssize_t)o->propslen);
  if (props == NULL) {
    self->failed = 1;
    return;
  }
  fields = object_fields(&info, props);
  out = NULL;
  if (fields != NULL) {
    PyObject *head = Py_BuildValue("(s)", "object");
    out = head == NULL ? NULL : PySequence_Concat(head, fields);
    Py_XDECREF(head);
    Py_DECREF(fields);
  }
  append(self, out);
}

static void op_end_of_range(void *arg, uint64_t kind, uint64_t group, uint64_t object) {
  ObjectParserObject *self = arg;
  if (!self->failed) {
    append(self, Py_BuildValue("(sKKK)", "end_of_range", (unsigned long long)kind,
                               (unsigned long long)group, (unsigned long long)object));
  }
}

static const nq_dsp_cbs OP_CBS = {op_header, op_begin, op_end, op_end_of_range, NULL};

static PyObject *ObjectParser_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"kind", "group", "first", "dests", "timed_out_range", "descending",
                           "max_properties_length", NULL};
  int kind, timed_out = 1, descending = 0;
  unsigned long long group, first, max_props = 1ULL << 20;
  PyObject *dests;
  ObjectParserObject *self;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "iKKO!|ppK", kwlist, &kind, &group, &first,
                                   &PyList_Type, &dests, &timed_out, &descending, &max_props)) {
    return NULL;
  }
  if (kind < NQ_DSP_ANY || kind > NQ_DSP_FETCH) {
    return PyErr_Format(PyExc_ValueError, "kind must be 0 (any), 1 (subgroup) or 2 (fetch)");
  }
  self = (ObjectParserObject *)type->tp_alloc(type, 0);
  if (self == NULL) {
    return NULL;
  }
  self->reg = nq_objreg_new((nq_dsp_kind)kind, 0, group, first,
                            (size_t)PyList_GET_SIZE(dests), timed_out, descending, max_props);
  if (self->reg == NULL) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  if (nqpy_dests_take(&self->dests, dests, self->reg) != 0) {
    Py_DECREF(self);
    return NULL;
  }
  nq_dsp_init(&self->dsp, (nq_dsp_kind)kind, timed_out, descending, max_props, &OP_CBS, self);
  return (PyObject *)self;
}

static void ObjectParser_dealloc(ObjectParserObject *self) {
  PyTypeObject *tp = Py_TYPE(self);
  nq_dsp_free(&self->dsp);
  nq_objreg_free(self->reg);
  nqpy_dests_release(&self->dests);
  tp->tp_free((PyObject *)self);
  Py_DECREF(tp);
}

/* feed(data, fin=False) -> the events these bytes complete; a last ("end", result, code,
 * reason) once the stream is over for the parser (FIN, a violation, a limit, a refusal). */
static PyObject *ObjectParser_feed(ObjectParserObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"data", "fin", NULL};
  Py_buffer data;
  int fin = 0;
  nq_dsp_result r;
  PyObject *out;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|p", kwlist, &data, &fin)) {
    return NULL;
  }
  if (self->events != NULL) {
    PyBuffer_Release(&data);
    return PyErr_Format(PyExc_RuntimeError, "feed() is not reentrant");
  }
  out = self->events = PyList_New(0);
  if (out == NULL) {
    PyBuffer_Release(&data);
    return NULL;
  }
  r = nq_dsp_feed(&self->dsp, data.buf, (size_t)data.len, fin);
  PyBuffer_Release(&data);
  self->events = NULL;
  if (self->failed) {
    Py_DECREF(out);
    return NULL;
  }
  if (r != NQ_DSP_MORE) {
    PyObject *end = Py_BuildValue("(ssKs)", "end", nqpy_result_name(r),
                                  (unsigned long long)self->dsp.err_code,
                                  r == NQ_DSP_FIN ? "" : self->dsp.reason);
    if (end == NULL || PyList_Append(out, end) != 0) {
      Py_XDECREF(end);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(end);
  }
  return out;
}

static PyMethodDef ObjectParser_methods[] = {
    {"feed", (PyCFunction)(void (*)(void))ObjectParser_feed, METH_VARARGS | METH_KEYWORDS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot ObjectParser_slots[] = {
    {Py_tp_doc, "The native MOQT data-stream parser, fed from Python (see _ngtcp2.pyi)."},
    {Py_tp_new, ObjectParser_new},
    {Py_tp_dealloc, ObjectParser_dealloc},
    {Py_tp_methods, ObjectParser_methods},
    {0, NULL},
};

static PyType_Spec ObjectParser_spec = {
    .name = "kvsp_moq.transport.native._ngtcp2.ObjectParser",
    .basicsize = sizeof(ObjectParserObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ObjectParser_slots,
};

int nqpy_add_object_parser(PyObject *module) {
  PyObject *type = PyType_FromModuleAndSpec(module, &ObjectParser_spec, NULL);
  int rv;
  if (type == NULL) {
    return -1;
  }
  rv = PyModule_AddObjectRef(module, "ObjectParser", type);
  Py_DECREF(type);
  return rv;
}
