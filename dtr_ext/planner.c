/* dtr_ext: native twins of the hot loops of dtr/planner (rotor.py and offload.py).
 *
 * Same names, arguments and results as the pure-Python references, and the same float
 * expressions evaluated in the same order with the same tie rules, so both return identical
 * plans (see Note [Identical backends] in rotor.py and offload.py). Build with
 * -ffp-contract=off: a fused multiply-add would round differently from Python.
 *
 * Built as dtr_ext._planner; only dtr/planner/_native.py imports it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ABI_VERSION 1

static int get_arrays(Py_buffer *bufs, int count, Py_ssize_t itemsize, Py_ssize_t *length) {
    for (int i = 0; i < count; i++) {
        if (bufs[i].len % itemsize != 0 || bufs[i].len / itemsize != *length) {
            PyErr_SetString(PyExc_ValueError, "dtr_ext: arrays must all have the same length and dtype");
            return -1;
        }
    }
    return 0;
}

static void release(Py_buffer *bufs, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&bufs[i]);
}

/* ---- rotor_table: the persistent DP (rotor.py: rotor_table) ---------------------------------- */

static PyObject *rotor_table(PyObject *self, PyObject *args) {
    Py_buffer b[7];
    long long budget;
    (void)self;
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*L", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6], &budget))
        return NULL;
    Py_ssize_t len = b[0].len / (Py_ssize_t)sizeof(double);
    if (get_arrays(b, 3, sizeof(double), &len) < 0 || get_arrays(b + 3, 4, sizeof(int64_t), &len) < 0 ||
        len < 2 || len > 32767 || budget < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dtr_ext.rotor_table: bad sizes or budget");
        release(b, 7);
        return NULL;
    }
    const double *tf = b[0].buf, *tb = b[1].buf, *pre = b[2].buf;
    const int64_t *x = b[3].buf, *xb = b[4].buf, *of = b[5].buf, *ob = b[6].buf;
    const Py_ssize_t n = len - 1, width = (Py_ssize_t)budget + 1, rows = n * (n + 1) / 2;
    double *P = malloc((size_t)rows * (size_t)width * sizeof(double));
    Py_ssize_t *offsets = malloc((size_t)(n + 1) * sizeof(Py_ssize_t));
    int64_t *hop = malloc((size_t)(n + 1) * sizeof(int64_t)), *inner = malloc((size_t)(n + 1) * sizeof(int64_t));
    PyObject *choice = PyBytes_FromStringAndSize(NULL, rows * width * (Py_ssize_t)sizeof(int16_t));
    if (!P || !offsets || !hop || !inner || !choice) {
        free(P); free(offsets); free(hop); free(inner); Py_XDECREF(choice); release(b, 7);
        return PyErr_NoMemory();
    }
    int16_t *C = (int16_t *)PyBytes_AS_STRING(choice);
    double value;
    Py_BEGIN_ALLOW_THREADS
    offsets[0] = 0;
    for (Py_ssize_t d = 1; d <= n; d++) offsets[d] = offsets[d - 1] + (n - d + 1);
    hop[0] = 0;
    for (Py_ssize_t j = 1; j <= n; j++) hop[j] = x[j - 1] + x[j] + of[j];
    for (Py_ssize_t j = 0; j <= n; j++) inner[j] = -1;
    for (Py_ssize_t d = 0; d < n; d++) {
        for (Py_ssize_t s = 1; s <= n - d; s++) {
            const Py_ssize_t t = s + d;
            if (d >= 2 && hop[s + d - 1] > inner[s]) inner[s] = hop[s + d - 1];
            int64_t mall = x[t] + xb[s] + of[s], mall_b = x[s] + x[s - 1] + xb[s] + ob[s];
            if (mall_b > mall) mall = mall_b;
            int64_t mnone = x[t] + x[s] + of[s];
            if (x[t] + inner[s] > mnone) mnone = x[t] + inner[s];
            double *row = P + (offsets[d] + s - 1) * width;
            int16_t *pick = C + (offsets[d] + s - 1) * width;
            for (Py_ssize_t m = 0; m < width; m++) { row[m] = INFINITY; pick[m] = -1; }
            if (d == 0) {
                for (Py_ssize_t m = mall; m < width; m++) { row[m] = tf[s] + tb[s]; pick[m] = 0; }
                continue;
            }
            for (Py_ssize_t k = 1; k <= d && mnone < width; k++) {
                const Py_ssize_t split = s + k;
                const int64_t shift = x[split - 1];
                const double *later = P + (offsets[d - k] + split - 1) * width;
                const double *earlier = P + (offsets[k - 1] + s - 1) * width;
                const double fwd = pre[split - 1] - pre[s - 1];
                for (Py_ssize_t m = mnone > shift ? mnone : shift; m < width; m++) {
                    double cand = (fwd + later[m - shift]) + earlier[m];
                    if (cand < row[m]) { row[m] = cand; pick[m] = (int16_t)k; }
                }
            }
            const double *next = P + (offsets[d - 1] + s) * width;
            for (Py_ssize_t m = mall; m < width; m++) {
                double cand = (tf[s] + next[m - xb[s]]) + tb[s];
                if (cand < row[m]) { row[m] = cand; pick[m] = 0; }
            }
        }
    }
    value = P[(offsets[n - 1]) * width + budget];
    Py_END_ALLOW_THREADS
    free(P); free(offsets); free(hop); free(inner);
    release(b, 7);
    PyObject *result = Py_BuildValue("(dN)", value, choice);
    return result;
}

/* ---- combined_dp: remat + offload DP (offload.py: _Combined) ---------------------------------- */

typedef struct { uint64_t key; double value; uint32_t pick; } Entry;  /* key 0 marks an empty slot */
typedef struct { Entry *slots; size_t mask, used; } Memo;

static uint64_t mix(uint64_t k) {  /* splitmix64 finalizer */
    k ^= k >> 30; k *= 0xbf58476d1ce4e5b9ULL; k ^= k >> 27; k *= 0x94d049bb133111ebULL; return k ^ (k >> 31);
}

static Entry *memo_find(const Memo *memo, uint64_t key) {
    size_t i = mix(key) & memo->mask;
    while (memo->slots[i].key && memo->slots[i].key != key) i = (i + 1) & memo->mask;
    return &memo->slots[i];
}

static int memo_put(Memo *memo, uint64_t key, double value, uint32_t pick) {
    if (2 * (memo->used + 1) > memo->mask + 1) {  /* keep the load under 1/2 */
        Memo grown = {calloc(2 * (memo->mask + 1), sizeof(Entry)), 2 * memo->mask + 1, 0};
        if (!grown.slots) return -1;
        for (size_t i = 0; i <= memo->mask; i++)
            if (memo->slots[i].key) { *memo_find(&grown, memo->slots[i].key) = memo->slots[i]; grown.used++; }
        free(memo->slots);
        *memo = grown;
    }
    Entry *e = memo_find(memo, key);
    if (!e->key) memo->used++;
    e->key = key; e->value = value; e->pick = pick;
    return 0;
}

typedef struct {
    const double *tf, *tb;
    const int64_t *x, *xb, *of, *ob;
    int L, N;
    double rate;
    Memo forward, backward;
    int oom;
} Combined;

#define SLACK 1e-9
/* Keys and picks pack fields of 10 bits: _native.py keeps L and N below 1024. */
static uint64_t key_segment(int s, int t, int A, int D) {
    return ((((uint64_t)s << 10 | (uint64_t)t) << 10 | (uint64_t)A) << 10 | (uint64_t)D) + 1;
}
static uint64_t key_chain(int i, int xk, int A, int F, int B) {
    return (((((uint64_t)i << 1 | (uint64_t)xk) << 10 | (uint64_t)A) << 10 | (uint64_t)F) << 10 | (uint64_t)B) + 1;
}

static int round_up(double debt) {
    double c = ceil(debt - SLACK);
    return c > 0 ? (int)c : 0;
}
static double wait_for(const Combined *c, int64_t memory, double pending) {
    double w = ((double)memory + pending - (double)c->N) / c->rate;
    return w > 0.0 ? w : 0.0;
}
static double drain(const Combined *c, double pending, double duration) {
    double p = pending - c->rate * duration;
    return p > 0.0 ? p : 0.0;
}

static double segment(Combined *c, int s, int t, int A, int D) {
    const uint64_t key = key_segment(s, t, A, D);
    Entry *hit = memo_find(&c->backward, key);
    if (hit->key) return hit->value;
    if (c->oom) return INFINITY;
    const int64_t *x = c->x, *xb = c->xb;
    const double *tf = c->tf, *tb = c->tb;
    const int N = c->N;
    const int64_t rb = A + xb[s] + x[s] + x[s - 1] + c->ob[s];
    const int64_t rf = A + x[t] + xb[s] + c->of[s];
    double best = INFINITY;
    uint32_t pick = 0;
    if (s == t) {
        if (rb <= N && rf <= N) {
            double eb = wait_for(c, rb, D);
            double ef = wait_for(c, rf, drain(c, D, tb[s] + eb));
            best = ((tb[s] + eb) + tf[s]) + ef;
        }
    } else {
        double q = 0.0, forwards = 0.0;
        int64_t top = -1;
        for (int split = s + 1; split <= t; split++) {
            const int k = split - 1;
            const int64_t r = k == s ? x[t] + x[s] + c->of[s] : x[t] + x[k - 1] + x[k] + c->of[k];
            if (k == s) q = (double)r;
            else { double older = q - c->rate * tf[k]; q = (double)r > older ? (double)r : older; }
            if (r > top) top = r;
            forwards = forwards + tf[k];
            if (A + top > N) break;
            if (A + x[split - 1] > N) continue;
            double c2 = segment(c, s, split - 1, A, D);
            if (c2 == INFINITY) continue;
            int d2 = round_up(D - c->rate * c2);
            double c3 = segment(c, split, t, (int)(A + x[split - 1]), d2);
            if (c3 == INFINITY) continue;
            double ef = ((double)A + q + drain(c, d2, c3) - (double)N) / c->rate;
            if (!(ef > 0.0)) ef = 0.0;
            double cand = ((c2 + c3) + forwards) + ef;
            if (cand < best) { best = cand; pick = (uint32_t)(split - s) << 10 | (uint32_t)d2; }
        }
        if (rb <= N && rf <= N && A + xb[s] <= N) {
            double eb = wait_for(c, rb, D);
            int d1 = round_up(D - c->rate * (tb[s] + eb));
            double c1 = segment(c, s + 1, t, (int)(A + xb[s]), d1);
            if (c1 != INFINITY) {
                double ef = wait_for(c, rf, drain(c, d1, c1));
                double cand = (((tb[s] + eb) + c1) + tf[s]) + ef;
                if (cand < best) { best = cand; pick = (uint32_t)d1; }
            }
        }
    }
    if (memo_put(&c->backward, key, best, pick) < 0) c->oom = 1;
    return best;
}

static double chain(Combined *c, int i, int xk, int A, int F, int B) {
    const uint64_t key = key_chain(i, xk, A, F, B);
    Entry *hit = memo_find(&c->forward, key);
    if (hit->key) return hit->value;
    if (c->oom) return INFINITY;
    const int64_t *x = c->x, *xb = c->xb;
    const double *tf = c->tf, *tb = c->tb;
    const int N = c->N, L = c->L;
    const int64_t I = xk ? xb[i - 1] : x[i - 1];
    double best = INFINITY;
    uint32_t pick = 0;
    if (i == L + 1) {
        if (A + I + x[L] <= N) best = (double)(F + B) / c->rate;
        if (memo_put(&c->forward, key, best, 0) < 0) c->oom = 1;
        return best;
    }
    const int64_t rck = A + I + x[i] + c->of[i];
    if (rck <= N) {
        for (int off = 0; off <= 1; off++) {
            const int64_t kept = off ? A : A + I;
            double now = wait_for(c, rck, F) + tf[i];
            double pend = drain(c, F, now) + (double)(off ? I : 0);
            for (int j = i; j <= L; j++) {
                if (j > i) {
                    const int64_t r = kept + x[j - 1] + x[j] + c->of[j];
                    if (r > N) break;
                    double step = wait_for(c, r, pend) + tf[j];
                    now = now + step;
                    pend = drain(c, pend, step);
                }
                double seg = segment(c, i, j, (int)(A + I), B);
                if (seg == INFINITY) continue;
                int fn = round_up(pend);
                int bn = round_up(B - c->rate * seg) + (int)(off ? I : 0);
                if (fn > N || bn > N) continue;
                double cand = (now + seg) + chain(c, j + 1, 0, (int)kept, fn, bn);
                if (cand < best) {
                    best = cand;
                    pick = (((uint32_t)j << 1 | (uint32_t)off) << 10 | (uint32_t)fn) << 10 | (uint32_t)bn;
                }
            }
        }
    }
    const int64_t rf = A + I + xb[i] + c->of[i];
    const int64_t rb = A + I + xb[i] + x[i] + x[i - 1] + c->ob[i];
    if (rf <= N && rb <= N) {
        double ef = wait_for(c, rf, F), eb = wait_for(c, rb, B), best_all = INFINITY;
        uint32_t pick_all = 0;
        for (int off = 0; off <= 1; off++) {
            int fn = round_up(F - c->rate * (tf[i] + ef)) + (int)(off ? I : 0);
            int bn = round_up(B - c->rate * (tb[i] + eb)) + (int)(off ? I : 0);
            if (fn > N || bn > N) continue;
            double cand = ((tf[i] + ef) + (tb[i] + eb)) + chain(c, i + 1, 1, (int)(off ? A : A + I), fn, bn);
            if (cand < best_all) {
                best_all = cand;
                pick_all = ((uint32_t)off << 10 | (uint32_t)fn) << 10 | (uint32_t)bn;
            }
        }
        if (best_all < best) { best = best_all; pick = pick_all; }
    }
    if (memo_put(&c->forward, key, best, pick) < 0) c->oom = 1;
    return best;
}

static int emit(PyObject *ops, const char *kind, int stage) {
    PyObject *op = Py_BuildValue("(si)", kind, stage);
    if (!op) return -1;
    int rc = PyList_Append(ops, op);
    Py_DECREF(op);
    return rc;
}

static int segment_ops(Combined *c, int s, int t, int A, int D, PyObject *ops) {
    uint32_t pick = memo_find(&c->backward, key_segment(s, t, A, D))->pick;
    int step = (int)(pick >> 10), debt = (int)(pick & 1023);
    if (s == t) return emit(ops, "F_all", s) || emit(ops, "B", s);
    if (step == 0)
        return emit(ops, "F_all", s) || segment_ops(c, s + 1, t, (int)(A + c->xb[s]), debt, ops) || emit(ops, "B", s);
    const int split = s + step;
    if (emit(ops, "F_ck", s)) return -1;
    for (int k = s + 1; k < split; k++) if (emit(ops, "F_none", k)) return -1;
    return segment_ops(c, split, t, (int)(A + c->x[split - 1]), debt, ops) || segment_ops(c, s, split - 1, A, D, ops);
}

static int chain_ops(Combined *c, int i, int xk, int A, int F, int B, PyObject *ops) {
    if (i == c->L + 1) return 0;
    const int I = (int)(xk ? c->xb[i - 1] : c->x[i - 1]);
    uint32_t pick = memo_find(&c->forward, key_chain(i, xk, A, F, B))->pick;
    const int bn = (int)(pick & 1023), fn = (int)(pick >> 10 & 1023), off = (int)(pick >> 20 & 1), j = (int)(pick >> 21);
    const int kept = off ? A : A + I;
    if (j == 0)
        return emit(ops, "F_all", i) || (off && emit(ops, "offload", i)) || chain_ops(c, i + 1, 1, kept, fn, bn, ops) ||
               (off && emit(ops, "prefetch", i)) || emit(ops, "B", i);
    if (emit(ops, "F_ck", i) || (off && emit(ops, "offload", i))) return -1;
    for (int k = i + 1; k <= j; k++) if (emit(ops, "F_none", k)) return -1;
    return chain_ops(c, j + 1, 0, kept, fn, bn, ops) || (off && emit(ops, "prefetch", i)) ||
           segment_ops(c, i, j, A + I, B, ops);
}

static PyObject *combined_dp(PyObject *self, PyObject *args) {
    Py_buffer b[6];
    int levels;
    double rate;
    (void)self;
    memset(b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*id", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &levels, &rate))
        return NULL;
    Py_ssize_t len = b[0].len / (Py_ssize_t)sizeof(double);
    if (get_arrays(b, 2, sizeof(double), &len) < 0 || get_arrays(b + 2, 4, sizeof(int64_t), &len) < 0 ||
        len < 2 || len > 1023 || levels < 1 || levels > 1023 || !(rate > 0.0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dtr_ext.combined_dp: bad sizes, levels or rate");
        release(b, 6);
        return NULL;
    }
    Combined c = {b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[5].buf, (int)len - 1, levels, rate,
                  {calloc(1 << 16, sizeof(Entry)), (1 << 16) - 1, 0}, {calloc(1 << 16, sizeof(Entry)), (1 << 16) - 1, 0}, 0};
    PyObject *result = NULL;
    if (!c.forward.slots || !c.backward.slots) c.oom = 1;
    double value = c.oom ? INFINITY : chain(&c, 1, 0, 0, 0, 0);
    if (c.oom) {
        PyErr_NoMemory();
    } else if (value == INFINITY) {
        result = Py_BuildValue("(dO)", value, Py_None);
    } else {
        PyObject *ops = PyList_New(0);
        if (ops && chain_ops(&c, 1, 0, 0, 0, 0, ops) == 0) result = Py_BuildValue("(dN)", value, ops);
        else Py_XDECREF(ops);
    }
    free(c.forward.slots);
    free(c.backward.slots);
    release(b, 6);
    return result;
}

static PyMethodDef methods[] = {
    {"rotor_table", rotor_table, METH_VARARGS,
     "rotor_table(tf, tb, pre, x, xb, of, ob, budget) -> (value, choice int16 bytes); see dtr.planner.rotor."},
    {"combined_dp", combined_dp, METH_VARARGS,
     "combined_dp(tf, tb, x, xb, of, ob, levels, rate) -> (value, ops or None); see dtr.planner.offload."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dtr_ext._planner", "Native twins of dtr.planner's DPs.", -1, methods};

PyMODINIT_FUNC PyInit__planner(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
