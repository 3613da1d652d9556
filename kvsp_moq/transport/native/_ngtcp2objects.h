/* The Python side of object destinations (_ngtcp2objects.c), for _ngtcp2module.c. */
#ifndef KVSP_NGTCP2_OBJECTS_H
#define KVSP_NGTCP2_OBJECTS_H

#include <Python.h>

#include "nq.h"

/* The buffers one registration (or one ObjectParser) holds: released only once the network
 * thread can no longer write into them. */
typedef struct nqpy_dests {
  Py_buffer *bufs;
  Py_ssize_t n;
} nqpy_dests;

int nqpy_dests_take(nqpy_dests *d, PyObject *dests, nq_objreg *reg);
void nqpy_dests_release(nqpy_dests *d);
const char *nqpy_result_name(unsigned result);
PyObject *nqpy_object_event(PyObject *name, uint64_t conn, int64_t sid, const nq_objinfo *o,
                            PyObject *props);
int nqpy_add_object_parser(PyObject *module);

#endif /* KVSP_NGTCP2_OBJECTS_H */
