/* dtr_ext._hotpath: the eager driver's per-op path in native code.
 *
 * ``dispatcher(driver)`` is ``Driver.dispatch`` bound to one driver: it takes the runtime's lock,
 * counts the op, applies queued wrapper deaths (``Runtime.drain``: eager eviction and release),
 * follows the autograd node, and runs itself an op of ``facts.simple`` (one new tensor, no
 * writes) or ``facts.several`` (several new tensors, no writes) whose keyword arguments hold no
 * tensors, one of ``facts.in_place`` (it writes its first argument and returns it) called
 * without keyword arguments, view ops returning one view or a list of views (``view_op``)
 * and autograd's gradient sums into a running sum already permanent
 * (``sum_op``: Note [Accumulation in place]); every other op goes to ``Driver._route`` (other
 * sums to ``Gradients._sum`` or ``_sum_as``), in Python.
 *
 * A simple op (``run_simple``, also callable from Python) is what ``Driver._run`` does: scan the
 * arguments (inputs, constants, the replay template and its slots), lock the inputs, make room
 * for the output near the budget (``Driver._make_room``: the size from output_size's cache and
 * Runtime.reserve's test natively; a miss, eviction and ``output_size.correct`` in Python),
 * run and time the kernel, make the ``Call`` record and the output's ``Storage``, register them as
 * ``Runtime.complete`` and ``outputs.wire`` do, unlock the inputs, and wrap the output as
 * ``tensor.make_wrapper`` and ``Runtime.track`` do. Where the Python path must run the op
 * instead (a random op, an evicted input, another engine's wrapper, nested lists, a tensor or
 * a non-empty list among the keyword arguments) it returns
 * the ``FALLBACK`` sentinel having changed nothing but wrappers resolved to their storage's newest version and parameters
 * hooked (which the Python path does first too), and the op goes to
 * ``Driver._execute``. After the kernel ran, outcomes other than one new strided tensor go to
 * ``Driver._register_one`` (the Python continuation), evicting for the budget to
 * ``outputs.fit``. An op of ``facts.several`` runs the same way up to the kernel; then
 * ``several_outputs`` registers its new strided tensors in one ``Call`` and hands back None
 * and empty outputs as they are, and any other outcome goes to ``Driver._register_several``.
 * An in-place op (``in_place_op``) on a resident tensor of the engine, whose inputs are all
 * resident, gives the written storage its new version as ``Runtime.complete`` does (its defined
 * views carried to the new version: ``storage.carry_views``); where the
 * Python path has more to do first (a written constant or handed-out tensor, lineage to make
 * permanent, an input to rematerialize) it returns ``FALLBACK`` for ``Driver._execute``.
 *
 * ``ordinary(index)`` is the candidate index's search for an eviction round's next victim
 * (``CandidateIndex._ordinary``): the rows in order of their bounds (numpy's argmin, then the
 * round's sorted chunks, which ``_sort_next`` makes in Python), the heap of scored rows, and
 * ``_examine``'s scoring of an ORDINARY row, with h_DTR^eq's ``key`` in C when the index's key
 * is ``DTREq.key`` (another heuristic's key is called in Python); a row of any other case goes
 * to ``_examine`` in Python. ``release(runtime, storage)`` is ``lineage.release``, which this file
 * also runs for wrapper deaths and unlocks: with h_DTR^eq's ``on_release`` in C, and
 * ``Constants.forget`` and ``use`` in C where every
 * constant keeps a use (a constant's first or last use goes to Python, which also tracks its
 * addresses). A runtime driven by the native path gets both, and ``wrapper_death(runtime)``,
 * ``Runtime._on_wrapper_death`` bound to it, as its wrappers' callback (``Driver._bind_native``).
 *
 * The Python code stays the definition: this file mirrors it statement for statement, calls the
 * heuristic's other hooks and the rarer branches in Python, and works on the
 * Python classes themselves (``Storage``, ``Call``, ``Ref``, ``DTRTensor``, ``Runtime`` with
 * ``__slots__``): ``bind`` reads each slot's offset from the class's member descriptor, and
 * refuses record classes whose slots are not exactly those this file fills, so that a field
 * added in Python without its twin here turns the native path off instead of leaving it unset
 * (and a Runtime without one of the fields this file reads). ``dtr/eager/native.py``
 * is the only module that imports this one; tests/test_native.py checks that both paths build
 * the same graph and make the same decisions.
 *
 * No torch headers: tensors are reached through their Python API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX */
#include <math.h>
#include <string.h>

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *o) {
    Py_INCREF(o);
    return o;
}
#endif

#define ABI_VERSION 5

/* ------------------------------------------------------------------------------------------ */
/* What ``bind`` supplies. */

static PyTypeObject *T_Runtime, *T_Tensor, *T_DTRTensor, *T_Storage, *T_Cell, *T_OpRecord, *T_Call, *T_Ref,
    *T_UFNode, *T_DTREq;
static PyObject *O_strided, *O_RESIDENT, *O_RELEASED, *O_SWAPPED, *O_fit, *O_mws, *O_dtreq_on_evict,
    *O_dtreq_on_release, *O_constants_forget, *O_constants_use, *O_ARGMINS, *O_LOG_LIMIT,
    *O_dtreq_key, *O_heappush, *O_heappop, *O_TOL, *O_F32_MAX, *O_make_room, *O_output_bytes,
    *O_output_size, *S_nan,
    *O_is_grad_enabled, *O_perf_counter, *O_no_kwargs, *O_first, *O_estimate_seconds,
    *O_correct_size,
    *O_FACTS, *O_facts_for, *O_FALLBACK, *O_current_node, *O_ADD, *O_MM, *O_EVICTED,
    *O_VIEW, *O_DETACH, *O_EXTERNAL, *O_ADD_, *O_ADD_FACTS, *O_graph_task_id, *O_accumulation;
static PyObject *EMPTY; /* () */
static PyObject *ONE;   /* 1 */
static Py_ssize_t LOG_LIMIT; /* heuristics._LOG_LIMIT */
static int untrack_gc; /* the collector module is native: untrack as it does */
static int bound;
static unsigned long long registered; /* ops registered natively, for tests */

/* Slot offsets. */
static Py_ssize_t W_dtr, R_cell;
enum { C_STORAGE, C_PARENT, C_INDEX, C_VALUE, C_FORWARD, C_N };
static const char *C_NAMES[C_N] = {"storage", "parent", "index", "value", "forward"};
static Py_ssize_t C_off[C_N];
#define C_storage C_off[C_STORAGE]
#define C_parent C_off[C_PARENT]
#define C_index C_off[C_INDEX]
#define C_value C_off[C_VALUE]
#define C_forward C_off[C_FORWARD]
static Py_ssize_t F_kernel, F_name, F_random, F_sized, F_simple, F_several, F_in_place, F_kind, F_one_view, F_list_view,
    F_view_of;
enum {
    S_runtime, S_sid, S_nbytes, S_state, S_locks, S_refs, S_uses, S_last_access, S_cost, S_parent,
    S_index, S_value, S_views, S_dependents, S_forward, S_hdata, S_slot, S_protected, S_backward,
    S_N
};
static const char *S_NAMES[S_N] = {
    "runtime", "sid", "nbytes", "state", "locks", "refs", "uses", "last_access", "cost", "parent",
    "index", "value", "views", "dependents", "forward", "hdata", "slot", "protected", "backward"};
static Py_ssize_t S_off[S_N];
enum {
    K_name, K_inputs, K_use_storages, K_outputs, K_cost, K_payload, K_replayable, K_live,
    K_func, K_args, K_kwargs, K_slots, K_rng, K_grad, K_versions, K_derive, K_fresh, K_consts,
    K_clone_args, K_N
};
static const char *K_NAMES[K_N] = {
    "name", "inputs", "use_storages", "outputs", "cost", "payload", "replayable", "live",
    "func", "args", "kwargs", "slots", "rng", "grad", "versions", "derive", "fresh", "consts",
    "clone_args"};
static Py_ssize_t K_off[K_N];
enum { K_RECORD = K_live + 1 }; /* OpRecord's own fields: Call's first ones */
static Py_ssize_t record_off[K_RECORD];
enum { U_parent, U_cost, U_size, U_N };
static const char *U_NAMES[U_N] = {"parent", "cost", "size"};
static Py_ssize_t U_off[U_N];
/* The Runtime fields this file reads and writes (Note [Runtime slots] in dtr/core/runtime.py). */
enum {
    RF_memory, RF__untrack, RF_resident, RF_budget, RF_work, RF__high, RF__dead, RF__all, RF_on_op, RF_host,
    RF_executor, RF_counters, RF_clock, RF_arriving, RF__wrapper_died, RF__views_alias_data, RF__sid,
    RF__refs, RF__on_release, RF__on_evict, RF__index, RF__backward, RF_lock, RF_closed, RF_N
};
static const char *RF_NAMES[RF_N] = {
    [RF_memory] = "memory", [RF__untrack] = "_untrack", [RF_resident] = "resident",
    [RF_budget] = "budget", [RF_work] = "work", [RF__high] = "_high", [RF__dead] = "_dead",
    [RF__all] = "_all", [RF_on_op] = "on_op", [RF_host] = "host", [RF_executor] = "executor",
    [RF_counters] = "counters", [RF_clock] = "clock", [RF_arriving] = "arriving",
    [RF__wrapper_died] = "_wrapper_died", [RF__views_alias_data] = "_views_alias_data",
    [RF__sid] = "_sid", [RF__refs] = "_refs", [RF__on_release] = "_on_release",
    [RF__on_evict] = "_on_evict", [RF__index] = "_index", [RF__backward] = "_backward",
    [RF_lock] = "lock", [RF_closed] = "closed"};
static Py_ssize_t RF_off[RF_N];

/* Interned attribute names. */
static PyObject *A_rt, *A_budget, *A_memory, *A_largest_output, *A_size_every_op, *A__make_room,
    *A_hooks, *A_requires_grad,
    *A_is_leaf, *A__base, *A_layout, *A_untyped_storage, *A_nbytes, *A_unlock,
    *A__register_one, *A_op_seconds, *A_clock, *A_work, *A__sid, *A__backward, *A_resident,
    *A__all, *A__untrack, *A__high, *A_on_op, *A__use_constants, *A_size, *A_is_contiguous,
    *A_storage_offset, *A_stride, *A_dtype, *A_device, *A__wrapper_died, *A__refs, *A_estimate,
    *A_lock, *A_acquire, *A_release, *A_ops, *A__dead, *A_node, *A_node_from,
    *A_set_backward, *A_next_sid, *A__summing, *A__sum, *A__execute, *A__route,
    *A_arriving, *A_pop, *A_value, *A__index, *A_drop, *A__on_evict, *A_replayable,
    *A__unreferenced, *A_counters, *A_eager_evictions, *A_popleft, *A__hook, *A__alias,
    *A_resolve, *A_executor, *A_forget, *A__on_release, *A_host, *A_leave, *A_shape,
    *A_numel, *A_element_size, *A__add_to_permanent, *A_exclusive, *A__sum_as, *A__register_several, *A__register,
    *A__views_alias_data, *A__examine, *A__checked, *A__rows, *A__picks, *A__small_below,
    *A__protected_from, *A__key, *A__now, *A__staleness, *A__buf, *A__bound, *A__la,
    *A__SIZES, *A__SETTLED, *A_reserve, *A_argmin, *A__log, *A_uses, *A__version, *A_forward,
    *A__order, *A__pos, *A__argmins, *A__sort_next, *A__slack,
    *A_parent, *A_inputs, *A_outputs, *A_retarget, *A_closed, *A_append, *A__on_wrapper_death;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

/* Set a slot to ``v`` (a new reference is taken). */
static inline void set_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    PyObject **p = (PyObject **)((char *)o + off);
    PyObject *old = *p;
    Py_XINCREF(v);
    *p = v;
    Py_XDECREF(old);
}

/* Set a slot to ``v``, stealing the reference; fails (-1) if ``v`` is NULL. */
static inline int steal_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    if (v == NULL) return -1;
    PyObject **p = (PyObject **)((char *)o + off);
    PyObject *old = *p;
    *p = v;
    Py_XDECREF(old);
    return 0;
}

/* ``o.<slot> += delta`` for an int slot. */
static inline int add_slot(PyObject *o, Py_ssize_t off, long long delta) {
    PyObject *v = SLOT(o, off);
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "dtr_ext._hotpath: an int slot is unset");
        return -1;
    }
    long long n = PyLong_AsLongLong(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    return steal_slot(o, off, PyLong_FromLongLong(n + delta));
}

/* ``o.<name> += delta`` for an int attribute; the new value in ``*out`` if given. */
static int add_attr(PyObject *o, PyObject *name, long long delta, long long *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    long long n = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    n += delta;
    if (out) *out = n;
    PyObject *w = PyLong_FromLongLong(n);
    if (w == NULL) return -1;
    int r = PyObject_SetAttr(o, name, w);
    Py_DECREF(w);
    return r;
}

/* ``*out = int(v)``, taking the reference to ``v`` (NULL: an error already set). */
static int take_ll(PyObject *v, long long *out) {
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int attr_ll(PyObject *o, PyObject *name, long long *out) {
    return take_ll(PyObject_GetAttr(o, name), out);
}

static int set_attr_ll(PyObject *o, PyObject *name, long long n) {
    PyObject *w = PyLong_FromLongLong(n);
    if (w == NULL) return -1;
    int r = PyObject_SetAttr(o, name, w);
    Py_DECREF(w);
    return r;
}

/* ``rt.<name>`` (a new reference): one load where ``rt`` is a Runtime (Note [Runtime slots]),
 * the attribute where it is a subclass, which may shadow a field. */
static inline PyObject *rt_get(PyObject *rt, int k, PyObject *name) {
    if (Py_IS_TYPE(rt, T_Runtime)) {
        PyObject *v = SLOT(rt, RF_off[k]);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(rt, name);
}

/* ``rt.<name> = v`` (``v`` borrowed). */
static inline int rt_set(PyObject *rt, int k, PyObject *name, PyObject *v) {
    if (!Py_IS_TYPE(rt, T_Runtime)) return PyObject_SetAttr(rt, name, v);
    set_slot(rt, RF_off[k], v);
    return 0;
}

static int rt_ll(PyObject *rt, int k, PyObject *name, long long *out) {
    return take_ll(rt_get(rt, k, name), out);
}

static int rt_set_ll(PyObject *rt, int k, PyObject *name, long long n) {
    PyObject *w = PyLong_FromLongLong(n);
    if (w == NULL) return -1;
    int r = rt_set(rt, k, name, w);
    Py_DECREF(w);
    return r;
}

/* ``rt.<name> += delta`` for an int field; the new value in ``*out`` if given. */
static int rt_add(PyObject *rt, int k, PyObject *name, long long delta, long long *out) {
    long long n;
    if (rt_ll(rt, k, name, &n) < 0) return -1;
    if (out) *out = n + delta;
    return rt_set_ll(rt, k, name, n + delta);
}

#define RT_GET(rt, f) rt_get(rt, RF_##f, A_##f)
#define RT_SET(rt, f, v) rt_set(rt, RF_##f, A_##f, v)
#define RT_LL(rt, f, out) rt_ll(rt, RF_##f, A_##f, out)
#define RT_SET_LL(rt, f, n) rt_set_ll(rt, RF_##f, A_##f, n)
#define RT_ADD(rt, f, d, out) rt_add(rt, RF_##f, A_##f, d, out)

/* Python's ``untrack`` of dtr/core/collector.py, for objects that are never weakrefs with a callback. */
static inline void gc_untrack(PyObject *o) {
    if (PyObject_IS_GC(o) && PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

/* A cell's storage (a storage is its own root cell), borrowed; NULL if ``c`` is neither. */
static inline PyObject *storage_of(PyObject *c) {
    if (Py_TYPE(c) == T_Storage) return c;
    if (Py_TYPE(c) == T_Cell) return SLOT(c, C_storage);
    return NULL;
}

static inline PyObject *value_of(PyObject *c) {
    return SLOT(c, Py_TYPE(c) == T_Storage ? S_off[S_value] : C_value);
}

static inline PyObject *call_method0(PyObject *o, PyObject *name) {
    PyObject *args[1] = {o};
    return PyObject_VectorcallMethod(name, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* ``ref.cell = rt.resolve(ref.cell)`` where the cell's storage has a newer version (Note
 * [Versions]); the current cell, borrowed from ``ref``. */
static PyObject *resolved(PyObject *rt, PyObject *ref) {
    PyObject *c = SLOT(ref, R_cell);
    PyObject *s = storage_of(c);
    if (s == NULL || SLOT(s, S_off[S_forward]) == Py_None) return c;
    if (c == s) { /* a root: its versions are the chain of ``forward``s */
        while (SLOT(s, S_off[S_forward]) != Py_None) s = SLOT(s, S_off[S_forward]);
        set_slot(ref, R_cell, s);
        return s;
    }
    PyObject *now = PyObject_CallMethodOneArg(rt, A_resolve, c);
    if (now == NULL) return NULL;
    if (storage_of(now) == NULL) {
        Py_DECREF(now);
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath: Runtime.resolve returned neither a Storage nor a Cell");
        return NULL;
    }
    set_slot(ref, R_cell, now);
    Py_DECREF(now);
    return SLOT(ref, R_cell);
}

static int hook_leaf(PyObject *driver, PyObject *a, PyObject **hooks);

/* Driver._scan for a simple op: 0 done, 1 the Python path must run the op, -1 error. */

static int scan(PyObject *items, PyObject *template, PyObject *values, PyObject *inputs,
                PyObject *slots, PyObject *consts, PyObject *rt, PyObject *driver,
                PyObject *where, PyObject **hooks) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    PyObject **it = PySequence_Fast_ITEMS(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = it[i];
        PyTypeObject *tp = Py_TYPE(a);
        if (tp == T_DTRTensor) {
            PyObject *ref = SLOT(a, W_dtr);
            if (ref == NULL) return 1;
            PyObject *c = SLOT(ref, R_cell);
            if (c == NULL) return 1;
            PyObject *s = storage_of(c);
            if (s == NULL || SLOT(s, S_off[S_runtime]) != rt) return 1; /* read by value */
            if ((c = resolved(rt, ref)) == NULL) return -1;
            PyObject *v = value_of(c);
            if (v == NULL || v == Py_None) return 1; /* evicted: acquire rematerializes it */
            PyObject *slot = where == NULL ? Py_BuildValue("(nin)", i, -1, PyList_GET_SIZE(inputs))
                                           : Py_BuildValue("(Onn)", where, i, PyList_GET_SIZE(inputs));
            if (slot == NULL) return -1;
            int r = PyList_Append(slots, slot);
            Py_DECREF(slot);
            if (r < 0 || PyList_Append(inputs, c) < 0) return -1;
            Py_INCREF(Py_None);
            PyList_SetItem(template, i, Py_None);
            Py_INCREF(v);
            PyList_SetItem(values, i, v);
        } else if (PyType_IsSubtype(tp, T_Tensor)) {
            if (hook_leaf(driver, a, hooks) < 0) return -1;
            if (PyList_Append(consts, a) < 0) return -1;
        } else if ((tp == &PyList_Type || tp == &PyTuple_Type) && Py_SIZE(a) > 0) {
            if (where != NULL) return 1; /* lists in lists: the Python path */
            PyObject *t = PySequence_List(a);
            PyObject *v = PySequence_List(a);
            PyObject *w = PyLong_FromSsize_t(i);
            PyObject *fast = PySequence_Fast(a, "");
            int r = -1;
            if (t && v && w && fast) r = scan(fast, t, v, inputs, slots, consts, rt, driver, w, hooks);
            Py_XDECREF(w);
            Py_XDECREF(fast);
            if (r != 0) {
                Py_XDECREF(t);
                Py_XDECREF(v);
                return r;
            }
            PyList_SetItem(template, i, t);
            PyList_SetItem(values, i, v);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* lineage.release and lineage._lose_output */

static int drop_values(PyObject *rt, PyObject *s);

/* Constants.forget's counting for a Call's ``consts`` where each constant keeps a use after it:
 * 1 when done (the uses counted down), 0 when one would lose its last use (nothing changed: the
 * Python method also forgets its addresses), -1 on an error. */
static int forget_kept(PyObject *constants, PyObject *consts) {
    if (!PyTuple_Check(consts)) return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(consts);
    if (n == 0) return 1;
    PyObject *uses = PyObject_GetAttr(constants, A_uses);
    if (uses == NULL) return -1;
    int r = PyDict_Check(uses);
    for (Py_ssize_t i = 0; r == 1 && i < n; i += 3) { /* each keeps a use: more than it loses here */
        PyObject *k = PyTuple_GET_ITEM(consts, i);
        long long lost = 0;
        for (Py_ssize_t j = 0; j < n; j += 3) lost += PyObject_RichCompareBool(PyTuple_GET_ITEM(consts, j), k, Py_EQ) == 1;
        PyObject *m = PyDict_GetItemWithError(uses, k);
        long long have = m ? PyLong_AsLongLong(m) : 0;
        if (PyErr_Occurred()) r = -1;
        else if (have <= lost) r = 0;
    }
    for (Py_ssize_t i = 0; r == 1 && i < n; i += 3) {
        PyObject *k = PyTuple_GET_ITEM(consts, i);
        PyObject *m = PyNumber_Subtract(PyDict_GetItem(uses, k), ONE);
        if (m == NULL || PyDict_SetItem(uses, k, m) < 0) r = -1;
        Py_XDECREF(m);
    }
    Py_DECREF(uses);
    return r;
}

/* rt.executor.forget(rec). The driver's is Constants.forget: a record whose constants all keep a
 * use is done here (``forget_kept``); other records go to Python. */
static int forget(PyObject *rt, PyObject *rec) {
    PyObject *executor = RT_GET(rt, executor);
    PyObject *fn = executor ? PyObject_GetAttr(executor, A_forget) : NULL;
    Py_XDECREF(executor);
    if (fn == NULL) return -1;
    if (PyMethod_Check(fn) && PyMethod_GET_FUNCTION(fn) == O_constants_forget) {
        if (!Py_IS_TYPE(rec, T_Call)) {
            Py_DECREF(fn);
            return 0;
        }
        int done = forget_kept(PyMethod_GET_SELF(fn), SLOT(rec, K_off[K_consts]));
        if (done < 0) {
            Py_DECREF(fn);
            return -1;
        }
        if (done) {
            Py_DECREF(fn);
            set_slot(rec, K_off[K_args], EMPTY);
            set_slot(rec, K_off[K_consts], EMPTY);
            set_slot(rec, K_off[K_kwargs], Py_None);
            set_slot(rec, K_off[K_rng], Py_None);
            return 0;
        }
    }
    PyObject *r = PyObject_CallOneArg(fn, rec);
    Py_DECREF(fn);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* lineage._lose_output(rt, rec, work): one of ``rec``'s output storages no longer names it. */
static int lose_output(PyObject *rt, PyObject *rec, PyObject *work) {
    if (add_slot(rec, K_off[K_live], -1) < 0) return -1;
    long long live = PyLong_AsLongLong(SLOT(rec, K_off[K_live]));
    if (live == -1 && PyErr_Occurred()) return -1;
    if (live) return 0;
    PyObject *ins = PySequence_Fast(SLOT(rec, K_off[K_use_storages]), "use_storages");
    if (ins == NULL) return -1;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(ins); j++) {
        PyObject *i = PySequence_Fast_GET_ITEM(ins, j);
        if (add_slot(i, S_off[S_uses], -1) < 0) goto fail;
        long long uses = PyLong_AsLongLong(SLOT(i, S_off[S_uses]));
        long long refs = PyLong_AsLongLong(SLOT(i, S_off[S_refs]));
        long long locks = PyLong_AsLongLong(SLOT(i, S_off[S_locks]));
        if (PyErr_Occurred()) goto fail;
        if (uses == 0 && refs == 0 && !locks && PyList_Append(work, i) < 0) goto fail;
    }
    Py_DECREF(ins);
    set_slot(rec, K_off[K_use_storages], EMPTY);
    return forget(rt, rec);
fail:
    Py_DECREF(ins);
    return -1;
}

static PyObject *uf_find(PyObject *node);

/* rt._on_release(s). h_DTR^eq's (a DTREq itself) is done here: with its candidate index
 * listening (``_log`` a list), ``_lower(s.deps(), s.cost)``; then ``_leave``. Other hooks are
 * called. */
static int on_release(PyObject *rt, PyObject *s) {
    PyObject *hook = RT_GET(rt, _on_release);
    if (hook == NULL) return -1;
    if (!(PyMethod_Check(hook) && PyMethod_GET_FUNCTION(hook) == O_dtreq_on_release &&
          Py_TYPE(PyMethod_GET_SELF(hook)) == T_DTREq)) {
        PyObject *done = PyObject_CallOneArg(hook, s);
        Py_DECREF(hook);
        if (done == NULL) return -1;
        Py_DECREF(done);
        return 0;
    }
    PyObject *h = SLOT(s, S_off[S_hdata]);
    if (h == Py_None) {
        Py_DECREF(hook);
        return 0;
    }
    PyObject *self = PyMethod_GET_SELF(hook);
    PyObject *log = PyObject_GetAttr(self, A__log);
    int r = log ? 0 : -1;
    if (log != NULL && log != Py_None) { /* self._lower(s.deps(), s.cost) */
        PyObject *parent = SLOT(s, S_off[S_parent]);
        PyObject *slack = PyObject_GetAttr(self, A__slack);
        PyObject *more = slack ? PyNumber_Add(slack, SLOT(s, S_off[S_cost])) : NULL;
        Py_XDECREF(slack);
        if (!PyList_Check(log)) {
            PyErr_SetString(PyExc_TypeError, "DTREq._log is not a list");
            r = -1;
        } else if (parent != Py_None &&
                   PyList_SetSlice(log, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, SLOT(parent, K_off[K_use_storages])) < 0) {
            r = -1;
        }
        if (r == 0 && (more == NULL || PyObject_SetAttr(self, A__slack, more) < 0)) r = -1;
        Py_XDECREF(more);
        if (r == 0 && PyList_GET_SIZE(log) > LOG_LIMIT && PyObject_SetAttr(self, A__log, Py_None) < 0) r = -1;
    }
    Py_XDECREF(log);
    Py_DECREF(hook);
    if (r < 0) return -1;
    PyObject *root = uf_find(h); /* _leave: find(s.hdata).cost -= s.cost */
    if (root == NULL) return -1;
    if (steal_slot(root, U_off[U_cost], PyNumber_Subtract(SLOT(root, U_off[U_cost]), SLOT(s, S_off[S_cost]))) < 0)
        return -1;
    set_slot(s, S_off[S_hdata], Py_None);
    return 0;
}

/* The body of lineage.release's loop for one storage ``s`` that may be released. */
static int release_one(PyObject *rt, PyObject *s, PyObject *work) {
    PyObject *state = SLOT(s, S_off[S_state]);
    long long refs = PyLong_AsLongLong(SLOT(s, S_off[S_refs]));
    long long uses = PyLong_AsLongLong(SLOT(s, S_off[S_uses]));
    long long locks = PyLong_AsLongLong(SLOT(s, S_off[S_locks]));
    if (PyErr_Occurred()) return -1;
    if (state == O_RELEASED || refs || uses || locks) return 0;
    if (state == O_RESIDENT) {
        PyObject *resident = RT_GET(rt, resident);
        if (resident == NULL) return -1;
        int r = PyObject_DelItem(resident, s);
        Py_DECREF(resident);
        long long nbytes = PyLong_AsLongLong(SLOT(s, S_off[S_nbytes]));
        if (r < 0 || (nbytes == -1 && PyErr_Occurred()) || RT_ADD(rt, memory, -nbytes, NULL) < 0) return -1;
    } else if (state == O_SWAPPED) {
        PyObject *host = RT_GET(rt, host);
        PyObject *r = host ? PyObject_CallMethodOneArg(host, A_leave, s) : NULL;
        Py_XDECREF(host);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    set_slot(s, S_off[S_state], O_RELEASED);
    /* Runtime._leave_graph(s) */
    PyObject *all = RT_GET(rt, _all);
    if (all == NULL) return -1;
    int r = PyObject_DelItem(all, s);
    Py_DECREF(all);
    if (r < 0) return -1;
    PyObject *untrack = RT_GET(rt, _untrack);
    if (untrack == NULL) return -1;
    if (untrack != Py_None && untrack_gc && !PyObject_GC_IsTracked(s)) PyObject_GC_Track(s);
    Py_DECREF(untrack);
    PyObject *rec = Py_NewRef(SLOT(s, S_off[S_parent]));
    int done = on_release(rt, s); /* may read s.parent */
    /* Its parent lists it as an output: the cycle is broken also if the heuristic raised. */
    set_slot(s, S_off[S_parent], Py_None);
    if (done < 0) {
        Py_DECREF(rec);
        return -1;
    }
    if (drop_values(rt, s) < 0) {
        Py_DECREF(rec);
        return -1;
    }
    set_slot(s, S_off[S_views], EMPTY);
    if (rec != Py_None) {
        PyObject *ins = PySequence_Fast(SLOT(rec, K_off[K_use_storages]), "use_storages");
        if (ins == NULL) {
            Py_DECREF(rec);
            return -1;
        }
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(ins); j++) {
            PyObject *deps = SLOT(PySequence_Fast_GET_ITEM(ins, j), S_off[S_dependents]);
            if (PyDict_Check(deps) && PyDict_GET_SIZE(deps) && PyDict_DelItem(deps, s) < 0) {
                if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
                    Py_DECREF(ins);
                    Py_DECREF(rec);
                    return -1;
                }
                PyErr_Clear();
            }
        }
        Py_DECREF(ins);
        r = lose_output(rt, rec, work);
    }
    Py_DECREF(rec);
    return r < 0 ? -1 : 0;
}

/* lineage.release(rt, s): drop ``s`` from the graph, then whatever only it kept alive. */
static int release(PyObject *rt, PyObject *s) {
    PyObject *work = PyList_New(1);
    if (work == NULL) return -1;
    PyList_SET_ITEM(work, 0, Py_NewRef(s));
    int r = 0;
    Py_ssize_t n;
    while (r == 0 && (n = PyList_GET_SIZE(work)) > 0) {
        PyObject *t = Py_NewRef(PyList_GET_ITEM(work, n - 1));
        r = PyList_SetSlice(work, n - 1, n, NULL);
        if (r == 0) r = release_one(rt, t, work);
        Py_DECREF(t);
    }
    Py_DECREF(work);
    return r;
}

/* Runtime.unlock: -1 if a release raised. */

static int unlock(PyObject *rt, PyObject *inputs) {
    Py_ssize_t n = PyList_GET_SIZE(inputs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = storage_of(PyList_GET_ITEM(inputs, i));
        if (add_slot(s, S_off[S_locks], -1) < 0) return -1;
        long long locks = PyLong_AsLongLong(SLOT(s, S_off[S_locks]));
        long long refs = PyLong_AsLongLong(SLOT(s, S_off[S_refs]));
        long long uses = PyLong_AsLongLong(SLOT(s, S_off[S_uses]));
        if (PyErr_Occurred()) return -1;
        if (locks == 0 && refs == 0 && uses == 0 && SLOT(s, S_off[S_state]) != O_RELEASED && release(rt, s) < 0)
            return -1;
    }
    return 0;
}

/* Runtime._drop_values(s) */
static int drop_values(PyObject *rt, PyObject *s) {
    PyObject *arriving = RT_GET(rt, arriving);
    if (arriving == NULL) return -1;
    int any = PyObject_IsTrue(arriving);
    if (any > 0) {
        PyObject *r = PyObject_CallMethodObjArgs(arriving, A_pop, s, Py_None, NULL);
        if (r == NULL) any = -1;
        Py_XDECREF(r);
    }
    Py_DECREF(arriving);
    if (any < 0) return -1;
    set_slot(s, S_off[S_value], Py_None);
    PyObject *views = PySequence_Fast(SLOT(s, S_off[S_views]), "views");
    if (views == NULL) return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(views); i++) {
        PyObject *c = PyObject_CallNoArgs(PySequence_Fast_GET_ITEM(views, i)); /* the weakref's cell */
        if (c == NULL) {
            Py_DECREF(views);
            return -1;
        }
        int r = c == Py_None ? 0 : PyObject_SetAttr(c, A_value, Py_None);
        Py_DECREF(c);
        if (r < 0) {
            Py_DECREF(views);
            return -1;
        }
    }
    Py_DECREF(views);
    set_slot(s, S_off[S_views], EMPTY);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* h_DTR^eq's on_evict (heuristics.DTREq.on_evict, over unionfind.py's find, union, attach). */

/* unionfind.find: the root of ``node``'s set (borrowed: ``node``, which the caller holds,
 * points at it once the path is compressed). */
static PyObject *uf_find(PyObject *node) {
    PyObject *root = node, *p;
    while ((p = SLOT(root, U_off[U_parent])) != Py_None) root = p;
    Py_INCREF(node);
    while (node != root) {
        PyObject *nxt = Py_NewRef(SLOT(node, U_off[U_parent]));
        set_slot(node, U_off[U_parent], root);
        Py_DECREF(node);
        node = nxt;
    }
    Py_DECREF(node);
    return root;
}

/* ``o.<slot> = o.<slot> + v`` with Python's addition (ints stay ints, floats add as floats). */
static int add_to_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    return steal_slot(o, off, PyNumber_Add(SLOT(o, off), v));
}

/* unionfind.union: the root of the merged set (borrowed, as uf_find's), or NULL. */
static PyObject *uf_union(PyObject *a, PyObject *b) {
    PyObject *ra = uf_find(a), *rb = uf_find(b);
    if (ra == rb) return ra;
    int smaller = PyObject_RichCompareBool(SLOT(ra, U_off[U_size]), SLOT(rb, U_off[U_size]), Py_LT);
    if (smaller < 0) return NULL;
    if (smaller) {
        PyObject *t = ra;
        ra = rb;
        rb = t;
    }
    set_slot(rb, U_off[U_parent], ra);
    if (add_to_slot(ra, U_off[U_size], SLOT(rb, U_off[U_size])) < 0 ||
        add_to_slot(ra, U_off[U_cost], SLOT(rb, U_off[U_cost])) < 0)
        return NULL;
    return ra;
}

/* Merge ``*node`` (NULL: none yet) with the set of neighbour ``n`` when it is evicted and in
 * one; ``*node`` is a new reference. */
static int merge_neighbour(PyObject **node, PyObject *n) {
    PyObject *h = SLOT(n, S_off[S_hdata]);
    if (SLOT(n, S_off[S_state]) != O_EVICTED || h == Py_None) return 0;
    if (*node == NULL) {
        *node = Py_NewRef(h);
        return 0;
    }
    PyObject *root = uf_union(*node, h);
    if (root == NULL) return -1;
    Py_SETREF(*node, Py_NewRef(root));
    return 0;
}

/* DTREq.on_evict(s) */
static int dtreq_on_evict(PyObject *s) {
    PyObject *node = NULL;
    PyObject *parent = SLOT(s, S_off[S_parent]);
    if (parent != Py_None) { /* s.deps() */
        PyObject *deps = PySequence_Fast(SLOT(parent, K_off[K_use_storages]), "use_storages");
        if (deps == NULL) return -1;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(deps); i++) {
            if (merge_neighbour(&node, PySequence_Fast_GET_ITEM(deps, i)) < 0) {
                Py_DECREF(deps);
                Py_XDECREF(node);
                return -1;
            }
        }
        Py_DECREF(deps);
    }
    PyObject *dependents = SLOT(s, S_off[S_dependents]);
    if (PyDict_Check(dependents)) {
        Py_ssize_t pos = 0;
        PyObject *n, *unused;
        while (PyDict_Next(dependents, &pos, &n, &unused)) {
            if (merge_neighbour(&node, n) < 0) {
                Py_XDECREF(node);
                return -1;
            }
        }
    }
    PyObject *cost = SLOT(s, S_off[S_cost]);
    if (node == NULL) { /* UFNode(s.cost) */
        node = T_UFNode->tp_alloc(T_UFNode, 0);
        PyObject *one = node ? PyLong_FromLong(1) : NULL;
        if (one == NULL) {
            Py_XDECREF(node);
            return -1;
        }
        set_slot(node, U_off[U_parent], Py_None);
        set_slot(node, U_off[U_cost], cost);
        steal_slot(node, U_off[U_size], one);
        if (untrack_gc) gc_untrack(node);
    } else { /* attach(node, s.cost) */
        PyObject *root = uf_find(node);
        PyObject *one = PyLong_FromLong(1);
        int r = one ? add_to_slot(root, U_off[U_cost], cost) : -1;
        if (r == 0) r = add_to_slot(root, U_off[U_size], one);
        Py_XDECREF(one);
        Py_SETREF(node, Py_NewRef(root));
        if (r < 0) {
            Py_DECREF(node);
            return -1;
        }
    }
    set_slot(s, S_off[S_hdata], node);
    Py_DECREF(node);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The candidate index's search (candidates.CandidateIndex._ordinary, with ``_examine``'s scoring
 * of an ORDINARY row and h_DTR^eq's ``key``). Rows of other cases go to ``_examine`` in Python. */

static double TOL, F32_MAX; /* candidates._TOL and _F32_MAX */
static long long ARGMINS;   /* candidates._ARGMINS */
static int recomputable(PyObject *s);

/* The distinct neighbouring sets DTREq.key has summed: a few, kept on the stack until more come. */
typedef struct {
    PyObject **items, *local[16];
    Py_ssize_t n, cap;
} Seen;

/* One neighbour ``n`` of DTREq.key's loop: adds its set's cost the first time the set is seen.
 * 0, or -1 on error. */
static int key_neighbour(PyObject *n, Seen *seen, double *cost) {
    PyObject *h = SLOT(n, S_off[S_hdata]);
    if (SLOT(n, S_off[S_state]) != O_EVICTED || h == Py_None) return 0;
    PyObject *r = uf_find(h);
    for (Py_ssize_t i = 0; i < seen->n; i++)
        if (seen->items[i] == r) return 0;
    if (seen->n == seen->cap) {
        Py_ssize_t cap = 2 * seen->cap;
        PyObject **items = PyMem_Malloc(cap * sizeof(PyObject *));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(items, seen->items, seen->n * sizeof(PyObject *));
        if (seen->items != seen->local) PyMem_Free(seen->items);
        seen->items = items;
        seen->cap = cap;
    }
    seen->items[seen->n++] = r;
    double c = PyFloat_AsDouble(SLOT(r, U_off[U_cost]));
    if (c == -1.0 && PyErr_Occurred()) return -1;
    *cost += c;
    return 0;
}

/* DTREq.key(s): a new float, or NULL. Sums in the Python loop's order, so the float is its. */
static PyObject *dtreq_key(PyObject *s) {
    double cost = PyFloat_AsDouble(SLOT(s, S_off[S_cost]));
    if (cost == -1.0 && PyErr_Occurred()) return NULL;
    Seen seen;
    seen.items = seen.local;
    seen.n = 0;
    seen.cap = 16;
    int r = 0;
    PyObject *parent = SLOT(s, S_off[S_parent]);
    if (parent != Py_None) { /* s.deps() */
        PyObject *deps = PySequence_Fast(SLOT(parent, K_off[K_use_storages]), "use_storages");
        if (deps == NULL) return NULL;
        for (Py_ssize_t i = 0; r == 0 && i < PySequence_Fast_GET_SIZE(deps); i++)
            r = key_neighbour(PySequence_Fast_GET_ITEM(deps, i), &seen, &cost);
        Py_DECREF(deps);
    }
    PyObject *dependents = SLOT(s, S_off[S_dependents]);
    if (r == 0 && PyDict_Check(dependents)) {
        Py_ssize_t pos = 0;
        PyObject *n, *unused;
        while (r == 0 && PyDict_Next(dependents, &pos, &n, &unused)) r = key_neighbour(n, &seen, &cost);
    }
    if (seen.items != seen.local) PyMem_Free(seen.items);
    if (r < 0) return NULL;
    long long nbytes = PyLong_AsLongLong(SLOT(s, S_off[S_nbytes]));
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    return PyFloat_FromDouble(cost / (double)(nbytes ? nbytes : 1));
}

/* What the search reads of the index, once per search (``_examine`` changes none of it). */
typedef struct {
    PyObject *index, *checked, *rows, *picks, *small_below, *protected_from, *key;
    long long now, base;
    int staleness, native_key;
    float *buf, *bound, *la;
    PyObject *buf_array; /* ``_buf`` itself, borrowed from its buffer view */
    Py_ssize_t n;
} Search;

/* candidates._margin */
static double margin(double score) {
    if (score - score != 0.0) return score;
    return score - fabs(score) * TOL;
}

static int scored(Search *x, Py_ssize_t slot, PyObject *s);

/* ``_examine(slot)`` where the row is an ORDINARY candidate's: 1 once scored into the round's
 * heap, 0 for any other case (the caller hands the row to the Python method), -1 on error. */
static int score_row(Search *x, Py_ssize_t slot) {
    PyObject *s = PyList_GET_ITEM(x->rows, slot);
    if (!Py_IS_TYPE(s, T_Storage) || SLOT(s, S_off[S_state]) != O_RESIDENT) return 0;
    PyObject *own = SLOT(s, S_off[S_slot]);
    if (!PyLong_CheckExact(own)) return 0;
    Py_ssize_t at_slot = PyLong_AsSsize_t(own);
    if (at_slot == -1 && PyErr_Occurred()) return -1;
    if (at_slot != slot) return 0;
    Py_INCREF(s); /* a Python key runs in between */
    int r = scored(x, slot, s);
    Py_DECREF(s);
    return r;
}

/* ``score_row`` for ``s``, the storage of its row. */
static int scored(Search *x, Py_ssize_t slot, PyObject *s) {
    int r = PyObject_IsTrue(SLOT(s, S_off[S_protected])); /* eviction.tier */
    if (r == 0) r = PyObject_RichCompareBool(SLOT(s, S_off[S_sid]), x->protected_from, Py_GE);
    if (r == 0) r = PyObject_IsTrue(SLOT(s, S_off[S_backward]));
    if (r == 0) r = PyObject_IsTrue(SLOT(s, S_off[S_locks]));
    if (r == 0) {
        r = recomputable(s);
        if (r >= 0) r = !r;
    }
    if (r == 0) r = PyObject_RichCompareBool(SLOT(s, S_off[S_nbytes]), x->small_below, Py_LT);
    if (r != 0) return r < 0 ? -1 : 0;
    PyObject *k = x->native_key ? dtreq_key(s) : PyObject_CallOneArg(x->key, s);
    if (k == NULL) return -1;
    double kd = PyFloat_AsDouble(k);
    long long la = PyLong_AsLongLong(SLOT(s, S_off[S_last_access]));
    if ((kd == -1.0 || la == -1) && PyErr_Occurred()) {
        Py_DECREF(k);
        return -1;
    }
    x->bound[slot] = (float)(F32_MAX < kd ? F32_MAX : kd); /* min(k, _F32_MAX), NaN kept */
    x->la[slot] = (float)(la - x->base);
    PyObject *score = x->staleness ? PyFloat_FromDouble(kd / (double)(x->now - la + 1)) : Py_NewRef(k);
    Py_DECREF(k);
    PyObject *at = score ? PyLong_FromSsize_t(slot) : NULL;
    PyObject *entry = at ? PyTuple_Pack(4, score, SLOT(s, S_off[S_sid]), at, x->picks) : NULL;
    Py_XDECREF(score);
    Py_XDECREF(at);
    if (entry == NULL) return -1;
    PyObject *done = PyObject_CallFunctionObjArgs(O_heappush, x->checked, entry, NULL);
    Py_DECREF(entry);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 1;
}

static int examine(Search *x, Py_ssize_t slot) {
    int r = score_row(x, slot);
    if (r != 0) return r < 0 ? -1 : 0;
    PyObject *at = PyLong_FromSsize_t(slot);
    PyObject *done = at ? PyObject_CallMethodOneArg(x->index, A__examine, at) : NULL;
    Py_XDECREF(at);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

/* One of the index's float32 arrays, writable, as many rows as ``_rows``. */
static float *rows_of(PyObject *index, PyObject *name, Py_buffer *view, Py_ssize_t n) {
    PyObject *a = PyObject_GetAttr(index, name);
    if (a == NULL) return NULL;
    int r = PyObject_GetBuffer(a, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS);
    Py_DECREF(a);
    if (r < 0) return NULL;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0 || view->len != n * 4) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.ordinary: the index's rows are not float32 arrays of its size");
        return NULL;
    }
    return (float *)view->buf;
}

/* The index's ``_order`` (slots, numpy intp): its items and their count in ``*n``, or NULL. */
static Py_ssize_t *order_of(PyObject *index, Py_buffer *view, Py_ssize_t *n) {
    PyObject *a = PyObject_GetAttr(index, A__order);
    if (a == NULL) return NULL;
    int r = PyObject_GetBuffer(a, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS);
    Py_DECREF(a);
    if (r < 0) return NULL;
    if (view->itemsize != (Py_ssize_t)sizeof(Py_ssize_t) || view->format == NULL ||
        (strcmp(view->format, "n") != 0 && strcmp(view->format, "l") != 0 && strcmp(view->format, "q") != 0)) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.ordinary: the index's order is not an intp array");
        return NULL;
    }
    *n = view->len / view->itemsize;
    return (Py_ssize_t *)view->buf;
}

static int attr_flag(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* CandidateIndex._ordinary(index) */
static PyObject *ordinary(PyObject *module, PyObject *index) {
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "dtr_ext._hotpath: bind() first");
        return NULL;
    }
    Search x = {index};
    Py_buffer views[3] = {{0}};
    Py_buffer order_view = {0};
    Py_ssize_t *order = NULL, norder = 0;
    long long pos = 0, argmins = 0;
    int state_read = 0; /* ``_pos`` and ``_argmins`` are to be written back */
    PyObject *result = NULL;
    x.checked = PyObject_GetAttr(index, A__checked);
    x.rows = x.checked ? PyObject_GetAttr(index, A__rows) : NULL;
    x.picks = x.rows ? PyObject_GetAttr(index, A__picks) : NULL;
    x.small_below = x.picks ? PyObject_GetAttr(index, A__small_below) : NULL;
    x.protected_from = x.small_below ? PyObject_GetAttr(index, A__protected_from) : NULL;
    x.key = x.protected_from ? PyObject_GetAttr(index, A__key) : NULL;
    if (x.key == NULL || attr_ll(index, A__now, &x.now) < 0 || attr_ll(index, A__base, &x.base) < 0 ||
        (x.staleness = attr_flag(index, A__staleness)) < 0)
        goto done;
    if (!PyList_CheckExact(x.checked) || !PyList_CheckExact(x.rows)) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.ordinary: the index's heap and rows must be lists");
        goto done;
    }
    x.native_key = PyMethod_Check(x.key) && PyMethod_GET_FUNCTION(x.key) == O_dtreq_key;
    x.n = PyList_GET_SIZE(x.rows);
    if ((x.buf = rows_of(index, A__buf, &views[0], x.n)) == NULL || (x.buf_array = views[0].obj, 0) ||
        (x.bound = rows_of(index, A__bound, &views[1], x.n)) == NULL ||
        (x.la = rows_of(index, A__la, &views[2], x.n)) == NULL)
        goto done;
    if (x.n == 0) {
        PyErr_SetString(PyExc_ValueError, "dtr_ext._hotpath.ordinary: an index without rows");
        goto done;
    }
    if (attr_ll(index, A__pos, &pos) < 0 || attr_ll(index, A__argmins, &argmins) < 0 ||
        (order = order_of(index, &order_view, &norder)) == NULL)
        goto done;
    state_read = 1;
    float *buf = x.buf;
    for (;;) {
        /* The unexamined row with the lowest bound (Note [Examination order]). */
        Py_ssize_t i;
        if (pos < norder) {
            i = order[pos];
        } else if (argmins < ARGMINS) {
            /* numpy's own argmin: vectorized, where a scalar loop over 10,000s of rows cost ~100 us */
            PyObject *at = PyObject_CallMethodNoArgs(x.buf_array, A_argmin);
            i = at ? PyNumber_AsSsize_t(at, PyExc_OverflowError) : -1;
            Py_XDECREF(at);
            if (i == -1 && PyErr_Occurred()) goto done;
        } else {
            PyBuffer_Release(&order_view);
            order_view.obj = NULL;
            PyObject *r = PyObject_CallMethodNoArgs(index, A__sort_next);
            Py_XDECREF(r);
            if (r == NULL || (order = order_of(index, &order_view, &norder)) == NULL) goto done;
            if (norder == 0) {
                PyErr_SetString(PyExc_ValueError, "dtr_ext._hotpath.ordinary: an empty order");
                goto done;
            }
            pos = 0;
            i = order[0];
        }
        if (i < 0 || i >= x.n) {
            PyErr_SetString(PyExc_IndexError, "dtr_ext._hotpath.ordinary: argmin out of the rows");
            goto done;
        }
        double lb = (double)buf[i];
        if (PyList_GET_SIZE(x.checked)) {
            PyObject *top = PyList_GET_ITEM(x.checked, 0);
            double score = PyFloat_AsDouble(PyTuple_GET_ITEM(top, 0));
            if (score == -1.0 && PyErr_Occurred()) goto done;
            if (lb == INFINITY || lb >= margin(score)) {
                PyObject *popped = PyObject_CallOneArg(O_heappop, x.checked);
                if (popped == NULL) goto done;
                Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(popped, 2));
                int now = slot == -1 && PyErr_Occurred() ? -1 : PyObject_RichCompareBool(PyTuple_GET_ITEM(popped, 3), x.picks, Py_EQ);
                Py_DECREF(popped);
                if (now < 0) goto done;
                if (now) {
                    result = Py_NewRef(PyList_GET_ITEM(x.rows, slot));
                    goto done;
                }
                if (examine(&x, slot) < 0) goto done; /* scored before this round's last eviction: re-score */
                continue;
            }
        } else if (lb == INFINITY) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        buf[i] = INFINITY;
        if (pos < norder)
            pos++;
        else
            argmins++;
        if (examine(&x, i) < 0) goto done;
    }
done:
    if (state_read) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* written back also when the search raised */
        if ((set_attr_ll(index, A__pos, pos) < 0 || set_attr_ll(index, A__argmins, argmins) < 0) && result) {
            Py_CLEAR(result);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        } else {
            if (type) PyErr_Clear();
            PyErr_Restore(type, value, tb);
        }
    }
    if (order_view.obj != NULL) PyBuffer_Release(&order_view);
    for (int v = 0; v < 3; v++)
        if (views[v].obj != NULL) PyBuffer_Release(&views[v]);
    Py_XDECREF(x.checked);
    Py_XDECREF(x.rows);
    Py_XDECREF(x.picks);
    Py_XDECREF(x.small_below);
    Py_XDECREF(x.protected_from);
    Py_XDECREF(x.key);
    return result;
}

/* Runtime._evict(s) */
static int evict(PyObject *rt, PyObject *s) {
    if (SLOT(s, S_off[S_slot]) != Py_None) { /* it has a row in the candidate index */
        PyObject *index = RT_GET(rt, _index);
        PyObject *r = index ? PyObject_CallMethodOneArg(index, A_drop, s) : NULL;
        Py_XDECREF(index);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    PyObject *resident = RT_GET(rt, resident);
    if (resident == NULL) return -1;
    int r = PyObject_DelItem(resident, s);
    Py_DECREF(resident);
    if (r < 0) return -1;
    long long nbytes = PyLong_AsLongLong(SLOT(s, S_off[S_nbytes]));
    if ((nbytes == -1 && PyErr_Occurred()) || RT_ADD(rt, memory, -nbytes, NULL) < 0) return -1;
    set_slot(s, S_off[S_state], O_EVICTED);
    if (drop_values(rt, s) < 0) return -1;
    PyObject *hook = RT_GET(rt, _on_evict);
    if (hook == NULL) return -1;
    /* Only DTREq itself: a subclass may keep other objects in ``hdata``. */
    if (PyMethod_Check(hook) && PyMethod_GET_FUNCTION(hook) == O_dtreq_on_evict &&
        Py_TYPE(PyMethod_GET_SELF(hook)) == T_DTREq) {
        Py_DECREF(hook);
        return dtreq_on_evict(s);
    }
    PyObject *done = PyObject_CallOneArg(hook, s);
    Py_DECREF(hook);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

/* Runtime._unreferenced(s): release, or eager eviction; a storage without lineage that may
 * yield to its dependents goes to the Python method. */
static int unreferenced(PyObject *rt, PyObject *s) {
    long long locks = PyLong_AsLongLong(SLOT(s, S_off[S_locks]));
    long long uses = PyLong_AsLongLong(SLOT(s, S_off[S_uses]));
    if (PyErr_Occurred()) return -1;
    if (locks) return 0;
    if (uses == 0) return release(rt, s);
    if (SLOT(s, S_off[S_state]) != O_RESIDENT) return 0;
    PyObject *parent = SLOT(s, S_off[S_parent]);
    int recomputable = 0;
    if (parent != Py_None) {
        PyObject *replayable = PyObject_GetAttr(parent, A_replayable);
        if (replayable == NULL) return -1;
        recomputable = PyObject_IsTrue(replayable);
        Py_DECREF(replayable);
        if (recomputable < 0) return -1;
    }
    PyObject *deps = SLOT(s, S_off[S_dependents]);
    if (!recomputable) {
        int any = PyObject_IsTrue(deps);
        if (any <= 0) return any;
        PyObject *r = PyObject_CallMethodOneArg(rt, A__unreferenced, s);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    PyObject *it = PyObject_GetIter(deps);
    if (it == NULL) return -1;
    PyObject *t;
    while ((t = PyIter_Next(it)) != NULL) {
        long long refs = PyLong_AsLongLong(SLOT(t, S_off[S_refs]));
        int kept = refs != 0 && SLOT(t, S_off[S_state]) == O_EVICTED;
        Py_DECREF(t);
        if (refs == -1 && PyErr_Occurred()) {
            Py_DECREF(it);
            return -1;
        }
        if (kept) { /* an evicted tensor the program holds is recomputed from this one */
            Py_DECREF(it);
            return 0;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred() || evict(rt, s) < 0) return -1;
    PyObject *counters = RT_GET(rt, counters);
    int r = counters ? add_attr(counters, A_eager_evictions, 1, NULL) : -1;
    Py_XDECREF(counters);
    return r;
}

/* Runtime.drain: apply queued wrapper deaths. */
static int drain(PyObject *rt) {
    PyObject *dead = RT_GET(rt, _dead);
    if (dead == NULL) return -1;
    for (;;) {
        Py_ssize_t n = PyObject_Length(dead);
        if (n <= 0) {
            Py_DECREF(dead);
            return (int)n;
        }
        PyObject *cell = call_method0(dead, A_popleft);
        if (cell == NULL) break;
        PyObject *s = storage_of(cell);
        if (s == NULL) {
            Py_DECREF(cell);
            PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath: a dead wrapper's cell is neither a Storage nor a Cell");
            break;
        }
        Py_INCREF(s);
        Py_DECREF(cell);
        while (SLOT(s, S_off[S_forward]) != Py_None) Py_SETREF(s, Py_NewRef(SLOT(s, S_off[S_forward])));
        int r = add_slot(s, S_off[S_refs], -1);
        if (r == 0 && PyLong_AsLongLong(SLOT(s, S_off[S_refs])) == 0) r = unreferenced(rt, s);
        Py_DECREF(s);
        if (r < 0) break;
    }
    Py_DECREF(dead);
    return -1;
}

/* Note [Letting go with an error pending]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * An error path lets go of what it held (the op's output, the scanned arguments, its record)
 * with its error set, and the last reference to a tensor runs torch's deallocator, which need
 * not keep a pending error: on an H100 (torch 2.11, Python 3.12) with
 * ``torch.cuda.memory._record_memory_history(stacks="python")`` on, freeing a refused op's
 * output cleared its ``OutOfBudgetError``, and ``dispatch`` returned NULL with no error set
 * (``SystemError: error return without exception set``). So an error path holds its error
 * aside while it lets go, as CPython does around finalizers, and puts it back after. */
typedef struct {
    PyObject *type, *value, *tb;
} Held;

/* The pending error, taken aside (nothing where none is set). */
static inline Held hold_error(void) {
    Held h = {NULL, NULL, NULL};
    if (PyErr_Occurred()) PyErr_Fetch(&h.type, &h.value, &h.tb);
    return h;
}

/* Put back the held error (one the cleanup raised is dropped). */
static inline void put_back(Held h) {
    if (h.type != NULL) PyErr_Restore(h.type, h.value, h.tb);
}

/* Py_DECREF(o) on an error path (Note [Letting go with an error pending]). */
static void let_go(PyObject *o) {
    Held held = hold_error();
    Py_DECREF(o);
    put_back(held);
}

/* Runtime.unlock on an error path, as Python's ``finally``/``except``: an error the unlock
 * raises replaces the pending one. */
static void unlock_after_error(PyObject *rt, PyObject *inputs) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (unlock(rt, inputs) < 0) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
    } else {
        PyErr_Restore(et, ev, tb);
    }
}

/* Runtime._new_storage(nbytes, rec, index, value, now): a new reference. */
static PyObject *new_storage(PyObject *rt, long long nbytes, PyObject *rec, Py_ssize_t index, PyObject *value,
                             PyObject *now, PyObject *cost) {
    long long sid;
    if (RT_ADD(rt, _sid, 1, &sid) < 0) return NULL;
    PyObject *s = T_Storage->tp_alloc(T_Storage, 0);
    if (s == NULL) return NULL;
    PyObject *zero = PyLong_FromLong(0);
    PyObject *backward = RT_GET(rt, _backward);
    int made_backward = backward ? PyObject_IsTrue(backward) : -1;
    if (zero == NULL || made_backward < 0 || steal_slot(s, S_off[S_sid], PyLong_FromLongLong(sid)) < 0 ||
        steal_slot(s, S_off[S_nbytes], PyLong_FromLongLong(nbytes)) < 0 ||
        steal_slot(s, S_off[S_index], PyLong_FromSsize_t(index)) < 0) {
        Py_XDECREF(backward);
        Py_XDECREF(zero);
        Py_DECREF(s);
        return NULL;
    }
    set_slot(s, S_off[S_runtime], rt);
    set_slot(s, S_off[S_state], O_RESIDENT);
    set_slot(s, S_off[S_locks], zero);
    set_slot(s, S_off[S_refs], zero);
    set_slot(s, S_off[S_uses], zero);
    set_slot(s, S_off[S_last_access], now);
    set_slot(s, S_off[S_cost], cost);
    set_slot(s, S_off[S_parent], rec);
    set_slot(s, S_off[S_value], value);
    set_slot(s, S_off[S_views], EMPTY);
    set_slot(s, S_off[S_dependents], EMPTY);
    set_slot(s, S_off[S_forward], Py_None);
    set_slot(s, S_off[S_hdata], Py_None);
    set_slot(s, S_off[S_slot], Py_None);
    set_slot(s, S_off[S_protected], zero);
    set_slot(s, S_off[S_backward], made_backward ? Py_True : Py_False);
    Py_DECREF(backward);
    Py_DECREF(zero);
    PyObject *resident = RT_GET(rt, resident);
    PyObject *all = RT_GET(rt, _all);
    PyObject *untrack = RT_GET(rt, _untrack);
    int ok = resident && all && untrack && PyDict_SetItem(resident, s, Py_None) == 0 &&
             PyDict_SetItem(all, s, Py_None) == 0;
    if (ok && untrack != Py_None && untrack_gc) gc_untrack(s);
    Py_XDECREF(resident);
    Py_XDECREF(all);
    Py_XDECREF(untrack);
    if (!ok || RT_ADD(rt, memory, nbytes, NULL) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return s;
}

/* outputs.wire(rt, rec, new, now) */
static int wire(PyObject *rt, PyObject *rec, PyObject *new, PyObject *now) {
    Py_ssize_t live = PyList_GET_SIZE(new);
    if (steal_slot(rec, K_off[K_live], PyLong_FromSsize_t(live)) < 0) return -1;
    PyObject *inputs = SLOT(rec, K_off[K_inputs]);
    Py_ssize_t n = PyList_GET_SIZE(inputs);
    for (Py_ssize_t i = 0; i < n; i++) set_slot(storage_of(PyList_GET_ITEM(inputs, i)), S_off[S_last_access], now);
    if (!live || SLOT(rec, K_off[K_replayable]) != Py_True) {
        PyObject *outputs = SLOT(rec, K_off[K_outputs]);
        if (!live && PyList_GET_SIZE(outputs)) { /* a view op's record */
            PyObject *untrack = RT_GET(rt, _untrack);
            if (untrack == NULL) return -1;
            int untracking = untrack != Py_None && untrack_gc;
            Py_DECREF(untrack);
            if (untracking) {
                gc_untrack(rec);
                gc_untrack(inputs);
                gc_untrack(outputs);
            }
        }
        return 0;
    }
    PyObject *ins;
    if (n == 1) {
        PyObject *c = PyList_GET_ITEM(inputs, 0);
        if (Py_TYPE(c) == T_Storage) {
            Py_INCREF(inputs);
            ins = inputs;
        } else {
            ins = PyTuple_Pack(1, storage_of(c));
        }
    } else if (n == 2 && PyList_GET_ITEM(inputs, 0) != PyList_GET_ITEM(inputs, 1) &&
               Py_TYPE(PyList_GET_ITEM(inputs, 0)) == T_Storage &&
               Py_TYPE(PyList_GET_ITEM(inputs, 1)) == T_Storage) {
        Py_INCREF(inputs);
        ins = inputs;
    } else {
        PyObject *seen = PyDict_New();
        if (seen == NULL) return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (PyDict_SetItem(seen, storage_of(PyList_GET_ITEM(inputs, i)), Py_None) < 0) {
                Py_DECREF(seen);
                return -1;
            }
        }
        PyObject *keys = PyDict_Keys(seen);
        Py_DECREF(seen);
        if (keys == NULL) return -1;
        ins = PyList_AsTuple(keys);
        Py_DECREF(keys);
    }
    if (ins == NULL) return -1;
    set_slot(rec, K_off[K_use_storages], ins);
    PyObject *untrack = RT_GET(rt, _untrack);
    if (untrack == NULL) {
        Py_DECREF(ins);
        return -1;
    }
    int untracking = untrack != Py_None && untrack_gc;
    Py_DECREF(untrack);
    Py_ssize_t m = PySequence_Fast_GET_SIZE(ins);
    PyObject **items = PySequence_Fast_ITEMS(ins);
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *s = items[i];
        if (add_slot(s, S_off[S_uses], 1) < 0) goto fail;
        PyObject *deps = SLOT(s, S_off[S_dependents]);
        int truth = PyObject_IsTrue(deps);
        if (truth < 0) goto fail;
        if (!truth) {
            if (steal_slot(s, S_off[S_dependents], PyDict_New()) < 0) goto fail;
            deps = SLOT(s, S_off[S_dependents]);
        }
        for (Py_ssize_t j = 0; j < live; j++)
            if (PyObject_SetItem(deps, PyList_GET_ITEM(new, j), Py_None) < 0) goto fail;
        if (untracking) gc_untrack(deps);
    }
    if (untracking) {
        gc_untrack(rec);
        gc_untrack(inputs);
        gc_untrack(SLOT(rec, K_off[K_outputs]));
        gc_untrack(ins);
    }
    Py_DECREF(ins);
    return 0;
fail:
    Py_DECREF(ins);
    return -1;
}

static int add_view(PyObject *s, PyObject *c);

/* outputs.new_view(base's storage, rec, index, value): a new reference. */
static PyObject *new_view(PyObject *rt, PyObject *base, PyObject *rec, Py_ssize_t index, PyObject *value) {
    PyObject *c = T_Cell->tp_alloc(T_Cell, 0);
    if (c == NULL) return NULL;
    PyObject *at = PyLong_FromSsize_t(index);
    if (at == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    set_slot(c, C_storage, storage_of(base));
    set_slot(c, C_parent, rec);
    steal_slot(c, C_index, at);
    set_slot(c, C_value, value);
    set_slot(c, C_forward, Py_None);
    if (add_view(storage_of(base), c) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    PyObject *untrack = RT_GET(rt, _untrack);
    if (untrack == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    int untracked = untrack != Py_None && untrack_gc;
    Py_DECREF(untrack);
    if (untracked) {
        PyObject *weak = PyWeakref_NewRef(c, NULL); /* add_view's, which the record shares */
        if (weak == NULL) {
            Py_DECREF(c);
            return NULL;
        }
        gc_untrack(c);
        gc_untrack(weak);
        Py_DECREF(weak);
    }
    return c;
}

/* ------------------------------------------------------------------------------------------ */
/* storage.carry_views, with ``translate``, ``_sibling_record``, ``Call.retarget`` and
 * ``Storage.add_view`` */

/* The object a weak reference refers to, or None: a new reference, NULL on error. */
static PyObject *deref(PyObject *w) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o;
    if (PyWeakref_GetRef(w, &o) < 0) return NULL;
    return o ? o : Py_NewRef(Py_None);
#else
    return Py_NewRef(PyWeakref_GetObject(w));
#endif
}

/* Whether the collector module is native and ``storage.runtime._untrack`` is set: -1 on error. */
static int untracking_of(PyObject *storage) {
    PyObject *untrack = RT_GET(SLOT(storage, S_off[S_runtime]), _untrack);
    if (untrack == NULL) return -1;
    Py_DECREF(untrack);
    return untrack != Py_None && untrack_gc;
}

/* Storage.add_view(s, c) */
static int add_view(PyObject *s, PyObject *c) {
    PyObject *views = SLOT(s, S_off[S_views]);
    int truth = PyObject_IsTrue(views);
    if (truth < 0) return -1;
    if (!truth) {
        if (steal_slot(s, S_off[S_views], PyList_New(0)) < 0) return -1;
        views = SLOT(s, S_off[S_views]);
        int untracking = untracking_of(s);
        if (untracking < 0) return -1;
        if (untracking) gc_untrack(views); /* weak references only: Note [Untracked records] */
    }
    if (!PyList_Check(views)) {
        PyErr_SetString(PyExc_TypeError, "Storage.views is not a list");
        return -1;
    }
    PyObject *weak = PyWeakref_NewRef(c, NULL);
    if (weak == NULL) return -1;
    int r = PyList_Append(views, weak);
    Py_DECREF(weak);
    if (r < 0) return -1;
    Py_ssize_t n = PyList_GET_SIZE(views);
    if ((n & 63) == 0) { /* drop the weakrefs of dead view cells now and then */
        PyObject *kept = PyList_New(0);
        if (kept == NULL) return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *w = PyList_GET_ITEM(views, i);
            PyObject *o = deref(w);
            if (o == NULL || (o != Py_None && PyList_Append(kept, w) < 0)) {
                Py_XDECREF(o);
                Py_DECREF(kept);
                return -1;
            }
            Py_DECREF(o);
        }
        r = PyList_SetSlice(views, 0, n, kept);
        Py_DECREF(kept);
        if (r < 0) return -1;
    }
    return 0;
}

/* storage._sibling_record(rec, base, index): a new reference to the record, Py_None when there
 * is none, NULL on error. */
static PyObject *sibling_record(PyObject *rec, PyObject *base, Py_ssize_t index) {
    PyObject *outs = SLOT(rec, K_off[K_outputs]);
    if (!PyList_Check(outs)) {
        PyErr_SetString(PyExc_TypeError, "OpRecord.outputs is not a list");
        return NULL;
    }
    for (int step = -1; step <= 1; step += 2) {
        for (Py_ssize_t j = index + step; 0 <= j && j < PyList_GET_SIZE(outs); j += step) {
            PyObject *w = PyList_GET_ITEM(outs, j);
            if (!PyWeakref_CheckRefExact(w)) continue;
            PyObject *d = deref(w);
            if (d == NULL) return NULL;
            if (d == Py_None) {
                Py_DECREF(d);
                continue;
            }
            PyObject *f = PyObject_GetAttr(d, A_forward);
            Py_DECREF(d);
            if (f == NULL) return NULL;
            PyObject *found = Py_NewRef(Py_None);
            if (f != Py_None) { /* f.parent, if f.parent.inputs[0] is base */
                PyObject *parent = PyObject_GetAttr(f, A_parent);
                PyObject *inputs = parent ? PyObject_GetAttr(parent, A_inputs) : NULL;
                PyObject *first = inputs ? PySequence_GetItem(inputs, 0) : NULL;
                Py_XDECREF(inputs);
                if (first == NULL) {
                    Py_XDECREF(parent);
                    Py_DECREF(f);
                    Py_DECREF(found);
                    return NULL;
                }
                Py_DECREF(first);
                if (first == base) Py_SETREF(found, parent);
                else Py_DECREF(parent);
            }
            Py_DECREF(f);
            return found; /* the nearest live sibling decides */
        }
    }
    return Py_NewRef(Py_None);
}

/* rec.retarget([base]) with no outputs yet: Call.retarget natively, another record's in Python. */
static PyObject *retarget(PyObject *rec, PyObject *base) {
    PyObject *inputs = PyList_New(1);
    if (inputs == NULL) return NULL;
    PyList_SET_ITEM(inputs, 0, Py_NewRef(base));
    if (!Py_IS_TYPE(rec, T_Call)) {
        PyObject *r = PyObject_CallMethodOneArg(rec, A_retarget, inputs);
        Py_DECREF(inputs);
        return r;
    }
    PyObject *c = T_Call->tp_alloc(T_Call, 0);
    PyObject *zero = c ? PyLong_FromLong(0) : NULL;
    PyObject *outputs = zero ? PyList_New(0) : NULL;
    if (outputs == NULL) {
        Py_XDECREF(zero);
        Py_XDECREF(c);
        Py_DECREF(inputs);
        return NULL;
    }
    for (int k = 0; k < K_N; k++) set_slot(c, K_off[k], SLOT(rec, K_off[k]));
    steal_slot(c, K_off[K_inputs], inputs);
    set_slot(c, K_off[K_use_storages], EMPTY);
    steal_slot(c, K_off[K_outputs], outputs);
    set_slot(c, K_off[K_payload], Py_None);
    steal_slot(c, K_off[K_live], zero);
    return c;
}

/* storage.translate(cell) */
static int translate(PyObject *cell) {
    PyObject *s2 = SLOT(SLOT(cell, C_storage), S_off[S_forward]);
    PyObject *chain = PyList_New(0);
    if (chain == NULL) return -1;
    PyObject *c = cell;
    int r = -1;
    PyObject *base = NULL;
    for (;;) { /* the root's forward is the new version itself: the walk stops there */
        PyObject *f = PyObject_GetAttr(c, A_forward);
        if (f == NULL) goto done;
        Py_DECREF(f);
        if (f != Py_None) {
            base = Py_NewRef(f);
            break;
        }
        if (!Py_IS_TYPE(c, T_Cell)) { /* a storage's forward is set: only views walk */
            PyErr_SetString(PyExc_TypeError, "dtr internal error: translating a view over a non-cell");
            goto done;
        }
        if (PyList_Append(chain, c) < 0) goto done;
        PyObject *inputs = PyObject_GetAttr(SLOT(c, C_parent), A_inputs);
        PyObject *first = inputs ? PySequence_GetItem(inputs, 0) : NULL;
        Py_XDECREF(inputs);
        if (first == NULL) goto done;
        c = first; /* held by its record's inputs */
        Py_DECREF(first);
    }
    int untracking = untracking_of(s2);
    if (untracking < 0) goto done;
    for (Py_ssize_t i = PyList_GET_SIZE(chain) - 1; i >= 0; i--) {
        c = PyList_GET_ITEM(chain, i);
        PyObject *rec = SLOT(c, C_parent);
        Py_ssize_t index = PyLong_AsSsize_t(SLOT(c, C_index));
        if (index == -1 && PyErr_Occurred()) goto done;
        PyObject *rec2 = sibling_record(rec, base, index);
        if (rec2 == NULL) goto done;
        int made = rec2 == Py_None;
        if (made) {
            Py_DECREF(rec2);
            rec2 = retarget(rec, base);
            Py_ssize_t n = PyList_Check(SLOT(rec, K_off[K_outputs])) ? PyList_GET_SIZE(SLOT(rec, K_off[K_outputs])) : -1;
            PyObject *none = rec2 && n >= 0 ? PyList_New(n) : NULL;
            if (none == NULL) {
                if (rec2 && n < 0) PyErr_SetString(PyExc_TypeError, "OpRecord.outputs is not a list");
                Py_XDECREF(rec2);
                goto done;
            }
            for (Py_ssize_t j = 0; j < n; j++) PyList_SET_ITEM(none, j, Py_NewRef(Py_None));
            if (PyObject_SetAttr(rec2, A_outputs, none) < 0) {
                Py_DECREF(none);
                Py_DECREF(rec2);
                goto done;
            }
            Py_DECREF(none);
        }
        PyObject *c2 = T_Cell->tp_alloc(T_Cell, 0); /* Cell(s2, rec2, c.index, None) */
        if (c2 == NULL) {
            Py_DECREF(rec2);
            goto done;
        }
        set_slot(c2, C_storage, s2);
        set_slot(c2, C_parent, rec2);
        set_slot(c2, C_index, SLOT(c, C_index));
        set_slot(c2, C_value, Py_None);
        set_slot(c2, C_forward, Py_None);
        PyObject *weak = PyWeakref_NewRef(c2, NULL); /* Note [Views held weakly] */
        PyObject *outs2 = weak ? PyObject_GetAttr(rec2, A_outputs) : NULL;
        int set = outs2 ? PySequence_SetItem(outs2, index, weak) : -1;
        if (set == 0 && untracking) {
            /* As new_view's, the weak reference to the cell included: Note [Untracked records] */
            gc_untrack(c2);
            gc_untrack(weak);
            if (made) {
                gc_untrack(rec2);
                gc_untrack(SLOT(rec2, K_off[K_inputs]));
                gc_untrack(outs2);
            }
        }
        Py_XDECREF(outs2);
        Py_XDECREF(weak);
        Py_DECREF(rec2);
        if (set < 0) {
            Py_DECREF(c2);
            goto done;
        }
        set_slot(c, C_forward, c2);
        Py_SETREF(base, c2);
    }
    r = 0;
done:
    Py_XDECREF(base);
    Py_DECREF(chain);
    return r;
}

/* storage.carry_views(s) */
static int carry_views(PyObject *s) {
    PyObject *s2 = SLOT(s, S_off[S_forward]);
    PyObject *views = PySequence_Fast(SLOT(s, S_off[S_views]), "Storage.views");
    if (views == NULL) return -1;
    int r = 0;
    for (Py_ssize_t i = 0; r == 0 && i < PySequence_Fast_GET_SIZE(views); i++) {
        PyObject *c = deref(PySequence_Fast_GET_ITEM(views, i));
        if (c == NULL) {
            r = -1;
            break;
        }
        if (c != Py_None && Py_IS_TYPE(c, T_Cell) && SLOT(c, C_value) != Py_None && SLOT(c, C_forward) == Py_None) {
            r = translate(c);
            if (r == 0) {
                PyObject *c2 = SLOT(c, C_forward);
                set_slot(c2, C_value, SLOT(c, C_value));
                r = add_view(s2, c2);
            }
        }
        Py_DECREF(c);
    }
    Py_DECREF(views);
    return r;
}

/* ``s.recomputable``: 1, 0, or -1 on error. */
static int recomputable(PyObject *s) {
    PyObject *parent = SLOT(s, S_off[S_parent]);
    return parent == Py_None ? 0 : PyObject_IsTrue(SLOT(parent, K_off[K_replayable]));
}

/* The new version of ``s``, which ``rec`` wrote in place, as its output 0 (Runtime.complete's
 * loop over ``mutated``, ``rec.replayable`` already decided): a new reference, or NULL. */
static PyObject *new_version(PyObject *rt, PyObject *rec, PyObject *s, PyObject *now) {
    long long nbytes = PyLong_AsLongLong(SLOT(s, S_off[S_nbytes]));
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    PyObject *s2 = new_storage(rt, nbytes, rec, 0, SLOT(s, S_off[S_value]), now, SLOT(rec, K_off[K_cost]));
    PyObject *zero = s2 ? PyLong_FromLong(0) : NULL;
    if (zero == NULL) {
        Py_XDECREF(s2);
        return NULL;
    }
    set_slot(s2, S_off[S_refs], SLOT(s, S_off[S_refs]));
    set_slot(s, S_off[S_refs], zero);
    set_slot(s2, S_off[S_protected], SLOT(s, S_off[S_protected])); /* the same tensor for a plan */
    set_slot(s, S_off[S_protected], zero);
    Py_DECREF(zero);
    set_slot(s, S_off[S_forward], s2);
    PyObject *alias = RT_GET(rt, _views_alias_data);
    int carry = alias ? PyObject_IsTrue(alias) : -1;
    Py_XDECREF(alias);
    if (carry > 0 && PyObject_IsTrue(SLOT(s, S_off[S_views]))) { /* no views: carry_views does nothing */
        carry = carry_views(s);
    }
    /* the old version's bytes now belong to the new one: no memory is freed */
    if (carry < 0 || evict(rt, s) < 0) {
        Py_DECREF(s2);
        return NULL;
    }
    return s2;
}

/* Runtime.complete(rec, mutated, fresh) for a runtime without a host tier, where ``mutated`` is
 * NULL or the one storage ``rec`` wrote in place (its new version is output 0), and ``fresh``
 * is ``n`` new storages (``nbytes[i]``, ``values[i]``; none for an op that made nothing): the
 * first fresh output's cell (a new reference; the others are in ``rec.outputs``; None when
 * ``n`` is 0); or, with ``base`` (and no ``mutated``), ``n`` views of it (``values[i]``; n >= 1):
 * a tuple of their cells. NULL with the inputs unlocked on error. */
static PyObject *complete(PyObject *rt, PyObject *rec, Py_ssize_t n, const long long *nbytes,
                          PyObject *const *values, PyObject *base, PyObject *mutated) {
    PyObject *s = NULL, *outs = NULL, *new = NULL, *now = NULL, *work = NULL;
    long long clock, memory, high, added = 0;
    Py_ssize_t m = mutated != NULL;
    if (RT_ADD(rt, clock, 1, &clock) < 0) goto fail;
    now = PyLong_FromLongLong(clock);
    if (now == NULL) goto fail;
    work = RT_GET(rt, work);
    if (work == NULL) goto fail;
    Py_SETREF(work, PyNumber_Add(work, SLOT(rec, K_off[K_cost])));
    if (work == NULL || RT_SET(rt, work, work) < 0) goto fail;
    if (base == NULL) {
        outs = PyList_New(m + n);
        new = PyList_New(m + n);
        if (outs == NULL || new == NULL) goto fail;
        if (m) {
            int r = recomputable(mutated);
            if (r < 0) goto fail;
            if (!r) set_slot(rec, K_off[K_replayable], Py_False); /* its input cannot be rebuilt */
            PyObject *t = new_version(rt, rec, mutated, now);
            if (t == NULL) goto fail;
            Py_INCREF(t);
            PyList_SET_ITEM(outs, 0, t);
            PyList_SET_ITEM(new, 0, t);
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *t = new_storage(rt, nbytes[i], rec, m + i, values[i], now, SLOT(rec, K_off[K_cost]));
            if (t == NULL) goto fail;
            Py_INCREF(t);
            PyList_SET_ITEM(outs, m + i, t);
            PyList_SET_ITEM(new, m + i, t);
            added += nbytes[i];
        }
        s = Py_NewRef(n ? PyList_GET_ITEM(outs, m) : Py_None);
    } else {
        s = PyTuple_New(n);
        outs = PyList_New(n);
        new = PyList_New(0);
        if (s == NULL || outs == NULL || new == NULL) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = new_view(rt, base, rec, i, values[i]);
            if (v == NULL) goto fail;
            PyTuple_SET_ITEM(s, i, v);
            PyObject *weak = PyWeakref_NewRef(v, NULL); /* Note [Views held weakly] */
            if (weak == NULL) goto fail;
            PyList_SET_ITEM(outs, i, weak);
        }
    }
    set_slot(rec, K_off[K_outputs], outs);
    if (RT_LL(rt, memory, &memory) < 0 || RT_LL(rt, _high, &high) < 0) goto fail;
    if (memory > high && RT_SET_LL(rt, _high, memory) < 0) goto fail;
    if (added) {
        PyObject *budget = RT_GET(rt, budget);
        if (budget == NULL) goto fail;
        int over = 0;
        if (budget != Py_None) {
            long long b = PyLong_AsLongLong(budget);
            if (b == -1 && PyErr_Occurred()) {
                Py_DECREF(budget);
                goto fail;
            }
            over = memory > b;
        }
        Py_DECREF(budget);
        if (over) {
            PyObject *versions = PyLong_FromSsize_t(m);
            PyObject *r = versions ? PyObject_CallFunctionObjArgs(O_fit, rt, rec, new, versions, NULL) : NULL;
            Py_XDECREF(versions);
            if (r == NULL) goto fail;
            Py_DECREF(r);
        }
    }
    if (wire(rt, rec, new, now) < 0) goto fail;
    Py_CLEAR(outs);
    Py_CLEAR(new);
    Py_CLEAR(now);
    Py_CLEAR(work);
    if (unlock(rt, SLOT(rec, K_off[K_inputs])) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    PyObject *on_op = RT_GET(rt, on_op);
    if (on_op == NULL) {
        Py_DECREF(s);
        return NULL;
    }
    if (on_op != Py_None) {
        PyObject *r = PyObject_CallOneArg(on_op, rt);
        Py_DECREF(on_op);
        if (r == NULL) {
            Py_DECREF(s);
            return NULL;
        }
        Py_DECREF(r);
    } else {
        Py_DECREF(on_op);
    }
    return s;
fail: {
    Held held = hold_error(); /* Note [Letting go with an error pending] */
    Py_XDECREF(s);
    Py_XDECREF(outs);
    Py_XDECREF(new);
    Py_XDECREF(now);
    Py_XDECREF(work);
    put_back(held);
    unlock_after_error(rt, SLOT(rec, K_off[K_inputs])); /* the finally of Runtime.complete */
    return NULL;
}
}

/* Call(name, inputs, cost, True, func, args, kwargs, slots, grad) with rng None and ``fresh``. */
static PyObject *new_call(PyObject *name, PyObject *inputs, PyObject *cost, PyObject *func,
                          PyObject *args, PyObject *kwargs, PyObject *slots, PyObject *grad, PyObject *fresh) {
    PyObject *c = T_Call->tp_alloc(T_Call, 0);
    if (c == NULL) return NULL;
    PyObject *zero = PyLong_FromLong(0);
    PyObject *empty = EMPTY;
    PyObject *outputs = PyList_New(0);
    if (zero == NULL || outputs == NULL) {
        Py_XDECREF(zero);
        Py_XDECREF(outputs);
        Py_DECREF(c);
        return NULL;
    }
    set_slot(c, K_off[K_name], name);
    set_slot(c, K_off[K_inputs], inputs);
    set_slot(c, K_off[K_use_storages], empty);
    steal_slot(c, K_off[K_outputs], outputs);
    set_slot(c, K_off[K_cost], cost);
    set_slot(c, K_off[K_payload], Py_None);
    set_slot(c, K_off[K_replayable], Py_True);
    set_slot(c, K_off[K_live], zero);
    set_slot(c, K_off[K_func], func);
    set_slot(c, K_off[K_args], args);
    set_slot(c, K_off[K_kwargs], kwargs);
    set_slot(c, K_off[K_slots], slots);
    set_slot(c, K_off[K_rng], Py_None);
    set_slot(c, K_off[K_grad], grad);
    set_slot(c, K_off[K_versions], zero);
    set_slot(c, K_off[K_derive], Py_None);
    set_slot(c, K_off[K_fresh], fresh);
    set_slot(c, K_off[K_consts], empty);
    set_slot(c, K_off[K_clone_args], empty);
    Py_DECREF(zero);
    return c;
}

/* tensor.make_wrapper(value, rt, cell) with Runtime.track. */
static PyObject *make_wrapper(PyObject *value, PyObject *rt, PyObject *cell) {
    PyObject *size = call_method0(value, A_size);
    if (size == NULL) return NULL;
    PyObject *w = NULL, *dtype = NULL, *device = NULL, *contig = NULL, *offset = NULL, *ref = NULL;
    int plain = 0;
    contig = call_method0(value, A_is_contiguous);
    if (contig == NULL) goto done;
    if (contig == Py_True) {
        offset = call_method0(value, A_storage_offset);
        if (offset == NULL) goto done;
        long long off = PyLong_AsLongLong(offset);
        if (off == -1 && PyErr_Occurred()) goto done;
        if (off == 0) {
            plain = 1;
            Py_ssize_t n = PyTuple_GET_SIZE(size); /* torch.Size is a tuple */
            for (Py_ssize_t i = 0; i < n && plain; i++) {
                long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(size, i));
                if (d == -1 && PyErr_Occurred()) goto done;
                if (d == 0 || d == 1) plain = 0;
            }
        }
    }
    dtype = PyObject_GetAttr(value, A_dtype);
    device = PyObject_GetAttr(value, A_device);
    if (dtype == NULL || device == NULL) goto done;
    if (plain) {
        PyObject *a[8] = {(PyObject *)T_DTRTensor, size, Py_None, Py_None, Py_None, dtype, O_strided, device};
        w = PyObject_Vectorcall(O_mws, a, 8, NULL);
    } else {
        PyObject *stride = call_method0(value, A_stride);
        Py_XSETREF(offset, call_method0(value, A_storage_offset));
        if (stride == NULL || offset == NULL) {
            Py_XDECREF(stride);
            goto done;
        }
        PyObject *a[8] = {(PyObject *)T_DTRTensor, size, stride, offset, Py_None, dtype, O_strided, device};
        w = PyObject_Vectorcall(O_mws, a, 8, NULL);
        Py_DECREF(stride);
    }
    if (w == NULL) goto done;
    /* Runtime.track */
    PyObject *cb = RT_GET(rt, _wrapper_died);
    if (cb == NULL) goto fail;
    ref = PyObject_CallFunctionObjArgs((PyObject *)T_Ref, w, cb, NULL);
    Py_DECREF(cb);
    if (ref == NULL) goto fail;
    set_slot(ref, R_cell, cell);
    PyObject *refs = RT_GET(rt, _refs);
    if (refs == NULL) goto fail;
    PyObject *key = PyLong_FromVoidPtr(ref);
    int r = key ? PyDict_SetItem(refs, key, ref) : -1;
    Py_XDECREF(key);
    Py_DECREF(refs);
    if (r < 0 || add_slot(storage_of(cell), S_off[S_refs], 1) < 0) goto fail;
    set_slot(w, W_dtr, ref);
    goto done;
fail:
    Py_CLEAR(w);
done:
    Py_XDECREF(ref);
    Py_XDECREF(size);
    Py_XDECREF(contig);
    Py_XDECREF(offset);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return w;
}

static int seconds_now(double *t) {
    PyObject *v = PyObject_CallNoArgs(O_perf_counter);
    if (v == NULL) return -1;
    *t = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*t == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------ */

/* With ``cost="estimate"``, replace ``*seconds`` by the estimate (Driver._register_one, and
 * _register: ``out`` is then the tuple of the outputs, as ``flat`` makes it for several). */
static int estimated(PyObject *driver, PyObject *func, PyObject *vals, PyObject *kw, PyObject *out, int several,
                     PyObject **seconds) {
    PyObject *estimate = PyObject_GetAttr(driver, A_estimate);
    if (estimate == NULL) return -1;
    int on = PyObject_IsTrue(estimate);
    Py_DECREF(estimate);
    if (on <= 0) return on;
    PyObject *outs = several ? Py_NewRef(out) : PyTuple_Pack(1, out);
    PyObject *e = outs ? PyObject_CallFunctionObjArgs(O_estimate_seconds, func, vals, kw, outs, NULL) : NULL;
    Py_XDECREF(outs);
    if (e == NULL) return -1;
    Py_SETREF(*seconds, e);
    return 0;
}

/* ``driver.op_seconds += seconds`` */
static int add_seconds(PyObject *driver, PyObject *seconds) {
    PyObject *total = PyObject_GetAttr(driver, A_op_seconds);
    if (total == NULL) return -1;
    Py_SETREF(total, PyNumber_Add(total, seconds));
    int r = total ? PyObject_SetAttr(driver, A_op_seconds, total) : -1;
    Py_XDECREF(total);
    return r;
}

/* What ``Driver._scan`` fills for one op's arguments: the replay templates, the values, the
 * input cells with their slots, the constants (and parameters hooked on the way). ``tkw`` and
 * ``kw``, the keyword arguments' template and values, are NULL for a call without any: ``TKW``
 * and ``KW`` give what the Python path then passes (None, and the read-only empty mapping). */
typedef struct {
    PyObject *targs, *vals, *inputs, *slots, *consts, *hooks, *tkw, *kw;
} Scanned;
#define SCANNED_EMPTY {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}
#define TKW(sc) ((sc).tkw ? (sc).tkw : Py_None)
#define KW(sc) ((sc).kw ? (sc).kw : O_no_kwargs)

/* Whether no keyword argument holds a tensor, for ``Driver._scan`` to find: then it leaves
 * each value as it is, in both the template and the values (a non-empty list or tuple it would
 * copy into a list: the Python path takes those). */
static int plain_kwargs(PyObject *kwargs) {
    Py_ssize_t pos = 0;
    PyObject *key, *v;
    while (PyDict_Next(kwargs, &pos, &key, &v)) {
        PyTypeObject *tp = Py_TYPE(v);
        if (PyType_IsSubtype(tp, T_Tensor)) return 0;
        if ((tp == &PyList_Type || tp == &PyTuple_Type) && Py_SIZE(v) > 0) return 0;
    }
    return 1;
}

/* Scan ``args`` and ``kwargs`` (a dict, or NULL for none) into ``sc`` (every field set or
 * NULL), after ``first`` in ``sc->inputs`` where it is not NULL (a written storage's old root):
 * 0 done, 1 the Python path must run the op, -1 error. ``scanned_clear`` releases ``sc`` in
 * every case. */
static int scan_args(PyObject *args, PyObject *kwargs, PyObject *rt, PyObject *driver, Scanned *sc,
                     PyObject *first) {
    sc->targs = PySequence_List(args);
    sc->vals = PySequence_List(args);
    sc->inputs = first == NULL ? PyList_New(0) : PyList_New(1);
    sc->slots = PyList_New(0);
    sc->consts = PyList_New(0);
    sc->hooks = sc->tkw = sc->kw = NULL;
    if (!sc->targs || !sc->vals || !sc->inputs || !sc->slots || !sc->consts) return -1;
    if (kwargs != NULL) {
        if (!plain_kwargs(kwargs)) return 1;
        if ((sc->tkw = PyDict_Copy(kwargs)) == NULL || (sc->kw = PyDict_Copy(kwargs)) == NULL) return -1;
    }
    if (first != NULL) PyList_SET_ITEM(sc->inputs, 0, Py_NewRef(first));
    return scan(args, sc->targs, sc->vals, sc->inputs, sc->slots, sc->consts, rt, driver, NULL, &sc->hooks);
}

static void scanned_clear(Scanned *sc) {
    Py_CLEAR(sc->targs);
    Py_CLEAR(sc->vals);
    Py_CLEAR(sc->inputs);
    Py_CLEAR(sc->slots);
    Py_CLEAR(sc->consts);
    Py_CLEAR(sc->hooks);
    Py_CLEAR(sc->tkw);
    Py_CLEAR(sc->kw);
}

/* Runtime.acquire where every input is defined: lock them (-1, none locked, on error). */
static int lock_defined(PyObject *inputs) {
    Py_ssize_t n = PyList_GET_SIZE(inputs);
    for (Py_ssize_t i = 0; i < n; i++)
        if (add_slot(storage_of(PyList_GET_ITEM(inputs, i)), S_off[S_locks], 1) < 0) {
            /* unreachable for int slots; undo the locks taken */
            for (Py_ssize_t j = 0; j < i; j++) add_slot(storage_of(PyList_GET_ITEM(inputs, j)), S_off[S_locks], -1);
            return -1;
        }
    return 0;
}

/* How the Python path sorts an output ``o`` (recording.sort_outputs): 1 a new strided tensor
 * of ``*nbytes`` bytes (0: empty, handed back as it is), 0 anything else (an input or constant
 * returned, another type or layout: the Python continuation sorts it), -1 on error. */
static int sort_output(PyObject *o, PyObject *inputs, PyObject *consts, long long *nbytes) {
    if (Py_TYPE(o) != T_Tensor) return 0;
    PyObject *layout = PyObject_GetAttr(o, A_layout);
    if (layout == NULL) return -1;
    Py_DECREF(layout);
    if (layout != O_strided) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(inputs); i++)
        if (value_of(PyList_GET_ITEM(inputs, i)) == o) return 0; /* an input returned */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(consts); i++)
        if (PyList_GET_ITEM(consts, i) == o) return 0; /* the Python path raises */
    PyObject *us = call_method0(o, A_untyped_storage);
    PyObject *nb = us ? call_method0(us, A_nbytes) : NULL;
    Py_XDECREF(us);
    if (nb == NULL) return -1;
    *nbytes = PyLong_AsLongLong(nb);
    Py_DECREF(nb);
    return *nbytes == -1 && PyErr_Occurred() ? -1 : 1;
}

/* Constants.use(consts) where every constant is in its ``uses`` already: a new reference to the
 * tuple it returns, NULL on an error, or Py_None (a new reference) for a constant it has not
 * seen, which the Python method registers (nothing is changed here then). */
static PyObject *use_known(PyObject *constants, PyObject *consts) {
    PyObject *uses = PyObject_GetAttr(constants, A_uses);
    if (uses == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(consts);
    PyObject *info = PyTuple_New(3 * n);
    if (info == NULL || !PyDict_Check(uses)) {
        if (info) PyErr_SetString(PyExc_TypeError, "Constants.uses is not a dict");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* k = id(t if t._base is None else t._base) */
        PyObject *t = PyList_GET_ITEM(consts, i);
        PyObject *b = PyObject_GetAttr(t, A__base);
        if (b == NULL) goto fail;
        PyObject *k = PyLong_FromVoidPtr(b == Py_None ? t : b);
        Py_DECREF(b);
        if (k == NULL) goto fail;
        PyTuple_SET_ITEM(info, 3 * i, k);
        PyObject *known = PyDict_GetItemWithError(uses, k);
        if (known == NULL) {
            if (PyErr_Occurred()) goto fail;
            Py_DECREF(info);
            Py_DECREF(uses);
            Py_RETURN_NONE;
        }
        PyObject *version = PyObject_GetAttr(t, A__version);
        if (version == NULL) goto fail;
        PyTuple_SET_ITEM(info, 3 * i + 1, Py_NewRef(t));
        PyTuple_SET_ITEM(info, 3 * i + 2, version);
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* uses[k] += 1, once all are known */
        PyObject *k = PyTuple_GET_ITEM(info, 3 * i);
        PyObject *m = PyNumber_Add(PyDict_GetItem(uses, k), ONE);
        if (m == NULL || PyDict_SetItem(uses, k, m) < 0) {
            Py_XDECREF(m);
            goto fail;
        }
        Py_DECREF(m);
    }
    Py_DECREF(uses);
    return info;
fail:
    Py_XDECREF(info);
    Py_DECREF(uses);
    return NULL;
}

/* ``call.consts = driver._use_constants(consts)``, untracked (Note [Untracked records]). The
 * driver's is Constants.use: constants it has seen are counted here (``use_known``). */
static int use_constants(PyObject *driver, PyObject *call, PyObject *consts) {
    PyObject *use = PyObject_GetAttr(driver, A__use_constants);
    if (use == NULL) return -1;
    PyObject *info = Py_None;
    if (PyMethod_Check(use) && PyMethod_GET_FUNCTION(use) == O_constants_use) {
        info = use_known(PyMethod_GET_SELF(use), consts);
        if (info == NULL) {
            Py_DECREF(use);
            return -1;
        }
    } else {
        Py_INCREF(info);
    }
    if (info == Py_None) {
        Py_DECREF(info);
        info = PyObject_CallOneArg(use, consts);
    }
    Py_DECREF(use);
    if (info == NULL) return -1;
    steal_slot(call, K_off[K_consts], info);
    if (untrack_gc) {
        gc_untrack(SLOT(call, K_off[K_args]));
        gc_untrack(info);
    }
    return 0;
}

static PyObject *several_outputs(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *func,
                                 PyObject *out, PyObject *seconds, Scanned *sc, PyObject *grad,
                                 PyObject *args, PyObject *kwargs, Py_ssize_t several);

/* ------------------------------------------------------------------------------------------ */
/* Room before an op (Driver._make_room, over output_size.output_bytes's cache lookup and
 * Runtime.reserve's test); a miss of the cache, an argument that cannot be hashed and eviction
 * itself stay Python. */

/* output_size._signature(a): a new reference, or NULL. */
static PyObject *signature(PyObject *a) {
    if (PyObject_TypeCheck(a, T_Tensor)) {
        PyObject *shape = PyObject_GetAttr(a, A_shape);
        PyObject *dtype = shape ? PyObject_GetAttr(a, A_dtype) : NULL;
        PyObject *layout = dtype ? PyObject_GetAttr(a, A_layout) : NULL;
        PyObject *sig = layout ? PyTuple_Pack(3, shape, dtype, layout) : NULL;
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        Py_XDECREF(layout);
        return sig;
    }
    PyTypeObject *t = Py_TYPE(a);
    if (t == &PyList_Type || t == &PyTuple_Type) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
        PyObject *sig = PyTuple_New(n);
        if (sig == NULL) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *b = signature(PySequence_Fast_GET_ITEM(a, i));
            if (b == NULL) {
                Py_DECREF(sig);
                return NULL;
            }
            PyTuple_SET_ITEM(sig, i, b);
        }
        return sig;
    }
    if (t == &PyFloat_Type || t == &PyLong_Type || t == &PyBool_Type) {
        /* 1, 1.0 and True are equal keys, but give outputs of other dtypes; NaN equals nothing. */
        int nan = t == &PyFloat_Type && isnan(PyFloat_AS_DOUBLE(a));
        return PyTuple_Pack(2, (PyObject *)t, nan ? S_nan : a);
    }
    return Py_NewRef(a);
}

/* output_size.output_bytes(func, args, kwargs) where its cache answers: (key or None, bytes) in
 * ``*key`` (new) and ``*nbytes``; 1 when it answered, 0 for a miss or an argument that cannot
 * be hashed (the caller asks Python), -1 on error. */
static int cached_size(PyObject *func, PyObject *args, PyObject *kwargs, PyObject **key, long long *nbytes) {
    *key = NULL;
    int has_kw = PyObject_IsTrue(kwargs);
    if (has_kw < 0) return -1;
    PyObject *kwsig = Py_NewRef(Py_None);
    if (has_kw) {
        PyObject *items = PyMapping_Items(kwargs);
        PyObject *tup = items ? PySequence_Tuple(items) : NULL;
        Py_XDECREF(items);
        Py_SETREF(kwsig, tup ? signature(tup) : NULL);
        Py_XDECREF(tup);
        if (kwsig == NULL) return -1;
    }
    PyObject *argsig = signature(args);
    PyObject *k = argsig ? PyTuple_Pack(3, func, argsig, kwsig) : NULL;
    Py_XDECREF(argsig);
    Py_DECREF(kwsig);
    PyObject *sizes = k ? PyObject_GetAttr(O_output_size, A__SIZES) : NULL;
    PyObject *settled = sizes ? PyObject_GetAttr(O_output_size, A__SETTLED) : NULL;
    int r = -1;
    if (settled == NULL) goto done;
    if (!PyDict_CheckExact(sizes) || !PySet_Check(settled)) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath: output_size's cache must be a dict and a set");
        goto done;
    }
    PyObject *n = PyDict_GetItemWithError(sizes, k);
    if (n == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto done;
            PyErr_Clear(); /* an argument that cannot be hashed: Python's lookup says what to do */
        }
        r = 0;
        goto done;
    }
    *nbytes = PyLong_AsLongLong(n);
    if (*nbytes == -1 && PyErr_Occurred()) goto done;
    int in = PySet_Contains(settled, k);
    if (in < 0) goto done;
    *key = in ? Py_NewRef(Py_None) : Py_NewRef(k);
    r = 1;
done:
    Py_XDECREF(k);
    Py_XDECREF(sizes);
    Py_XDECREF(settled);
    return r;
}

/* Driver._make_room(facts, func, args, kwargs): the size's key (a new reference), or NULL. A
 * ``_make_room`` replaced on the class or the driver (a benchmark timing it) is called. */
static PyObject *make_room(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *func, PyObject *args,
                           PyObject *kwargs) {
    PyObject *hook = PyObject_GetAttr(driver, A__make_room);
    if (hook == NULL) return NULL;
    if (O_make_room == NULL || !PyMethod_Check(hook) || PyMethod_GET_FUNCTION(hook) != O_make_room) {
        PyObject *key = PyObject_CallFunctionObjArgs(hook, facts, func, args, kwargs, NULL);
        Py_DECREF(hook);
        return key;
    }
    Py_DECREF(hook);
    PyObject *key;
    long long nbytes;
    int r = cached_size(func, args, kwargs, &key, &nbytes);
    if (r < 0) return NULL;
    if (r == 0) { /* key, nbytes = output_size.output_bytes(func, args, kwargs) */
        PyObject *pair = PyObject_CallFunctionObjArgs(O_output_bytes, func, args, kwargs, NULL);
        if (pair == NULL) return NULL;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath: output_bytes must return a pair");
            return NULL;
        }
        key = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
        nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(pair);
        if (nbytes == -1 && PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
    }
    if (nbytes) { /* self.rt.reserve(nbytes, facts.name), past its test */
        long long memory, budget;
        PyObject *b = RT_GET(rt, budget);
        int over = b == NULL ? -1 : 0;
        if (b != NULL && b != Py_None) {
            budget = PyLong_AsLongLong(b);
            over = (budget == -1 && PyErr_Occurred()) || RT_LL(rt, memory, &memory) < 0 ? -1
                                                                                         : memory + nbytes > budget;
        }
        Py_XDECREF(b);
        if (over > 0) {
            PyObject *n = PyLong_FromLongLong(nbytes);
            PyObject *done = n ? PyObject_CallMethodObjArgs(rt, A_reserve, n, SLOT(facts, F_name), NULL) : NULL;
            Py_XDECREF(n);
            if (done == NULL) over = -1;
            Py_XDECREF(done);
        }
        if (over < 0) {
            Py_DECREF(key);
            return NULL;
        }
    }
    return key;
}

/* Driver._run for a simple op, or one of ``facts.several``, called with ``kwargs`` (NULL for
 * none): a new reference, or FALLBACK having changed nothing but resolved wrappers and hooked
 * parameters (header). */
static PyObject *simple_op(PyObject *driver, PyObject *facts, PyObject *func, PyObject *args, PyObject *kwargs) {
    PyObject *rt = NULL, *out = NULL, *grad = NULL, *result = NULL, *sized = NULL;
    Scanned sc = SCANNED_EMPTY;
    int locked = 0, room = 0;
    if (SLOT(facts, F_random) != Py_False) return Py_NewRef(O_FALLBACK);
    Py_ssize_t several = PyLong_AsSsize_t(SLOT(facts, F_several));
    if (several == -1 && PyErr_Occurred()) return NULL;
    rt = PyObject_GetAttr(driver, A_rt);
    if (rt == NULL) return NULL;
    {
        /* Note [Room before an op] in driver.py: room is made once the inputs are locked */
        PyObject *budget = RT_GET(rt, budget);
        if (budget == NULL) goto error;
        if (budget != Py_None && SLOT(facts, F_sized) == Py_True) {
            long long b = PyLong_AsLongLong(budget), memory, largest, every;
            Py_DECREF(budget);
            if ((b == -1 && PyErr_Occurred()) || RT_LL(rt, memory, &memory) < 0 ||
                attr_ll(driver, A_largest_output, &largest) < 0 ||
                attr_ll(driver, A_size_every_op, &every) < 0)
                goto error;
            room = every || memory + largest > b;
        } else {
            Py_DECREF(budget);
        }
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    int r = scan_args(args, kwargs, rt, driver, &sc, NULL);
    if (r < 0) goto error;
    if (r > 0) goto fallback;
    PyObject *targs = sc.targs, *vals = sc.vals, *inputs = sc.inputs, *slots = sc.slots, *consts = sc.consts;
    if (lock_defined(inputs) < 0) goto error;
    locked = 1;
    if (room) { /* Driver._make_room: the size's key, to correct by what the op makes */
        sized = make_room(driver, rt, facts, func, vals, KW(sc));
        if (sized == NULL) goto error;
    }
    double t0, t1;
    grad = PyObject_CallNoArgs(O_is_grad_enabled);
    if (grad == NULL || seconds_now(&t0) < 0) goto error;
    out = PyObject_VectorcallDict(SLOT(facts, F_kernel), PySequence_Fast_ITEMS(vals), n, sc.kw);
    if (out == NULL || seconds_now(&t1) < 0) goto error;
    if (sized != NULL && sized != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(O_correct_size, sized, out, vals, KW(sc), NULL);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    PyObject *seconds = PyFloat_FromDouble(t1 - t0);
    if (seconds == NULL) goto error;
    if (several) {
        locked = 0; /* several_outputs unlocks on every outcome */
        result = several_outputs(driver, rt, facts, func, out, seconds, &sc, grad, args, kwargs, several);
        goto done;
    }
    long long nbytes = 0;
    int native = sort_output(out, inputs, consts, &nbytes);
    if (native < 0) goto error_seconds;
    if (!native || !nbytes) {
        /* Driver._register_one: the Python continuation (it unlocks on error) */
        locked = 0;
        PyObject *a[14] = {driver, facts, func, out, seconds, inputs, targs, TKW(sc),
                           slots, consts, grad, Py_None, vals, KW(sc)};
        result = PyObject_VectorcallMethod(A__register_one, a, 14 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(seconds);
        goto done;
    }
    /* Driver._register_one's common case: one new strided tensor */
    if (estimated(driver, func, vals, KW(sc), out, 0, &seconds) < 0) goto error_seconds;
    {
        if (add_seconds(driver, seconds) < 0) goto error_seconds;
        long long largest;
        if (attr_ll(driver, A_largest_output, &largest) < 0) goto error_seconds;
        if (nbytes > largest && set_attr_ll(driver, A_largest_output, nbytes) < 0) goto error_seconds;
    }
    PyObject *targs_t = PyList_AsTuple(targs);
    PyObject *slots_t = targs_t ? PyList_AsTuple(slots) : NULL;
    PyObject *call = slots_t ? new_call(SLOT(facts, F_name), inputs, seconds, func, targs_t, TKW(sc), slots_t, grad, O_first) : NULL;
    Py_XDECREF(targs_t);
    Py_XDECREF(slots_t);
    Py_DECREF(seconds);
    if (call == NULL) goto error;
    locked = 0; /* complete unlocks, also when it fails */
    PyObject *cell = complete(rt, call, 1, &nbytes, &out, NULL, NULL);
    if (cell == NULL) {
        let_go(call);
        goto error;
    }
    if (PyList_GET_SIZE(consts) && use_constants(driver, call, consts) < 0) {
        let_go(cell);
        let_go(call);
        goto error;
    }
    result = make_wrapper(out, rt, cell);
    Py_DECREF(cell);
    Py_DECREF(call);
    if (result != NULL) registered++;
    goto done;

error_seconds:
    Py_DECREF(seconds);
error:
    if (locked) unlock_after_error(rt, sc.inputs);
    result = NULL;
    goto done;
fallback:
    result = Py_NewRef(O_FALLBACK);
done: {
    Held held = hold_error(); /* Note [Letting go with an error pending] */
    Py_XDECREF(rt);
    scanned_clear(&sc);
    Py_XDECREF(out);
    Py_XDECREF(grad);
    Py_XDECREF(sized);
    put_back(held);
    return result;
}
}

/* The most outputs ``several_outputs`` registers itself (native_layer_norm and the like have 3). */
#define MAX_SEVERAL 8

/* Driver._register for an op of ``facts.several`` that ran on the locked ``sc->inputs``
 * (``seconds`` stolen): where every output is a new strided tensor, an empty one or None,
 * one Call makes a storage of each new tensor and the program gets a tuple of wrappers over
 * them and the other outputs as they are; anything else goes to
 * ``Driver._register_several``. The inputs are unlocked on every outcome. */
static PyObject *several_outputs(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *func,
                                 PyObject *out, PyObject *seconds, Scanned *sc, PyObject *grad,
                                 PyObject *args, PyObject *kwargs, Py_ssize_t several) {
    PyObject *inputs = sc->inputs, *consts = sc->consts, *result = NULL;
    long long nbytes[MAX_SEVERAL], largest;
    PyObject *values[MAX_SEVERAL];
    Py_ssize_t at[MAX_SEVERAL], k = 0;
    int native = PyTuple_Check(out) && PyTuple_GET_SIZE(out) == several && several <= MAX_SEVERAL;
    for (Py_ssize_t j = 0; native && j < several; j++) {
        PyObject *o = PyTuple_GET_ITEM(out, j);
        if (o == Py_None) continue;
        int r = sort_output(o, inputs, consts, &nbytes[k]);
        if (r < 0) goto error_seconds;
        native = r;
        if (native && nbytes[k]) {
            values[k] = o;
            at[k++] = j;
        }
    }
    if (!native || k == 0) {
        PyObject *a[15] = {driver, facts, func, out, seconds, inputs, sc->targs, TKW(*sc), sc->slots, consts,
                           grad, sc->vals, KW(*sc), args, kwargs ? kwargs : O_no_kwargs};
        result = PyObject_VectorcallMethod(A__register_several, a, 15 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(seconds);
        return result;
    }
    if (estimated(driver, func, sc->vals, KW(*sc), out, 1, &seconds) < 0 || add_seconds(driver, seconds) < 0 ||
        attr_ll(driver, A_largest_output, &largest) < 0)
        goto error_seconds;
    for (Py_ssize_t i = 0; i < k; i++)
        if (nbytes[i] > largest) largest = nbytes[i];
    if (set_attr_ll(driver, A_largest_output, largest) < 0) goto error_seconds;
    PyObject *fresh = PyTuple_New(k);
    if (fresh == NULL) goto error_seconds;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *p = PyLong_FromSsize_t(at[i]);
        if (p == NULL) {
            Py_DECREF(fresh);
            goto error_seconds;
        }
        PyTuple_SET_ITEM(fresh, i, p);
    }
    PyObject *targs_t = PyList_AsTuple(sc->targs);
    PyObject *slots_t = targs_t ? PyList_AsTuple(sc->slots) : NULL;
    PyObject *call = slots_t ? new_call(SLOT(facts, F_name), inputs, seconds, func, targs_t, TKW(*sc), slots_t, grad, fresh) : NULL;
    Py_XDECREF(targs_t);
    Py_XDECREF(slots_t);
    Py_DECREF(fresh);
    Py_DECREF(seconds);
    if (call == NULL) goto error;
    PyObject *first = complete(rt, call, k, nbytes, values, NULL, NULL); /* unlocks, also when it fails */
    if (first == NULL) {
        let_go(call);
        return NULL;
    }
    Py_DECREF(first); /* the record's outputs hold the cells */
    if (PyList_GET_SIZE(consts) && use_constants(driver, call, consts) < 0) {
        let_go(call);
        return NULL;
    }
    PyObject *cells = SLOT(call, K_off[K_outputs]);
    result = PyTuple_New(several);
    for (Py_ssize_t j = 0, i = 0; result != NULL && j < several; j++) {
        PyObject *o = PyTuple_GET_ITEM(out, j);
        PyObject *w = i < k && at[i] == j ? make_wrapper(o, rt, PyList_GET_ITEM(cells, i++)) : Py_NewRef(o);
        if (w == NULL) Py_CLEAR(result);
        else PyTuple_SET_ITEM(result, j, w);
    }
    Py_DECREF(call);
    if (result != NULL) registered++;
    return result;

error_seconds:
    Py_DECREF(seconds);
error:
    unlock_after_error(rt, inputs);
    return NULL;
}

/* Driver._execute for an op of ``facts.in_place`` (it writes its first argument and returns
 * it; no RNG) called without keyword arguments, where that argument is a tensor of this engine
 * that is not handed out, its storage recomputable or read by no record (``lineage.before_write``
 * has nothing to do), and every input is resident: the program's own tensor (a new reference),
 * the written storage's new version registered as ``Driver._register`` and
 * ``Runtime.complete`` do. Otherwise FALLBACK, having changed nothing but resolved wrappers and
 * hooked parameters. */
static PyObject *in_place_op(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *func, PyObject *args) {
    PyObject *out = NULL, *grad = NULL, *seconds = NULL, *call = NULL, *result = NULL;
    Scanned sc = SCANNED_EMPTY;
    int locked = 0;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *written = n ? PyTuple_GET_ITEM(args, 0) : NULL;
    if (written == NULL || Py_TYPE(written) != T_DTRTensor) return Py_NewRef(O_FALLBACK); /* a constant */
    PyObject *ref = SLOT(written, W_dtr);
    PyObject *c = ref ? SLOT(ref, R_cell) : NULL;
    PyObject *s = c ? storage_of(c) : NULL;
    if (s == NULL || SLOT(s, S_off[S_runtime]) != rt) return Py_NewRef(O_FALLBACK);
    if ((c = resolved(rt, ref)) == NULL) return NULL;
    s = storage_of(c); /* Driver._sort_written's ``mutated`` */
    if (SLOT(s, S_off[S_state]) != O_RESIDENT) return Py_NewRef(O_FALLBACK); /* handed out, or to acquire */
    int r = PyObject_IsTrue(SLOT(s, S_off[S_uses]));
    if (r > 0) { /* read by records: before_write would make them permanent unless s is recomputable */
        int q = recomputable(s);
        r = q < 0 ? -1 : !q;
    }
    if (r < 0) return NULL;
    if (r) return Py_NewRef(O_FALLBACK);
    Py_INCREF(s);
    r = scan_args(args, NULL, rt, driver, &sc, s);
    if (r < 0) goto done;
    if (r > 0) {
        result = Py_NewRef(O_FALLBACK);
        goto done;
    }
    PyObject *vals = sc.vals, *inputs = sc.inputs;
    if (lock_defined(inputs) < 0) goto done;
    locked = 1;
    double t0, t1;
    grad = PyObject_CallNoArgs(O_is_grad_enabled);
    if (grad == NULL || seconds_now(&t0) < 0) goto done;
    out = PyObject_Vectorcall(SLOT(facts, F_kernel), PySequence_Fast_ITEMS(vals), n, NULL);
    if (out == NULL || seconds_now(&t1) < 0) goto done;
    if ((seconds = PyFloat_FromDouble(t1 - t0)) == NULL || estimated(driver, func, vals, O_no_kwargs, out, 0, &seconds) < 0 ||
        add_seconds(driver, seconds) < 0)
        goto done;
    /* recording.record: one version, and the inputs over the written storage derived from it */
    PyObject *derive = PyDict_New();
    if (derive == NULL) goto done;
    for (Py_ssize_t k = 1; k < PyList_GET_SIZE(inputs); k++) {
        if (storage_of(PyList_GET_ITEM(inputs, k)) != s) continue;
        PyObject *key = PyLong_FromSsize_t(k);
        PyObject *zero = key ? PyLong_FromLong(0) : NULL;
        int bad = zero == NULL || PyDict_SetItem(derive, key, zero) < 0;
        Py_XDECREF(key);
        Py_XDECREF(zero);
        if (bad) {
            Py_DECREF(derive);
            goto done;
        }
    }
    PyObject *targs_t = PyList_AsTuple(sc.targs);
    PyObject *slots_t = targs_t ? PyList_AsTuple(sc.slots) : NULL;
    PyObject *one = slots_t ? PyLong_FromLong(1) : NULL;
    call = one ? new_call(SLOT(facts, F_name), inputs, seconds, func, targs_t, Py_None, slots_t, grad, EMPTY) : NULL;
    Py_XDECREF(targs_t);
    Py_XDECREF(slots_t);
    if (call != NULL) {
        set_slot(call, K_off[K_versions], one);
        set_slot(call, K_off[K_derive], PyDict_GET_SIZE(derive) ? derive : Py_None);
    }
    Py_XDECREF(one);
    Py_DECREF(derive);
    if (call == NULL) goto done;
    locked = 0; /* complete unlocks, also when it fails */
    PyObject *none = complete(rt, call, 0, NULL, NULL, NULL, s);
    if (none == NULL) goto done;
    Py_DECREF(none);
    if (PyList_GET_SIZE(sc.consts) && use_constants(driver, call, sc.consts) < 0) goto done;
    result = Py_NewRef(written); /* ops.program_returns: the program's own tensor */
    registered++;
done:
    if (locked) unlock_after_error(rt, sc.inputs);
    {
        Held held = hold_error(); /* Note [Letting go with an error pending] */
        scanned_clear(&sc);
        Py_DECREF(s);
        Py_XDECREF(out);
        Py_XDECREF(grad);
        Py_XDECREF(seconds);
        Py_XDECREF(call);
        put_back(held);
    }
    return result;
}

/* Views._run_view: a view op of ``facts.one_view`` or ``facts.list_view`` of this engine's
 * ``base`` (argument ``i``), without keyword arguments: a wrapper, a list of them, an empty list
 * as ``Driver._register`` registers it (a new reference), or FALLBACK where the base must be
 * recomputed. */
static PyObject *view_op(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *func,
                         PyObject *base, PyObject *args, Py_ssize_t i) {
    PyObject *c = resolved(rt, SLOT(base, W_dtr));
    if (c == NULL) return NULL;
    PyObject *s = storage_of(c);
    if (value_of(c) == Py_None) return Py_NewRef(O_FALLBACK); /* to recompute */
    int many = SLOT(facts, F_list_view) == Py_True;
    PyObject *targs = NULL, *vals = NULL, *inputs = NULL, *grad = NULL, *out = NULL, *fast = NULL,
             *seconds = NULL, *slots = NULL, *call = NULL, *cells = NULL, *result = NULL;
    int locked = 0;
    targs = PySequence_List(args);
    vals = PySequence_List(args);
    inputs = PyList_New(1);
    if (!targs || !vals || !inputs) goto error;
    PyList_SET_ITEM(inputs, 0, Py_NewRef(c));
    PyList_SetItem(targs, i, Py_NewRef(Py_None));
    PyList_SetItem(vals, i, Py_NewRef(value_of(c)));
    if (add_slot(s, S_off[S_locks], 1) < 0) goto error;
    locked = 1;
    double t0, t1;
    grad = PyObject_CallNoArgs(O_is_grad_enabled);
    if (grad == NULL || seconds_now(&t0) < 0) goto error;
    out = PyObject_Vectorcall(SLOT(facts, F_kernel), PySequence_Fast_ITEMS(vals), PyList_GET_SIZE(vals), NULL);
    if (out == NULL || seconds_now(&t1) < 0) goto error;
    if ((seconds = PyFloat_FromDouble(t1 - t0)) == NULL) goto error;
    Py_ssize_t n = 1;
    if (many) {
        if ((fast = PySequence_Fast(out, "a view op of facts.list_view returned no sequence")) == NULL) goto error;
        n = PySequence_Fast_GET_SIZE(fast);
    }
    slots = n ? Py_BuildValue("((nin))", i, -1, (Py_ssize_t)0) : Py_BuildValue("[(nin)]", i, -1, (Py_ssize_t)0);
    if (slots == NULL) goto error;
    if (n == 0) { /* the general registration, which unlocks */
        PyObject *consts = PyList_New(0);
        PyObject *mutated = consts ? PyList_New(0) : NULL;
        if (mutated == NULL) {
            Py_XDECREF(consts);
            goto error;
        }
        locked = 0;
        PyObject *a[18] = {driver, facts, func, out, seconds, inputs, targs, Py_None, slots, consts, grad, Py_None,
                           vals, O_no_kwargs, args, O_no_kwargs, mutated, Py_True};
        result = PyObject_VectorcallMethod(A__register, a, 18 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(consts);
        Py_DECREF(mutated);
        goto done;
    }
    if (estimated(driver, func, vals, O_no_kwargs, out, many, &seconds) < 0 || add_seconds(driver, seconds) < 0)
        goto error;
    PyObject *fresh = many ? PyTuple_New(n) : Py_NewRef(O_first);
    for (Py_ssize_t j = 0; many && fresh != NULL && j < n; j++) {
        PyObject *p = PyLong_FromSsize_t(j);
        if (p == NULL) Py_CLEAR(fresh);
        else PyTuple_SET_ITEM(fresh, j, p);
    }
    PyObject *targs_t = fresh ? PyList_AsTuple(targs) : NULL;
    call = targs_t ? new_call(SLOT(facts, F_name), inputs, seconds, func, targs_t, Py_None, slots, grad, fresh) : NULL;
    Py_XDECREF(fresh);
    Py_XDECREF(targs_t);
    if (call == NULL) goto error;
    locked = 0; /* complete unlocks, also when it fails */
    cells = complete(rt, call, n, NULL, many ? PySequence_Fast_ITEMS(fast) : &out, c, NULL);
    if (cells == NULL) goto done;
    if (!many) {
        result = make_wrapper(out, rt, PyTuple_GET_ITEM(cells, 0));
    } else {
        result = PyList_New(n);
        for (Py_ssize_t j = 0; result != NULL && j < n; j++) {
            PyObject *w = make_wrapper(PySequence_Fast_GET_ITEM(fast, j), rt, PyTuple_GET_ITEM(cells, j));
            if (w == NULL) Py_CLEAR(result);
            else PyList_SET_ITEM(result, j, w);
        }
    }
    if (result != NULL) registered++;
    goto done;
error:
    if (locked) unlock_after_error(rt, inputs);
done: {
    Held held = hold_error(); /* Note [Letting go with an error pending] */
    Py_XDECREF(targs);
    Py_XDECREF(vals);
    Py_XDECREF(inputs);
    Py_XDECREF(grad);
    Py_XDECREF(out);
    Py_XDECREF(fast);
    Py_XDECREF(seconds);
    Py_XDECREF(slots);
    Py_XDECREF(call);
    Py_XDECREF(cells);
    put_back(held);
    return result;
}
}

/* Gradients._hook for a leaf that requires grad and is not hooked yet, as Driver._scan does
 * for every tensor it reads as a constant; *hooks caches the driver's dict. */
static int hook_leaf(PyObject *driver, PyObject *a, PyObject **hooks) {
    PyObject *rg = PyObject_GetAttr(a, A_requires_grad);
    if (rg == NULL) return -1;
    Py_DECREF(rg);
    if (rg != Py_True) return 0;
    PyObject *leaf = PyObject_GetAttr(a, A_is_leaf);
    if (leaf == NULL) return -1;
    Py_DECREF(leaf);
    if (leaf != Py_True) return 0;
    if (*hooks == NULL && (*hooks = PyObject_GetAttr(driver, A_hooks)) == NULL) return -1;
    PyObject *key = PyLong_FromVoidPtr(a);
    if (key == NULL) return -1;
    int has = PySequence_Contains(*hooks, key);
    Py_DECREF(key);
    if (has) return has < 0 ? -1 : 0;
    PyObject *base = PyObject_GetAttr(a, A__base);
    if (base == NULL) return -1;
    Py_DECREF(base);
    if (base != Py_None) return 0;
    PyObject *r = PyObject_CallMethodOneArg(driver, A__hook, a);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Driver.passthrough for a view or detach of a tensor the engine does not manage (a view of a
 * constant is a constant: ``weight.t()``), where no argument is one of the engine's wrappers:
 * the op's result, or FALLBACK having changed nothing. */
static PyObject *plain_view(PyObject *driver, PyObject *func, PyObject *args) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < n; i++) { /* wrappers are read by value: the Python path */
        PyObject *a = PyTuple_GET_ITEM(args, i);
        if (Py_TYPE(a) == T_DTRTensor) return Py_NewRef(O_FALLBACK);
        if (Py_TYPE(a) == &PyList_Type || Py_TYPE(a) == &PyTuple_Type)
            for (Py_ssize_t j = 0; j < Py_SIZE(a); j++)
                if (Py_TYPE(PySequence_Fast_GET_ITEM(a, j)) == T_DTRTensor) return Py_NewRef(O_FALLBACK);
    }
    PyObject *hooks = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        int r = 0;
        if (PyType_IsSubtype(Py_TYPE(a), T_Tensor)) {
            r = hook_leaf(driver, a, &hooks);
        } else if (Py_TYPE(a) == &PyList_Type || Py_TYPE(a) == &PyTuple_Type) {
            for (Py_ssize_t j = 0; j < Py_SIZE(a) && r == 0; j++) {
                PyObject *b = PySequence_Fast_GET_ITEM(a, j);
                if (PyType_IsSubtype(Py_TYPE(b), T_Tensor)) r = hook_leaf(driver, b, &hooks);
            }
        }
        if (r < 0) {
            Py_XDECREF(hooks);
            return NULL;
        }
    }
    Py_XDECREF(hooks);
    return PyObject_Call(func, args, NULL);
}

/* Views._alias: ``detach`` or ``alias`` of this engine's ``base``, a new wrapper over its cell. */
static PyObject *alias(PyObject *driver, PyObject *rt, PyObject *base) {
    PyObject *c = resolved(rt, SLOT(base, W_dtr));
    if (c == NULL) return NULL;
    if (value_of(c) == Py_None) return PyObject_CallMethodOneArg(driver, A__alias, base); /* recompute */
    PyObject *w = make_wrapper(value_of(c), rt, c);
    if (w != NULL) registered++;
    return w;
}

/* ------------------------------------------------------------------------------------------ */
/* Gradient sums (gradients.py): Gradients._summing, and _sum's running sum already permanent
 * (``_in_place``, ``_add_to_permanent``); the rest of ``_sum`` stays Python. */

/* Gradients._summing(args), called with grad mode off: 1, 0, or -1 on error. */
static int summing(PyObject *driver, PyObject *rt, PyObject *args) {
    PyObject *old = PyTuple_GET_ITEM(args, 0), *new = PyTuple_GET_ITEM(args, 1);
    if (Py_TYPE(old) != T_DTRTensor || !PyObject_TypeCheck(new, T_Tensor) || new == old) return 0;
    PyObject *task = PyObject_CallNoArgs(O_graph_task_id);
    if (task == NULL) return -1;
    long long id = PyLong_AsLongLong(task);
    Py_DECREF(task);
    if (id == -1) return PyErr_Occurred() ? -1 : 0;
    PyObject *ref = SLOT(old, W_dtr);
    PyObject *c = ref ? SLOT(ref, R_cell) : NULL;
    PyObject *s = c ? storage_of(c) : NULL;
    if (s == NULL) { /* a wrapper torch made: whatever the Python path makes of it */
        PyObject *r = PyObject_CallMethodOneArg(driver, A__summing, args);
        if (r == NULL) return -1;
        int t = PyObject_IsTrue(r);
        Py_DECREF(r);
        return t;
    }
    if (SLOT(s, S_off[S_runtime]) != rt) return 0;
    if (resolved(rt, ref) == NULL) return -1;
    PyObject *names[3] = {A_shape, A_dtype, A_device};
    for (int i = 0; i < 3; i++) {
        PyObject *a = PyObject_GetAttr(old, names[i]);
        PyObject *b = a ? PyObject_GetAttr(new, names[i]) : NULL;
        int eq = b ? PyObject_RichCompareBool(a, b, Py_EQ) : -1;
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (eq <= 0) return eq;
    }
    return 1;
}

/* accumulation.dense(t): 1, 0, or -1 on error. */
static int dense(PyObject *t) {
    PyObject *size = call_method0(t, A_size);
    PyObject *stride = size ? call_method0(t, A_stride) : NULL;
    long long local[2 * 8], *pairs = local; /* (stride, size) of each dimension of size != 1 */
    int r = -1;
    if (stride == NULL) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(size); /* torch.Size, and stride()'s tuple */
    if (PyTuple_GET_SIZE(stride) != n) {
        PyErr_SetString(PyExc_ValueError, "dtr_ext._hotpath: size and stride differ in length");
        goto done;
    }
    if (n > 8 && (pairs = PyMem_New(long long, 2 * n)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long sz = PyLong_AsLongLong(PyTuple_GET_ITEM(size, i));
        long long st = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
        if ((sz == -1 || st == -1) && PyErr_Occurred()) goto done;
        if (sz == 1) continue;
        /* insertion in (stride, size) order, as Python sorts the pairs */
        Py_ssize_t j = k++;
        while (j > 0 && (pairs[2 * j - 2] > st || (pairs[2 * j - 2] == st && pairs[2 * j - 1] > sz))) {
            pairs[2 * j] = pairs[2 * j - 2];
            pairs[2 * j + 1] = pairs[2 * j - 1];
            j--;
        }
        pairs[2 * j] = st;
        pairs[2 * j + 1] = sz;
    }
    long long expected = 1;
    r = 1;
    for (Py_ssize_t i = 0; i < k && r; i++) {
        if (pairs[2 * i] != expected) r = 0;
        expected *= pairs[2 * i + 1];
    }
done:
    if (pairs != local) PyMem_Free(pairs);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    return r;
}

/* Gradients._in_place(args) where ``args[0]``'s storage ``s`` has no parent (a running sum
 * made permanent, so not recomputable): 1, 0, or -1 on error. The checks run in the Python
 * order: ``accumulation.exclusive`` records what it sees while it calibrates. */
static int in_place_permanent(PyObject *driver, PyObject *s, PyObject *args) {
    PyObject *old = PyTuple_GET_ITEM(args, 0);
    PyObject *node = PyObject_GetAttr(driver, A_node);
    if (node == NULL) return -1;
    Py_DECREF(node); /* only compared */
    if (node == Py_None) return 0;
    long long from, sid, refs, uses, nbytes, numel, itemsize;
    if (attr_ll(driver, A_node_from, &from) < 0) return -1;
    sid = PyLong_AsLongLong(SLOT(s, S_off[S_sid]));
    refs = PyLong_AsLongLong(SLOT(s, S_off[S_refs]));
    uses = PyLong_AsLongLong(SLOT(s, S_off[S_uses]));
    nbytes = PyLong_AsLongLong(SLOT(s, S_off[S_nbytes]));
    if (PyErr_Occurred()) return -1;
    if (sid >= from) return 0;
    if (refs != 1 || SLOT(s, S_off[S_state]) == O_EXTERNAL || uses) return 0;
    PyObject *v = call_method0(old, A_numel);
    if (v == NULL) return -1;
    numel = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if ((v = call_method0(old, A_element_size)) == NULL) return -1;
    itemsize = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) return -1;
    if (numel * itemsize != nbytes) return 0;
    int d = dense(old);
    if (d <= 0) return d;
    /* ``args`` is the only reference to ``old`` held here, as on the Python path; the module's
     * function as it is now (tests replace it) */
    PyObject *exclusive = PyObject_GetAttr(O_accumulation, A_exclusive);
    PyObject *r = exclusive ? PyObject_CallOneArg(exclusive, args) : NULL;
    Py_XDECREF(exclusive);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* Gradients._add_to_permanent(args): a new reference. */
static PyObject *add_to_permanent(PyObject *driver, PyObject *rt, PyObject *args) {
    PyObject *out = NULL, *seconds = NULL, *rec = NULL, *result = NULL;
    Scanned sc;
    int locked = 0;
    int r = scan_args(args, NULL, rt, driver, &sc, NULL);
    if (r < 0) goto done;
    if (r > 0) { /* an input to rematerialize, or another engine's wrapper */
        result = PyObject_CallMethodOneArg(driver, A__add_to_permanent, args);
        goto done;
    }
    PyObject *vals = sc.vals, *inputs = sc.inputs;
    if (lock_defined(inputs) < 0) goto done;
    locked = 1;
    double t0, t1;
    if (seconds_now(&t0) < 0) goto done;
    out = PyObject_Vectorcall(SLOT(O_ADD_FACTS, F_kernel), PySequence_Fast_ITEMS(vals), PyList_GET_SIZE(vals), NULL);
    if (out == NULL || seconds_now(&t1) < 0) goto done;
    if ((seconds = PyFloat_FromDouble(t1 - t0)) == NULL || estimated(driver, O_ADD_, vals, O_no_kwargs, out, 0, &seconds) < 0)
        goto done;
    locked = 0;
    if (add_seconds(driver, seconds) < 0) {
        unlock_after_error(rt, inputs);
        goto done;
    }
    PyObject *a[4] = {SLOT(O_ADD_FACTS, F_name), inputs, Py_None, seconds};
    if ((rec = PyObject_Vectorcall((PyObject *)T_OpRecord, a, 4, NULL)) == NULL) {
        unlock_after_error(rt, inputs);
        goto done;
    }
    PyObject *none = complete(rt, rec, 0, NULL, NULL, NULL, NULL);
    if (none == NULL) goto done;
    Py_DECREF(none);
    result = make_wrapper(out, rt, PyList_GET_ITEM(inputs, 0));
    if (result != NULL) registered++;
done:
    if (locked) unlock_after_error(rt, sc.inputs);
    {
        Held held = hold_error(); /* Note [Letting go with an error pending] */
        scanned_clear(&sc);
        Py_XDECREF(out);
        Py_XDECREF(seconds);
        Py_XDECREF(rec);
        put_back(held);
    }
    return result;
}

/* Gradients._sum(facts, args) once ``summing`` holds: where ``old``'s storage is a permanent
 * running sum, ``_in_place`` here, then natively if it holds, else ``Gradients._sum_as`` with
 * the answer (``exclusive`` is asked once, as on the Python path); other sums go to ``_sum``. */
static PyObject *sum_op(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *args) {
    PyObject *s = storage_of(SLOT(SLOT(PyTuple_GET_ITEM(args, 0), W_dtr), R_cell)); /* resolved by summing */
    if (SLOT(s, S_off[S_parent]) == Py_None) {
        int in_place = in_place_permanent(driver, s, args);
        if (in_place < 0) return NULL;
        if (in_place) return add_to_permanent(driver, rt, args);
        PyObject *a[4] = {driver, facts, args, Py_False};
        return PyObject_VectorcallMethod(A__sum_as, a, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    PyObject *a[3] = {driver, facts, args};
    return PyObject_VectorcallMethod(A__sum, a, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

static PyObject *run_simple(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc < 4 || argc > 5 || !PyTuple_Check(argv[3]) || (argc == 5 && !PyDict_Check(argv[4]))) {
        PyErr_SetString(PyExc_TypeError, "run_simple(driver, facts, func, args: tuple, kwargs: dict = {})");
        return NULL;
    }
    PyObject *kwargs = argc == 5 && PyDict_GET_SIZE(argv[4]) ? argv[4] : NULL;
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "dtr_ext._hotpath: bind() was not called");
        return NULL;
    }
    if (SLOT(argv[1], F_in_place) == Py_True) {
        if (kwargs != NULL) return Py_NewRef(O_FALLBACK);
        PyObject *rt = PyObject_GetAttr(argv[0], A_rt);
        if (rt == NULL) return NULL;
        PyObject *r = in_place_op(argv[0], rt, argv[1], argv[2], argv[3]);
        Py_DECREF(rt);
        return r;
    }
    return simple_op(argv[0], argv[1], argv[2], argv[3], kwargs);
}

/* The rest of an op, under the runtime's lock: Driver.dispatch after its preamble. */
static PyObject *route(PyObject *driver, PyObject *rt, PyObject *facts, PyObject *func, PyObject *args,
                       PyObject *kwargs) {
    PyObject *result = NULL;
    int backward = 0;
    if (add_attr(driver, A_ops, 1, NULL) < 0) goto done;
    {
        PyObject *dead = RT_GET(rt, _dead);
        if (dead == NULL) goto done;
        int any = PyObject_IsTrue(dead);
        Py_DECREF(dead);
        if (any < 0) goto done;
        if (any && drain(rt) < 0) goto done;
    }
    {
        PyObject *node = PyObject_CallNoArgs(O_current_node);
        if (node == NULL) goto done;
        PyObject *was = PyObject_GetAttr(driver, A_node);
        if (was == NULL) {
            Py_DECREF(node);
            goto done;
        }
        Py_DECREF(was); /* only compared */
        if (node != was) {
            int ok = 1;
            if ((node == Py_None) != (was == Py_None)) {
                PyObject *r = PyObject_CallMethodOneArg(rt, A_set_backward, node != Py_None ? Py_True : Py_False);
                ok = r != NULL;
                Py_XDECREF(r);
            }
            PyObject *next = ok && PyObject_SetAttr(driver, A_node, node) == 0 ? PyObject_GetAttr(rt, A_next_sid) : NULL;
            ok = next != NULL && PyObject_SetAttr(driver, A_node_from, next) == 0;
            Py_XDECREF(next);
            if (!ok) {
                Py_DECREF(node);
                goto done;
            }
        }
        backward = node != Py_None;
        Py_DECREF(node);
    }
    int no_kwargs = kwargs == NULL || (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0);
    PyObject *kind = SLOT(facts, F_kind);
    if (kind == O_DETACH || (kind == O_VIEW && no_kwargs && (SLOT(facts, F_one_view) == Py_True ||
                                                             SLOT(facts, F_list_view) == Py_True))) {
        Py_ssize_t i = PyLong_AsSsize_t(SLOT(facts, F_view_of));
        if (i == -1 && PyErr_Occurred()) goto done;
        PyObject *base = i < PyTuple_GET_SIZE(args) ? PyTuple_GET_ITEM(args, i) : NULL;
        if (base != NULL && Py_TYPE(base) == T_DTRTensor) {
            PyObject *ref = SLOT(base, W_dtr); /* unset on a wrapper torch made: the Python path */
            PyObject *c = ref ? SLOT(ref, R_cell) : NULL;
            PyObject *s = c ? storage_of(c) : NULL;
            if (s != NULL && SLOT(s, S_off[S_runtime]) == rt) {
                result = kind == O_DETACH ? alias(driver, rt, base) : view_op(driver, rt, facts, func, base, args, i);
                if (result != O_FALLBACK) goto done;
                Py_CLEAR(result);
            }
        } else if (base != NULL && no_kwargs) {
            result = plain_view(driver, func, args);
            if (result != O_FALLBACK) goto done;
            Py_CLEAR(result);
        }
    } else if (SLOT(facts, F_in_place) == Py_True && no_kwargs) {
        result = in_place_op(driver, rt, facts, func, args);
        if (result != O_FALLBACK) goto done;
        Py_DECREF(result);
        PyObject *a[5] = {driver, facts, func, args, kwargs ? kwargs : O_no_kwargs};
        result = PyObject_VectorcallMethod(A__execute, a, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        goto done;
    } else if ((SLOT(facts, F_simple) == Py_True || PyLong_AsSsize_t(SLOT(facts, F_several)) > 0) &&
               (no_kwargs || PyDict_Check(kwargs))) {
        if (func == O_ADD && no_kwargs && PyTuple_GET_SIZE(args) == 2) {
            /* Gradients._summing's conditions hold only with grad mode off: test them then */
            PyObject *grad = PyObject_CallNoArgs(O_is_grad_enabled);
            if (grad == NULL) goto done;
            Py_DECREF(grad);
            int sums = grad == Py_True ? 0 : summing(driver, rt, args);
            if (sums < 0) goto done;
            if (sums) {
                result = sum_op(driver, rt, facts, args);
                goto done;
            }
        }
        if (func == O_MM && backward) { /* an outer product may be deferred: Gradients._defer */
            PyObject *a[5] = {driver, facts, func, args, kwargs ? kwargs : O_no_kwargs};
            result = PyObject_VectorcallMethod(A__route, a, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            goto done;
        }
        result = simple_op(driver, facts, func, args, no_kwargs ? NULL : kwargs);
        if (result != O_FALLBACK) goto done;
        Py_DECREF(result);
        PyObject *a[5] = {driver, facts, func, args, kwargs ? kwargs : O_no_kwargs};
        result = PyObject_VectorcallMethod(A__execute, a, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        goto done;
    }
    {
        PyObject *a[5] = {driver, facts, func, args, kwargs ? kwargs : O_no_kwargs};
        result = PyObject_VectorcallMethod(A__route, a, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
done:
    return result;
}

/* Driver.dispatch(func, args, kwargs), bound to a driver by ``dispatcher``. */
static PyObject *dispatch(PyObject *driver, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 3 || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "dispatch(func, args: tuple, kwargs)");
        return NULL;
    }
    PyObject *func = argv[0];
    PyObject *facts = PyDict_GetItemWithError(O_FACTS, func);
    if (facts == NULL) {
        if (PyErr_Occurred()) return NULL;
        facts = PyObject_CallOneArg(O_facts_for, func);
        if (facts == NULL) return NULL;
    } else {
        Py_INCREF(facts);
    }
    PyObject *rt = PyObject_GetAttr(driver, A_rt);
    if (rt == NULL) {
        Py_DECREF(facts);
        return NULL;
    }
    PyObject *lock = RT_GET(rt, lock);
    PyObject *held = lock ? call_method0(lock, A_acquire) : NULL;
    if (held == NULL) {
        Py_XDECREF(lock);
        Py_DECREF(rt);
        Py_DECREF(facts);
        return NULL;
    }
    Py_DECREF(held);
    PyObject *result = route(driver, rt, facts, func, argv[1], argv[2] == Py_None ? NULL : argv[2]);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *released = call_method0(lock, A_release);
    if (released == NULL) { /* as ``with``: an error leaving the lock replaces the op's */
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        Py_CLEAR(result);
    } else {
        Py_DECREF(released);
        PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(lock);
    Py_DECREF(rt);
    Py_DECREF(facts);
    return result;
}

static PyMethodDef dispatch_def = {
    "dispatch", (PyCFunction)(void (*)(void))dispatch, METH_FASTCALL,
    "dispatch(func, args, kwargs): Driver.dispatch, natively for simple ops, ops of several new tensors, "
    "in-place ops that write their first argument, view ops, detach and gradient sums."};

static PyObject *dispatcher(PyObject *module, PyObject *driver) {
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "dtr_ext._hotpath: bind() was not called");
        return NULL;
    }
    return PyCFunction_NewEx(&dispatch_def, driver, NULL);
}

/* Runtime._on_wrapper_death, bound to one runtime by ``wrapper_death``: the callback of the
 * Refs of its wrappers. While the block is open it queues the death as the Python method does;
 * after the block (the rare last wrappers of a failed block) it runs the Python method. */
static PyObject *wrapper_died(PyObject *rt, PyObject *ref) {
    if (!bound) return PyObject_CallMethodOneArg(rt, A__on_wrapper_death, ref);
    PyObject *closed = RT_GET(rt, closed);
    if (closed == NULL) return NULL;
    Py_DECREF(closed);
    if (closed != Py_False || !Py_IS_TYPE(ref, T_Ref))
        return PyObject_CallMethodOneArg(rt, A__on_wrapper_death, ref);
    PyObject *refs = RT_GET(rt, _refs);
    PyObject *key = refs ? PyLong_FromVoidPtr(ref) : NULL; /* id(ref) */
    PyObject *r = NULL;
    if (key == NULL) goto done;
    PyObject *was = PyDict_GetItemWithError(refs, key);
    if (was == NULL) {
        if (!PyErr_Occurred()) r = Py_NewRef(Py_None);
        goto done;
    }
    if (PyDict_DelItem(refs, key) < 0) goto done;
    PyObject *dead = RT_GET(rt, _dead);
    r = dead ? PyObject_CallMethodOneArg(dead, A_append, SLOT(ref, R_cell)) : NULL;
    Py_XDECREF(dead);
done:
    Py_XDECREF(key);
    Py_XDECREF(refs);
    return r;
}

static PyMethodDef wrapper_died_def = {
    "wrapper_died", (PyCFunction)wrapper_died, METH_O,
    "wrapper_died(ref): Runtime._on_wrapper_death, natively while the runtime's block is open."};

static PyObject *wrapper_death(PyObject *module, PyObject *rt) {
    if (!bound || !Py_IS_TYPE(rt, T_Runtime)) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.wrapper_death(runtime: Runtime), after bind()");
        return NULL;
    }
    return PyCFunction_NewEx(&wrapper_died_def, rt, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* bind */

static int offset_of(PyTypeObject *tp, const char *name, Py_ssize_t *off) {
    PyObject *d = PyObject_GetAttrString((PyObject *)tp, name);
    if (d == NULL) return -1;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "dtr_ext._hotpath: %s.%s is not a slot", tp->tp_name, name);
        Py_DECREF(d);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "dtr_ext._hotpath: %s.%s is not an object slot", tp->tp_name, name);
        Py_DECREF(d);
        return -1;
    }
    *off = m->offset;
    Py_DECREF(d);
    return 0;
}

/* The slots of ``tp`` and its bases (``__slots__``, without ``__weakref__``) must be exactly
 * ``names``: the fields this file fills when it makes one. */
static int same_fields(PyTypeObject *tp, const char **names, int n, Py_ssize_t *offs) {
    for (int i = 0; i < n; i++)
        if (offset_of(tp, names[i], &offs[i]) < 0) return -1;
    Py_ssize_t count = 0;
    PyObject *mro = tp->tp_mro;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        /* ``__slots__`` exist only on classes defined in Python (heap types); a static builtin
         * base such as ``object`` has none, and from Python 3.12 its tp_dict is NULL. */
        if (!PyType_HasFeature(base, Py_TPFLAGS_HEAPTYPE)) continue;
        PyObject *dict = base->tp_dict;
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(dict, &pos, &key, &value))
            if (Py_IS_TYPE(value, &PyMemberDescr_Type) &&
                ((PyMemberDescrObject *)value)->d_member->type == T_OBJECT_EX)
                count++;
    }
    if (count != n) {
        PyErr_Format(PyExc_TypeError,
                     "dtr_ext._hotpath: %s has %zd slots, the native path fills %d: rebuild "
                     "dtr_ext and bring hotpath.c in step with it",
                     tp->tp_name, count, n);
        return -1;
    }
    return 0;
}

/* The offsets of the Runtime fields this file reads (RF_NAMES), all or none: each must be a
 * slot, and callbacks handed out earlier keep reading the old ones if one is not. */
static int rt_fields(void) {
    Py_ssize_t off[RF_N];
    for (int i = 0; i < RF_N; i++)
        if (offset_of(T_Runtime, RF_NAMES[i], &off[i]) < 0) return -1;
    memcpy(RF_off, off, sizeof off);
    return 0;
}

#define GET(name)                                                                  \
    do {                                                                           \
        PyObject *v_ = PyDict_GetItemString(config, #name);                        \
        if (v_ == NULL) {                                                          \
            PyErr_SetString(PyExc_KeyError, "dtr_ext._hotpath.bind: missing " #name); \
            return NULL;                                                           \
        }                                                                          \
        Py_INCREF(v_);                                                             \
        Py_XSETREF(O_##name, v_);                                                  \
    } while (0)
#define GET_TYPE(name)                                                             \
    do {                                                                           \
        PyObject *v_ = PyDict_GetItemString(config, #name);                        \
        if (v_ == NULL || !PyType_Check(v_)) {                                     \
            PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.bind: " #name " must be a type"); \
            return NULL;                                                           \
        }                                                                          \
        Py_INCREF(v_);                                                             \
        Py_XSETREF(T_##name, (PyTypeObject *)v_);                                  \
    } while (0)

static PyObject *O_Facts;

static PyObject *bind(PyObject *module, PyObject *config) {
    if (!PyDict_Check(config)) {
        PyErr_SetString(PyExc_TypeError, "bind(config: dict)");
        return NULL;
    }
    bound = 0;
    GET_TYPE(Runtime);
    GET_TYPE(Tensor);
    GET_TYPE(DTRTensor);
    GET_TYPE(Storage);
    GET_TYPE(Cell);
    GET_TYPE(OpRecord);
    GET_TYPE(Call);
    GET_TYPE(Ref);
    GET_TYPE(UFNode);
    GET_TYPE(DTREq);
    GET(dtreq_on_evict);
    GET(dtreq_on_release);
    GET(constants_forget);
    GET(constants_use);
    GET(dtreq_key);
    GET(output_bytes);
    GET(output_size);
    GET(heappush);
    GET(heappop);
    GET(TOL);
    GET(F32_MAX);
    GET(ARGMINS);
    ARGMINS = PyLong_AsLongLong(O_ARGMINS);
    GET(LOG_LIMIT);
    LOG_LIMIT = PyLong_AsSsize_t(O_LOG_LIMIT);
    TOL = PyFloat_AsDouble(O_TOL);
    F32_MAX = PyFloat_AsDouble(O_F32_MAX);
    if (PyErr_Occurred()) return NULL;
    GET(strided);
    GET(RESIDENT);
    GET(RELEASED);
    GET(EVICTED);
    GET(VIEW);
    GET(DETACH);
    GET(SWAPPED);
    GET(fit);
    GET(mws);
    GET(is_grad_enabled);
    GET(perf_counter);
    GET(no_kwargs);
    GET(first);
    GET(estimate_seconds);
    GET(correct_size);
    GET(FACTS);
    GET(facts_for);
    GET(current_node);
    GET(ADD);
    GET(MM);
    GET(ADD_);
    GET(ADD_FACTS);
    GET(EXTERNAL);
    GET(graph_task_id);
    GET(accumulation);
    GET(FALLBACK);
    GET(Facts);
    PyObject *u = PyDict_GetItemString(config, "untrack_gc");
    if (u == NULL) {
        PyErr_SetString(PyExc_KeyError, "dtr_ext._hotpath.bind: missing untrack_gc");
        return NULL;
    }
    untrack_gc = PyObject_IsTrue(u);
    if (untrack_gc < 0) return NULL;
    if (!PyType_Check(O_Facts)) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.bind: Facts must be a type");
        return NULL;
    }
    PyTypeObject *facts = (PyTypeObject *)O_Facts;
    if (offset_of(T_DTRTensor, "_dtr", &W_dtr) < 0 || offset_of(T_Ref, "cell", &R_cell) < 0 ||
        same_fields(T_Cell, C_NAMES, C_N, C_off) < 0 || offset_of(facts, "kind", &F_kind) < 0 ||
        offset_of(facts, "one_view", &F_one_view) < 0 ||
        offset_of(facts, "list_view", &F_list_view) < 0 || offset_of(facts, "view_of", &F_view_of) < 0 || offset_of(facts, "kernel", &F_kernel) < 0 ||
        offset_of(facts, "name", &F_name) < 0 || offset_of(facts, "random", &F_random) < 0 ||
        offset_of(facts, "sized", &F_sized) < 0 || offset_of(facts, "simple", &F_simple) < 0 ||
        offset_of(facts, "several", &F_several) < 0 || offset_of(facts, "in_place", &F_in_place) < 0 || same_fields(T_Storage, S_NAMES, S_N, S_off) < 0 ||
        same_fields(T_Call, K_NAMES, K_N, K_off) < 0 || rt_fields() < 0 || same_fields(T_UFNode, U_NAMES, U_N, U_off) < 0 ||
        same_fields(T_OpRecord, K_NAMES, K_RECORD, record_off) < 0)
        return NULL;
    for (int i = 0; i < K_RECORD; i++)
        if (record_off[i] != K_off[i]) {
            PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath: Call must keep OpRecord's slots where OpRecord has them");
            return NULL;
        }
    if (Py_TYPE(O_ADD_FACTS) != (PyTypeObject *)O_Facts) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.bind: ADD_FACTS must be an OpFacts");
        return NULL;
    }
    if (T_Storage->tp_alloc != PyType_GenericAlloc || T_Call->tp_alloc != PyType_GenericAlloc ||
        T_Cell->tp_alloc != PyType_GenericAlloc || T_UFNode->tp_alloc != PyType_GenericAlloc) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath: Storage, Cell, Call and UFNode must be plain classes");
        return NULL;
    }
    bound = 1;
    Py_RETURN_NONE;
}

static PyObject *count(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(registered);
}

static PyObject *dense_py(PyObject *module, PyObject *t) {
    int d = dense(t);
    if (d < 0) return NULL;
    return PyBool_FromLong(d);
}

static PyObject *release_py(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (!bound || argc != 2 || !Py_IS_TYPE(argv[1], T_Storage)) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.release(runtime, storage), after bind()");
        return NULL;
    }
    if (release(argv[0], argv[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *dtreq_key_py(PyObject *module, PyObject *s) {
    if (!bound || !Py_IS_TYPE(s, T_Storage)) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.dtreq_key: a Storage, after bind()");
        return NULL;
    }
    return dtreq_key(s);
}

static PyObject *cached_size_py(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (!bound || argc != 3) {
        PyErr_SetString(PyExc_TypeError, "dtr_ext._hotpath.cached_size(func, args, kwargs), after bind()");
        return NULL;
    }
    PyObject *key;
    long long nbytes;
    int r = cached_size(argv[0], argv[1], argv[2], &key, &nbytes);
    if (r <= 0) return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *n = PyLong_FromLongLong(nbytes);
    PyObject *pair = n ? PyTuple_Pack(2, key, n) : NULL;
    Py_DECREF(key);
    Py_XDECREF(n);
    return pair;
}

static PyObject *bind_make_room(PyObject *module, PyObject *fn) {
    Py_XSETREF(O_make_room, Py_NewRef(fn));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"cached_size", (PyCFunction)(void (*)(void))cached_size_py, METH_FASTCALL,
     "cached_size(func, args, kwargs): output_size.output_bytes where its cache answers, else None (for tests)."},
    {"bind_make_room", bind_make_room, METH_O,
     "bind_make_room(fn): Driver._make_room, which the native path runs natively while a driver's is it."},
    {"release", (PyCFunction)(void (*)(void))release_py, METH_FASTCALL,
     "release(runtime, storage): lineage.release, for a runtime the native path drives."},
    {"dtreq_key", dtreq_key_py, METH_O, "dtreq_key(s): DTREq.key(s), as the native search computes it (for tests)."},
    {"dense", dense_py, METH_O, "dense(t): accumulation.dense, as the native path decides it (for tests)."},
    {"registered", count, METH_NOARGS,
     "registered(): how many ops the native path has registered itself in this process."},
    {"wrapper_death", (PyCFunction)wrapper_death, METH_O,
     "wrapper_death(runtime): Runtime._on_wrapper_death bound to ``runtime``, native while its "
     "block is open."},
    {"dispatcher", (PyCFunction)dispatcher, METH_O,
     "dispatcher(driver): Driver.dispatch bound to ``driver``, with the preamble, simple ops, "
     "ops of several new tensors and in-place ops native; other ops go to the driver's _route."},
    {"run_simple", (PyCFunction)(void (*)(void))run_simple, METH_FASTCALL,
     "run_simple(driver, facts, func, args): run a simple op, one of several new tensors or an "
     "in-place one as Driver._run does, or return the "
     "FALLBACK sentinel (nothing changed but resolved wrappers and hooked parameters) for the "
     "Python path to run it."},
    {"ordinary", (PyCFunction)ordinary, METH_O,
     "ordinary(index): CandidateIndex._ordinary, the pick's lowest-scored ORDINARY candidate or "
     "None, with h_DTR^eq's key native."},
    {"bind", (PyCFunction)bind, METH_O,
     "bind(config): the classes, functions and constants of dtr the native path uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dtr_ext._hotpath",
                                    "The eager driver's simple op in one native call.", -1, methods};

#define INTERN(name)                                          \
    do {                                                      \
        if ((A_##name = PyUnicode_InternFromString(#name)) == NULL) return NULL; \
    } while (0)

PyMODINIT_FUNC PyInit__hotpath(void) {
    INTERN(rt); INTERN(budget); INTERN(memory); INTERN(largest_output); INTERN(size_every_op);
    INTERN(_make_room); INTERN(hooks); INTERN(closed); INTERN(append); INTERN(_on_wrapper_death);
    INTERN(requires_grad); INTERN(is_leaf); INTERN(_base); INTERN(layout); INTERN(untyped_storage);
    INTERN(nbytes); INTERN(unlock); INTERN(_register_one); INTERN(_register_several); INTERN(_register); INTERN(op_seconds); INTERN(clock);
    INTERN(work); INTERN(_sid); INTERN(_backward); INTERN(resident); INTERN(_all); INTERN(_untrack);
    INTERN(_high); INTERN(on_op); INTERN(_use_constants); INTERN(size); INTERN(is_contiguous);
    INTERN(storage_offset); INTERN(stride); INTERN(dtype); INTERN(device); INTERN(_wrapper_died);
    INTERN(_refs);
    INTERN(estimate); INTERN(lock); INTERN(acquire); INTERN(release); INTERN(ops); INTERN(_dead);
    INTERN(node); INTERN(node_from); INTERN(set_backward); INTERN(next_sid);
    INTERN(_summing); INTERN(_sum); INTERN(_execute); INTERN(_route); INTERN(arriving); INTERN(pop);
    INTERN(value); INTERN(_index); INTERN(drop); INTERN(_on_evict); INTERN(replayable);
    INTERN(_unreferenced); INTERN(counters); INTERN(eager_evictions); INTERN(popleft);
    INTERN(_hook); INTERN(_alias); INTERN(resolve); INTERN(executor); INTERN(forget);
    INTERN(_on_release); INTERN(host); INTERN(leave); INTERN(shape); INTERN(numel);
    INTERN(element_size); INTERN(_add_to_permanent); INTERN(exclusive); INTERN(_sum_as);
    INTERN(_views_alias_data); INTERN(_examine); INTERN(_checked); INTERN(_rows); INTERN(_picks);
    INTERN(_small_below); INTERN(_protected_from); INTERN(_key); INTERN(_now);
    INTERN(_staleness); INTERN(_buf); INTERN(_bound); INTERN(_la); INTERN(_SIZES); INTERN(_SETTLED);
    INTERN(reserve); INTERN(argmin); INTERN(_log); INTERN(uses); INTERN(_version);
    INTERN(_order); INTERN(_pos); INTERN(_argmins); INTERN(_sort_next); INTERN(_slack);
    INTERN(forward); INTERN(parent); INTERN(inputs); INTERN(outputs); INTERN(retarget);
    if ((S_nan = PyUnicode_InternFromString("nan")) == NULL) return NULL;
    if ((EMPTY = PyTuple_New(0)) == NULL) return NULL;
    if ((ONE = PyLong_FromLong(1)) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
