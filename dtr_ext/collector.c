/* dtr_ext._collector: take objects out of, and give them back to, Python's cyclic collector.
 *
 * The engine keeps a few containers per recorded op (the record, its input and output lists,
 * the dependents dicts) for as long as the op may be replayed. The collector visits every
 * tracked object of the process in each full collection and starts one whenever the survivors
 * reach a quarter of its oldest generation, so those containers cost about 1 us per op each
 * (docs/runtime.md). The engine breaks their cycles itself (Note [Untracked records] in
 * dtr/core/runtime.py), so it can keep them out of the collector's sight.
 *
 * Only the public API: PyObject_GC_UnTrack and PyObject_GC_Track, on objects of types that
 * support the collector, guarded so that each is a no-op when the object is already in the
 * wanted state. Without this module (no compiler, DTR_PUREPYTHON=1) the engine behaves the
 * same; only the collector's work differs. Only dtr/core/collector.py imports it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define ABI_VERSION 2

static PyObject *untrack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *o = args[i];
        /* Never a weakref with a callback: when its referent dies in a garbage cycle, the
         * collector moves it onto its list of callbacks to call, which needs it tracked (an
         * untracked one crashed the process). One without a callback refers to nothing the
         * collector follows, and the collector only clears it. */
        if (PyWeakref_Check(o) && ((PyWeakReference *)o)->wr_callback != NULL) {
            PyErr_SetString(PyExc_TypeError, "dtr_ext._collector.untrack: weakrefs with a callback must stay tracked");
            return NULL;
        }
        if (PyObject_IS_GC(o) && PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
    }
    Py_RETURN_NONE;
}

static PyObject *track(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *o = args[i];
        if (PyObject_IS_GC(o) && !PyObject_GC_IsTracked(o)) PyObject_GC_Track(o);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"untrack", (PyCFunction)(void (*)(void))untrack, METH_FASTCALL,
     "untrack(*objs): the cyclic collector stops visiting these objects (no-op for the others; "
     "TypeError for a weakref with a callback, which must stay tracked)."},
    {"track", (PyCFunction)(void (*)(void))track, METH_FASTCALL,
     "track(*objs): the cyclic collector visits these objects again (no-op for the others)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dtr_ext._collector",
    "Take the engine's records out of, and give them back to, the cyclic collector.", -1, methods};

PyMODINIT_FUNC PyInit__collector(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
