/*
 * The compiled replay of a launch plan (paella.dispatcher.replay): a job's waitlist as
 * counters over a dependency graph made once per plan.
 *
 * PlanGraph: the plan's steps as the reference waitlist (paella.dispatcher.waitlist)
 * leaves them right after issuing the whole plan for a fresh job: per node its kind,
 * stream successor (the edge that eager and lookahead release may meet early), the
 * dependents it holds back (cross-stream and event edges), its unmet dependencies, and
 * which nodes are already done (MARKERs with nothing to wait for complete on the spot)
 * or active (in activation order). It is the same for every request, since every step
 * is issued at job start, before anything can complete.
 *
 * PlanRun: one job's replay: a copy of the counters and the job's ops (a tuple aligned
 * with the nodes, None for MARKERs, which live only here). It has the interface of
 * Waitlist that the dispatcher uses (finish, released, release_ahead, drop_unreleased,
 * pending, eager) and applies the same rules in the same order: a finished node meets
 * its stream successor's dependency, then its dependents' in issue order; MARKERs
 * complete when met, through an explicit stack (the same LIFO sweep as the reference);
 * every op that becomes active is passed to on_active(op) with its ``state`` set to
 * READY. An op's own ``state`` attribute stays the truth the dispatcher reads and
 * writes (RELEASED is the dispatcher's); the run keeps its own copy of WAITING / READY /
 * DONE / DROPPED for the rule "activate only a WAITING node".
 *
 * A run drops its tuple of ops when nothing is pending (its ops refer to the job, which
 * refers to the run: the tuple would be a reference cycle), and supports the cyclic GC
 * for runs abandoned midway.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Node kinds (paella.dispatcher.devices.base) and states (paella.dispatcher.waitlist). */
enum { KERNEL = 0, MARKER = 3 };
enum { WAITING = 0, READY = 1, RELEASED = 2, DONE = 3, DROPPED = 4 };

static PyObject *s_state, *s_step, *s_forget;      /* interned attribute names */
static PyObject *v_state[5];                        /* the state ints */

/* ===================================================================================== */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    uint8_t *kind;
    int32_t *succ;           /* stream successor (its pred link), or -1 */
    int32_t *dstart;         /* dependents of node i: dep[dstart[i] .. dstart[i+1]) */
    int32_t *dep;
    int32_t *deps;           /* unmet dependencies after the issue */
    uint8_t *pp;             /* pred_pending after the issue */
    uint8_t *st;             /* WAITING / READY / DONE after the issue */
    int32_t *ready;          /* active after the issue, in activation order */
    Py_ssize_t nready;
    Py_ssize_t pending;      /* not done after the issue */
} PlanGraph;

static void graph_free_arrays(PlanGraph *g)
{
    PyMem_Free(g->kind);
    PyMem_Free(g->succ);
    PyMem_Free(g->dstart);
    PyMem_Free(g->dep);
    PyMem_Free(g->deps);
    PyMem_Free(g->pp);
    PyMem_Free(g->st);
    PyMem_Free(g->ready);
    g->kind = NULL;
    g->succ = g->dstart = g->dep = g->deps = g->ready = NULL;
    g->pp = g->st = NULL;
}

static void PlanGraph_dealloc(PlanGraph *g)
{
    graph_free_arrays(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

/* A Python int in [lo, hi), or -2 with an exception set. */
static long item_in(PyObject *seq, Py_ssize_t i, long lo, long hi, const char *what)
{
    PyObject *o = PySequence_GetItem(seq, i);
    if (o == NULL)
        return -2;
    long v = PyLong_AsLong(o);
    Py_DECREF(o);
    if (v == -1 && PyErr_Occurred())
        return -2;
    if (v < lo || v >= hi) {
        PyErr_Format(PyExc_ValueError, "PlanGraph: %s %ld at %zd is out of range [%ld, %ld)",
                     what, v, i, lo, hi);
        return -2;
    }
    return v;
}

static int PlanGraph_init(PlanGraph *g, PyObject *args, PyObject *kw)
{
    /* PlanGraph(kinds, succ, dependents, deps, pred_pending, states, ready): sequences of
       one entry per node (dependents: a sequence of index sequences); ready: indices. */
    static char *names[] = {"kinds", "succ", "dependents", "deps", "pred_pending", "states",
                            "ready", NULL};
    PyObject *kinds, *succ, *dependents, *deps, *pp, *states, *ready;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOO", names, &kinds, &succ, &dependents,
                                     &deps, &pp, &states, &ready))
        return -1;
    graph_free_arrays(g);
    Py_ssize_t n = PySequence_Size(kinds);
    if (n < 0)
        return -1;
    if (n >= INT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "PlanGraph: too many nodes");
        return -1;
    }
    PyObject *seqs[5] = {succ, dependents, deps, pp, states};
    for (int k = 0; k < 5; k++) {
        Py_ssize_t m = PySequence_Size(seqs[k]);
        if (m < 0)
            return -1;
        if (m != n) {
            PyErr_Format(PyExc_ValueError, "PlanGraph: %zd nodes but a sequence of %zd", n, m);
            return -1;
        }
    }
    Py_ssize_t nr = PySequence_Size(ready);
    if (nr < 0)
        return -1;
    Py_ssize_t alloc = n ? n : 1;
    g->n = n;
    g->kind = PyMem_Calloc((size_t)alloc, 1);
    g->succ = PyMem_Calloc((size_t)alloc, sizeof(int32_t));
    g->dstart = PyMem_Calloc((size_t)alloc + 1, sizeof(int32_t));
    g->deps = PyMem_Calloc((size_t)alloc, sizeof(int32_t));
    g->pp = PyMem_Calloc((size_t)alloc, 1);
    g->st = PyMem_Calloc((size_t)alloc, 1);
    g->ready = PyMem_Calloc((size_t)(nr ? nr : 1), sizeof(int32_t));
    if (!g->kind || !g->succ || !g->dstart || !g->deps || !g->pp || !g->st || !g->ready) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PySequence_GetItem(dependents, i);
        if (d == NULL)
            return -1;
        Py_ssize_t m = PySequence_Size(d);
        Py_DECREF(d);
        if (m < 0)
            return -1;
        total += m;
        if (total >= INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "PlanGraph: too many edges");
            return -1;
        }
        g->dstart[i + 1] = (int32_t)total;
    }
    g->dep = PyMem_Calloc((size_t)(total ? total : 1), sizeof(int32_t));
    if (!g->dep) {
        PyErr_NoMemory();
        return -1;
    }
    g->pending = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long v;
        if ((v = item_in(kinds, i, 0, 4, "kind")) < -1) return -1;
        g->kind[i] = (uint8_t)v;
        if ((v = item_in(succ, i, -1, n, "successor")) < -1) return -1;
        if (v >= 0 && v <= i) {
            PyErr_Format(PyExc_ValueError, "PlanGraph: node %zd's successor %ld is not later", i, v);
            return -1;
        }
        g->succ[i] = (int32_t)v;
        if ((v = item_in(deps, i, 0, n + 1, "dependency count")) < -1) return -1;
        g->deps[i] = (int32_t)v;
        if ((v = item_in(pp, i, 0, 2, "pred_pending")) < -1) return -1;
        g->pp[i] = (uint8_t)v;
        if ((v = item_in(states, i, 0, 4, "state")) < -1) return -1;
        if (v == RELEASED) {
            PyErr_SetString(PyExc_ValueError, "PlanGraph: no node is released at issue");
            return -1;
        }
        g->st[i] = (uint8_t)v;
        g->pending += v != DONE;
        PyObject *d = PySequence_GetItem(dependents, i);
        if (d == NULL)
            return -1;
        Py_ssize_t m = g->dstart[i + 1] - g->dstart[i];
        if (PySequence_Size(d) != m) {      /* changed under us */
            Py_DECREF(d);
            PyErr_SetString(PyExc_ValueError, "PlanGraph: dependents changed while read");
            return -1;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            long t = item_in(d, j, 0, n, "dependent");
            if (t < -1) {
                Py_DECREF(d);
                return -1;
            }
            if (t <= i) {
                Py_DECREF(d);
                PyErr_Format(PyExc_ValueError, "PlanGraph: node %zd's dependent %ld is not later", i, t);
                return -1;
            }
            g->dep[g->dstart[i] + j] = (int32_t)t;
        }
        Py_DECREF(d);
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        long v = item_in(ready, i, 0, n, "ready node");
        if (v < -1)
            return -1;
        if (g->st[v] != READY || g->kind[v] == MARKER) {
            PyErr_Format(PyExc_ValueError, "PlanGraph: ready node %ld is not an active op", v);
            return -1;
        }
        g->ready[i] = (int32_t)v;
    }
    g->nready = nr;
    return 0;
}

static PyObject *PlanGraph_len(PlanGraph *g, PyObject *Py_UNUSED(x))
{
    return PyLong_FromSsize_t(g->n);
}

static PyMethodDef PlanGraph_methods[] = {
    {"nodes", (PyCFunction)PlanGraph_len, METH_NOARGS, "number of nodes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PlanGraphType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher._replay.PlanGraph",
    .tp_basicsize = sizeof(PlanGraph),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A plan's dependency graph as the reference waitlist leaves it after issue.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PlanGraph_init,
    .tp_dealloc = (destructor)PlanGraph_dealloc,
    .tp_methods = PlanGraph_methods,
};

/* ===================================================================================== */
typedef struct {
    PyObject_HEAD
    PlanGraph *g;            /* NULL until __init__ succeeds */
    PyObject *ops;           /* tuple, one per node (None: MARKER); NULL once nothing pends */
    PyObject *on_active;
    int32_t *deps;
    uint8_t *pp;
    uint8_t *st;
    int32_t *stack;
    Py_ssize_t pending;
    int eager;
} PlanRun;

static int PlanRun_traverse(PlanRun *r, visitproc visit, void *arg)
{
    Py_VISIT(r->g);
    Py_VISIT(r->ops);
    Py_VISIT(r->on_active);
    return 0;
}

static int PlanRun_clear(PlanRun *r)
{
    Py_CLEAR(r->ops);
    Py_CLEAR(r->on_active);
    return 0;
}

static void PlanRun_dealloc(PlanRun *r)
{
    PyObject_GC_UnTrack(r);
    PlanRun_clear(r);
    Py_CLEAR(r->g);
    PyMem_Free(r->deps);
    PyMem_Free(r->pp);
    PyMem_Free(r->st);
    PyMem_Free(r->stack);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int PlanRun_init(PlanRun *r, PyObject *args, PyObject *kw)
{
    /* PlanRun(graph, ops, on_active, eager=False) */
    static char *names[] = {"graph", "ops", "on_active", "eager", NULL};
    PlanGraph *g;
    PyObject *ops, *cb;
    int eager = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O|p", names, &PlanGraphType, &g,
                                     &PyTuple_Type, &ops, &cb, &eager))
        return -1;
    if (r->g != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PlanRun: already initialized");
        return -1;
    }
    if (g->kind == NULL) {
        PyErr_SetString(PyExc_ValueError, "PlanRun: the graph was never initialized");
        return -1;
    }
    if (PyTuple_GET_SIZE(ops) != g->n) {
        PyErr_Format(PyExc_ValueError, "PlanRun: %zd ops for a graph of %zd nodes",
                     PyTuple_GET_SIZE(ops), g->n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < g->n; i++) {
        if ((PyTuple_GET_ITEM(ops, i) == Py_None) != (g->kind[i] == MARKER)) {
            PyErr_Format(PyExc_ValueError, "PlanRun: op %zd must be %s", i,
                         g->kind[i] == MARKER ? "None (a MARKER)" : "an op");
            return -1;
        }
    }
    if (!PyCallable_Check(cb)) {
        PyErr_SetString(PyExc_TypeError, "PlanRun: on_active must be callable");
        return -1;
    }
    size_t alloc = (size_t)(g->n ? g->n : 1);
    r->deps = PyMem_Malloc(alloc * sizeof(int32_t));
    r->pp = PyMem_Malloc(alloc);
    r->st = PyMem_Malloc(alloc);
    r->stack = PyMem_Malloc(alloc * sizeof(int32_t));
    if (!r->deps || !r->pp || !r->st || !r->stack) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(r->deps, g->deps, alloc * sizeof(int32_t));
    memcpy(r->pp, g->pp, alloc);
    memcpy(r->st, g->st, alloc);
    Py_INCREF(g);
    r->g = g;
    Py_INCREF(ops);
    r->ops = ops;
    Py_INCREF(cb);
    r->on_active = cb;
    r->pending = g->pending;
    r->eager = eager;
    if (r->pending == 0)
        Py_CLEAR(r->ops);
    return 0;
}

static int check_run(PlanRun *r)
{
    if (r->g == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PlanRun: not initialized");
        return -1;
    }
    return 0;
}

/* Node i has no unmet dependency left: an op goes to on_active as READY. */
static int activate_op(PlanRun *r, int32_t i)
{
    r->st[i] = READY;
    PyObject *op = PyTuple_GET_ITEM(r->ops, i);
    Py_INCREF(op);                       /* on_active may do anything, even drop the run */
    int rc = PyObject_SetAttr(op, s_state, v_state[READY]);
    if (rc == 0) {
        PyObject *res = PyObject_CallOneArg(r->on_active, op);
        if (res == NULL)
            rc = -1;
        Py_XDECREF(res);
    }
    Py_DECREF(op);
    return rc;
}

/* Node i is done (the reference's _done). */
static int mark_done(PlanRun *r, int32_t i)
{
    r->st[i] = DONE;
    r->pending--;
    if (r->g->kind[i] != MARKER)
        return PyObject_SetAttr(PyTuple_GET_ITEM(r->ops, i), s_state, v_state[DONE]);
    return 0;
}

/* A dependency of node t is met: MARKERs complete (pushed on the stack), ops activate. */
static int met(PlanRun *r, int32_t t, Py_ssize_t *top)
{
    if (--r->deps[t] != 0 || r->st[t] != WAITING)
        return 0;
    if (r->g->kind[t] == MARKER) {
        if (mark_done(r, t) < 0)
            return -1;
        r->stack[(*top)++] = t;
        return 0;
    }
    return activate_op(r, t);
}

static int sweep(PlanRun *r, Py_ssize_t top)
{
    PlanGraph *g = r->g;
    while (top) {
        int32_t d = r->stack[--top];
        int32_t s = g->succ[d];
        if (s >= 0 && r->pp[s]) {
            r->pp[s] = 0;
            if (met(r, s, &top) < 0)
                return -1;
        }
        for (int32_t k = g->dstart[d]; k < g->dstart[d + 1]; k++)
            if (met(r, g->dep[k], &top) < 0)
                return -1;
    }
    return 0;
}

/* The node index of op (its ``step``), checked against the run. */
static int32_t index_of(PlanRun *r, PyObject *op)
{
    if (check_run(r) < 0)
        return -1;
    if (r->ops == NULL) {
        PyErr_SetString(PyExc_ValueError, "PlanRun: nothing is pending in this run");
        return -1;
    }
    PyObject *v = PyObject_GetAttr(op, s_step);
    if (v == NULL)
        return -1;
    Py_ssize_t i = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i < 0 || i >= r->g->n || PyTuple_GET_ITEM(r->ops, i) != op) {
        PyErr_SetString(PyExc_ValueError, "PlanRun: not an op of this run");
        return -1;
    }
    return (int32_t)i;
}

static void drop_ops_if_idle(PlanRun *r)
{
    if (r->pending == 0)
        Py_CLEAR(r->ops);                /* no cycle job -> run -> ops -> job left */
}

static PyObject *PlanRun_start(PlanRun *r, PyObject *Py_UNUSED(x))
{
    /* Report the ops active after the issue, in activation order (the reference's
       on_active calls during issue). */
    if (check_run(r) < 0)
        return NULL;
    if (r->ops == NULL)
        Py_RETURN_NONE;
    PyObject *ops = r->ops;
    Py_INCREF(ops);
    for (Py_ssize_t k = 0; k < r->g->nready; k++) {
        int32_t i = r->g->ready[k];
        if (r->st[i] != READY)
            continue;
        PyObject *op = PyTuple_GET_ITEM(ops, i);
        Py_INCREF(op);
        int rc = PyObject_SetAttr(op, s_state, v_state[READY]);
        PyObject *res = rc == 0 ? PyObject_CallOneArg(r->on_active, op) : NULL;
        Py_DECREF(op);
        if (res == NULL) {
            Py_DECREF(ops);
            return NULL;
        }
        Py_DECREF(res);
        if (r->ops == NULL)
            break;
    }
    Py_DECREF(ops);
    Py_RETURN_NONE;
}

static PyObject *PlanRun_finish(PlanRun *r, PyObject *op)
{
    /* finish(op): op completed; meet the dependencies behind it. */
    int32_t i = index_of(r, op);
    if (i < 0)
        return NULL;
    if (r->st[i] == DONE) {
        PyErr_SetString(PyExc_ValueError, "PlanRun.finish: the op is already done");
        return NULL;
    }
    PyObject *ops = r->ops;
    Py_INCREF(ops);                      /* the sweep's callbacks may finish the run */
    int rc = mark_done(r, i);
    if (rc == 0) {
        r->stack[0] = i;
        rc = sweep(r, 1);
    }
    Py_DECREF(ops);
    if (rc < 0)
        return NULL;
    drop_ops_if_idle(r);
    Py_RETURN_NONE;
}

/* The stream successor of released op i may go now, unless it is a MARKER. */
static PyObject *release_succ(PlanRun *r, PyObject *op)
{
    int32_t i = index_of(r, op);
    if (i < 0)
        return NULL;
    int32_t s = r->g->succ[i];
    if (s < 0 || !r->pp[s] || r->g->kind[s] == MARKER)
        Py_RETURN_NONE;
    r->pp[s] = 0;
    PyObject *ops = r->ops;
    Py_INCREF(ops);
    int rc = 0;
    if (--r->deps[s] == 0 && r->st[s] == WAITING)
        rc = activate_op(r, s);
    Py_DECREF(ops);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *PlanRun_released(PlanRun *r, PyObject *op)
{
    /* released(op): op went to a real stream (its state becomes RELEASED); in eager
       mode its successor may go too. */
    int32_t i = index_of(r, op);
    if (i < 0 || PyObject_SetAttr(op, s_state, v_state[RELEASED]) < 0)
        return NULL;
    if (!r->eager)
        Py_RETURN_NONE;
    return release_succ(r, op);
}

static PyObject *PlanRun_release_ahead(PlanRun *r, PyObject *op)
{
    /* release_ahead(op): lookahead, the dispatcher's: op (a released kernel or copy) lets
       its successor go now, unless that is a MARKER. */
    return release_succ(r, op);
}

static PyObject *PlanRun_drop_unreleased(PlanRun *r, PyObject *Py_UNUSED(x))
{
    /* Abort: every op not released is dropped (and forgets its operands). Returns the
       dropped ops that were READY. */
    if (check_run(r) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || r->ops == NULL)
        return out;
    PyObject *ops = r->ops;
    Py_INCREF(ops);
    for (Py_ssize_t i = 0; i < r->g->n; i++) {
        uint8_t s = r->st[i];
        if (s != WAITING && s != READY)
            continue;
        if (r->g->kind[i] == MARKER) {   /* never ran: no longer pending */
            r->st[i] = DROPPED;
            r->pending--;
            continue;
        }
        PyObject *o = PyTuple_GET_ITEM(ops, i);
        PyObject *v = PyObject_GetAttr(o, s_state);
        if (v == NULL)
            goto fail;
        long now = PyLong_AsLong(v);
        Py_DECREF(v);
        if (now == -1 && PyErr_Occurred())
            goto fail;
        if (now != WAITING && now != READY)
            continue;                    /* released by the dispatcher: it will finish */
        if (now == READY && PyList_Append(out, o) < 0)
            goto fail;
        r->st[i] = DROPPED;
        r->pending--;
        if (PyObject_SetAttr(o, s_state, v_state[DROPPED]) < 0)
            goto fail;
        PyObject *res = PyObject_CallMethodNoArgs(o, s_forget);
        if (res == NULL)
            goto fail;
        Py_DECREF(res);
    }
    Py_DECREF(ops);
    drop_ops_if_idle(r);
    return out;
fail:
    Py_DECREF(ops);
    Py_DECREF(out);
    return NULL;
}

static PyObject *PlanRun_get_pending(PlanRun *r, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(r->pending);
}

static PyObject *PlanRun_get_eager(PlanRun *r, void *Py_UNUSED(c))
{
    return PyBool_FromLong(r->eager);
}

static int PlanRun_set_eager(PlanRun *r, PyObject *v, void *Py_UNUSED(c))
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete eager");
        return -1;
    }
    int b = PyObject_IsTrue(v);
    if (b < 0)
        return -1;
    r->eager = b;
    return 0;
}

static PyGetSetDef PlanRun_getset[] = {
    {"pending", (getter)PlanRun_get_pending, NULL, "nodes not finished (nor dropped)", NULL},
    {"eager", (getter)PlanRun_get_eager, (setter)PlanRun_set_eager,
     "release mode: a released op lets its stream successor go", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef PlanRun_methods[] = {
    {"start", (PyCFunction)PlanRun_start, METH_NOARGS, "report the ops active after the issue"},
    {"finish", (PyCFunction)PlanRun_finish, METH_O, "finish(op): op completed"},
    {"released", (PyCFunction)PlanRun_released, METH_O, "released(op): op went to a real stream"},
    {"release_ahead", (PyCFunction)PlanRun_release_ahead, METH_O,
     "release_ahead(op): a released kernel or copy lets its successor go, unless a MARKER (lookahead)"},
    {"drop_unreleased", (PyCFunction)PlanRun_drop_unreleased, METH_NOARGS,
     "drop every op not released; returns those that were READY"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PlanRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher._replay.PlanRun",
    .tp_basicsize = sizeof(PlanRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One job's replay of a PlanGraph: the waitlist interface, in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PlanRun_init,
    .tp_dealloc = (destructor)PlanRun_dealloc,
    .tp_traverse = (traverseproc)PlanRun_traverse,
    .tp_clear = (inquiry)PlanRun_clear,
    .tp_methods = PlanRun_methods,
    .tp_getset = PlanRun_getset,
};

/* ===================================================================================== */
static struct PyModuleDef replay_module = {
    PyModuleDef_HEAD_INIT, "_replay", "The compiled replay of launch plans.", -1, NULL,
};

PyMODINIT_FUNC PyInit__replay(void)
{
    if (PyType_Ready(&PlanGraphType) < 0 || PyType_Ready(&PlanRunType) < 0)
        return NULL;
    s_state = PyUnicode_InternFromString("state");
    s_step = PyUnicode_InternFromString("step");
    s_forget = PyUnicode_InternFromString("forget");
    if (!s_state || !s_step || !s_forget)
        return NULL;
    for (int k = 0; k < 5; k++)
        if ((v_state[k] = PyLong_FromLong(k)) == NULL)
            return NULL;
    PyObject *m = PyModule_Create(&replay_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PlanGraphType);
    Py_INCREF(&PlanRunType);
    if (PyModule_AddObject(m, "PlanGraph", (PyObject *)&PlanGraphType) < 0 ||
        PyModule_AddObject(m, "PlanRun", (PyObject *)&PlanRunType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
