/*
 * The occupancy tracker's hot half, in C: the notifQ drain, the +B admission check and
 * the launch bookkeeping (paella.dispatcher.occupancy explains the rules; the Python
 * class there is this type's subclass and holds everything that is not per kernel).
 *
 * Why C: these run once per notification and once per release, and in Python they
 * cost ~1.5 us per kernel in attribute reads and integer boxing alone. Here the state
 * of a launch in flight lives in plain arrays indexed by its counter pair, so a
 * notification touches no Python object at all.
 *
 * The contract with Python is explicit: a launch is described by a Demand (this module's
 * small immutable record: blocks, per-block warps, registers and shared memory, notifQ
 * entries), release() takes a Demand and an opaque token, and drain() hands the token back
 * to on_done(token, t_first) when the launch's last block completes. No attribute of any
 * Python object is read or written by name.
 *
 * Thread model: the dispatcher's one thread. The ring is written concurrently by the
 * device (the GPU, or the simulator's process): slots are read through a volatile
 * pointer, one 64-bit load each, and INVALID (0) is stored back once consumed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdio.h>

#include "capi.h"

enum { B = 0, W = 1, R = 2, S = 3 };  /* blocks, warps, registers, shared memory */

/* -- Demand: what one launch asks of the GPU ------------------------------------------ */
typedef struct {
    PyObject_HEAD
    long long blocks, warps, regs, smem, entries;   /* warps/regs/smem: per block */
} Demand;

static PyTypeObject DemandType;

static PyObject *Demand_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"blocks", "warps", "regs", "smem", "entries", NULL};
    long long b, w, r, s, e;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLLLL", kw, &b, &w, &r, &s, &e))
        return NULL;
    if (b < 1 || w < 0 || r < 0 || s < 0 || e < 2) {
        PyErr_Format(PyExc_ValueError, "a Demand needs blocks >= 1, warps, regs and smem "
                     ">= 0 and entries >= 2 (got %lld, %lld, %lld, %lld, %lld)", b, w, r, s, e);
        return NULL;
    }
    Demand *self = (Demand *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->blocks = b, self->warps = w, self->regs = r, self->smem = s, self->entries = e;
    return (PyObject *)self;
}

static PyObject *Demand_repr(Demand *self)
{
    return PyUnicode_FromFormat("Demand(blocks=%lld, warps=%lld, regs=%lld, smem=%lld, "
                                "entries=%lld)", self->blocks, self->warps, self->regs,
                                self->smem, self->entries);
}

static PyMemberDef Demand_members[] = {
    {"blocks", T_LONGLONG, offsetof(Demand, blocks), READONLY, "blocks of the launch"},
    {"warps", T_LONGLONG, offsetof(Demand, warps), READONLY, "warps per block"},
    {"regs", T_LONGLONG, offsetof(Demand, regs), READONLY, "registers per block (granules)"},
    {"smem", T_LONGLONG, offsetof(Demand, smem), READONLY, "shared memory per block (bytes)"},
    {"entries", T_LONGLONG, offsetof(Demand, entries), READONLY,
     "notifQ entries the launch may post"},
    {NULL}
};

static PyTypeObject DemandType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher._tracker.Demand",
    .tp_basicsize = sizeof(Demand),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Demand(blocks, warps, regs, smem, entries): what one kernel launch asks of "
              "the GPU, per block, and the notifQ entries it may post (immutable).",
    .tp_new = Demand_new,
    .tp_repr = (reprfunc)Demand_repr,
    .tp_members = Demand_members,
};

static Demand *as_demand(PyObject *o)
{
    if (!PyObject_TypeCheck(o, &DemandType)) {
        PyErr_Format(PyExc_TypeError, "expected a Demand (Tracker.demand()), got %.100s",
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    return (Demand *)o;
}

typedef struct {
    PyObject_HEAD
    PyObject *ring_obj;          /* the notifQ array (kept alive while we read it) */
    Py_buffer view;
    volatile uint64_t *ring;
    int64_t nslots, mask, head, reserved;
    int64_t extra_blocks, group;
    int64_t cap[4], used[4], demand[4];   /* demand: released, not yet placed */
    int nsm;
    int64_t *sm;                 /* nsm x 4 */
    /* Per launch (counter pair) and SM, blocks its placement entries attributed to that SM
     * and not yet taken off it (npairs x nsm), and their sum per launch. An entry names
     * only its posting block's SM, so a group's placement and completion can name two
     * SMs: a completion takes blocks off its own SM only up to what the launch put there,
     * and whatever is left comes off when the launch's last block completes. Per-SM usage
     * is then exact at group 1, never negative, and back to zero with nothing in flight
     * (subtracting every completion from its SM drifted without bound). */
    int64_t *slot_sm;
    int64_t *resid;
    /* the notification word's layout (paella.protocol) */
    int kind_shift, sm_shift, count_shift, placement, completion;
    uint64_t launch_mask;
    /* launches in flight, by counter pair */
    int npairs, id_shift;
    int64_t gen_mask;
    PyObject **tok;              /* the caller's token of each launch in flight */
    int64_t *lid, *gen, *blocks, *fw, *fr, *fs, *entries, *placed, *ended;
    double *t_first;             /* when its first block was reported placed */
    /* Deferred launches (release(..., behind=)): a launch queued behind a running kernel
     * of its own stream cannot start before that kernel ends, so its demand does not
     * count as unplaced work until then (or until a block of it is reported placed).
     * pred_of[slot]: the launch it waits behind (-1: not deferred); succ[slot]: the
     * launch deferred behind it (-1: none; a stream's FIFO has one next launch). */
    int32_t *pred_of, *succ;
    int64_t deferred;            /* blocks of deferred launches */
    int32_t *freeq;
    int free_head, free_count;
} Tracker;

static PyTypeObject TrackerType;

static inline int flow_ok(Tracker *self, int64_t entries)
{
    return self->free_count > 0 && self->reserved - self->head + entries <= self->nslots;
}

/* -- construction --------------------------------------------------------------------- */
static int Tracker_init(Tracker *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"ring", "cap", "sm_count", "extra_blocks", "group", "counter_pairs",
                         "layout", NULL};
    PyObject *ring;
    long long cap[4], extra, group;
    int nsm, npairs;
    int ks, ss, cs, pl, co;
    unsigned long long lmask;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O(LLLL)iLLi(iiiKii)", kw, &ring, &cap[0],
                                     &cap[1], &cap[2], &cap[3], &nsm, &extra, &group, &npairs,
                                     &ks, &ss, &cs, &lmask, &pl, &co))
        return -1;
    if (self->ring_obj != NULL || self->sm != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Tracker is initialised once");
        return -1;
    }
    if (npairs < 1 || (npairs & (npairs - 1)) || nsm < 1 || group < 1 || extra < 0) {
        PyErr_Format(PyExc_ValueError, "counter pairs must be a power of two, SMs and group "
                     ">= 1, B >= 0 (got %d pairs, %d SMs, group %lld, B %lld)", npairs, nsm,
                     group, extra);
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(ring, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    int64_t n = view.len / 8;
    if (view.itemsize != 8 || n < 1 || (n & (n - 1)) || ((uintptr_t)view.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "the notifQ must be a writable, 8-byte aligned array of "
                     "64-bit slots whose length is a power of two (got %zd bytes of %zd-byte "
                     "items)", view.len, view.itemsize);
        PyBuffer_Release(&view);
        return -1;
    }
    self->nslots = n;
    self->mask = n - 1;
    self->extra_blocks = extra;
    self->group = group;
    for (int r = 0; r < 4; r++)
        self->cap[r] = cap[r];
    self->nsm = nsm;
    self->kind_shift = ks;
    self->sm_shift = ss;
    self->count_shift = cs;
    self->launch_mask = lmask;
    self->placement = pl;
    self->completion = co;
    self->npairs = npairs;
    self->id_shift = 0;
    while ((1 << self->id_shift) < npairs)
        self->id_shift++;
    self->gen_mask = (int64_t)(lmask >> self->id_shift);
    self->sm = PyMem_Calloc((size_t)nsm * 4, sizeof(int64_t));
    self->tok = PyMem_Calloc(npairs, sizeof(PyObject *));
    self->t_first = PyMem_Calloc(npairs, sizeof(double));
    self->freeq = PyMem_Calloc(npairs, sizeof(int32_t));
    self->pred_of = PyMem_Calloc(npairs, sizeof(int32_t));
    self->succ = PyMem_Calloc(npairs, sizeof(int32_t));
    self->slot_sm = PyMem_Calloc((size_t)npairs * nsm, sizeof(int64_t));
    int64_t **arrays[] = {&self->lid, &self->gen, &self->blocks, &self->fw, &self->fr,
                          &self->fs, &self->entries, &self->placed, &self->ended, &self->resid};
    int ok = self->sm && self->tok && self->t_first && self->freeq && self->slot_sm &&
             self->pred_of && self->succ;
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) {
        *arrays[i] = PyMem_Calloc(npairs, sizeof(int64_t));
        ok = ok && *arrays[i];
    }
    if (!ok) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < npairs; i++) {
        self->freeq[i] = i;
        self->lid[i] = -1;
        self->pred_of[i] = self->succ[i] = -1;
    }
    self->free_head = 0;
    self->free_count = npairs;
    self->view = view;               /* last: a tracker with a ring is a usable one */
    Py_INCREF(ring);
    self->ring_obj = ring;
    self->ring = (volatile uint64_t *)view.buf;
    return 0;
}

/* Every method but the constructor's: refuse a tracker whose __init__ did not run. */
static int ready(Tracker *self)
{
    if (self->ring == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "TrackerCore.__init__ was not called or failed");
        return 0;
    }
    return 1;
}

static int Tracker_traverse(Tracker *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ring_obj);
    if (self->tok)
        for (int i = 0; i < self->npairs; i++)
            Py_VISIT(self->tok[i]);
    return 0;
}

static int Tracker_clear(Tracker *self)
{
    if (self->tok)
        for (int i = 0; i < self->npairs; i++)
            Py_CLEAR(self->tok[i]);
    return 0;
}

static void Tracker_dealloc(Tracker *self)
{
    PyObject_GC_UnTrack(self);
    Tracker_clear(self);
    if (self->ring_obj != NULL) {
        PyBuffer_Release(&self->view);
        Py_CLEAR(self->ring_obj);
    }
    PyMem_Free(self->sm);
    PyMem_Free(self->tok);
    PyMem_Free(self->t_first);
    PyMem_Free(self->freeq);
    PyMem_Free(self->pred_of);
    PyMem_Free(self->succ);
    PyMem_Free(self->slot_sm);
    int64_t *arrays[] = {self->lid, self->gen, self->blocks, self->fw, self->fr, self->fs,
                         self->entries, self->placed, self->ended, self->resid};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++)
        PyMem_Free(arrays[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* -- release side --------------------------------------------------------------------- */
static PyObject *Tracker_flow_ok(Tracker *self, PyObject *arg)
{
    Demand *d = as_demand(arg);
    if (!ready(self) || d == NULL)
        return NULL;
    return PyBool_FromLong(flow_ok(self, d->entries));
}

/* Add (sign 1) or take back (sign -1) a launch's demand as unplaced work. */
static void count_demand(Tracker *self, int slot, int64_t sign)
{
    int64_t n = sign * self->blocks[slot];
    self->demand[B] += n;
    self->demand[W] += n * self->fw[slot];
    self->demand[R] += n * self->fr[slot];
    self->demand[S] += n * self->fs[slot];
}

/* The +B rule (paella.dispatcher.tracker explains it): the blocks of the unplaced work
   plus this launch that the free resources cannot hold now, estimated on GPU-wide totals,
   must stay within B. A launch past that goes only when nothing else waits: with B > 0
   at once (a kernel larger than the GPU runs in waves), with B = 0 only on an idle GPU,
   so that at B = 0 no kernel ever waits in a hardware queue behind resident work.
   `pd` (may be NULL): a launch in flight on the candidate's own stream, which the
   candidate cannot start before: its resources, resident or still unplaced, count as
   free and its blocks as no longer waiting (admits_after). */
static int admits_raw(Tracker *self, const PaellaDemand *dm, const PaellaDemand *pd)
{
    if (!flow_ok(self, dm->entries))
        return 0;
    int64_t n = dm->blocks, p = pd != NULL ? pd->blocks : 0;
    int64_t need[4] = {n, n * dm->warps, n * dm->regs, n * dm->smem};
    int64_t credit[4] = {p, pd != NULL ? p * pd->warps : 0, pd != NULL ? p * pd->regs : 0,
                         pd != NULL ? p * pd->smem : 0};
    double excess = 0.0;
    for (int k = 0; k < 4; k++) {
        int64_t d = self->demand[k] + need[k];
        if (d) {
            double frac = (double)(d - (self->cap[k] - self->used[k] + credit[k])) / (double)d;
            if (frac > excess)
                excess = frac;
        }
    }
    int64_t u = self->demand[B] - p;
    if (u < 0)
        u = 0;
    if ((double)(u + n) * excess <= (double)self->extra_blocks)
        return 1;
    if (u == 0 && (self->extra_blocks > 0 || self->used[B] - p <= 0))
        return 1;
    return 0;
}

/* admits_raw behind the same-stream launch `pred_lid` (-1: unknown). A predecessor that
   is itself deferred (lookahead 3+: it waits behind the kernel before it) is judged as
   if counted: its blocks are unplaced work from the moment it may start. Without this a
   chain's third kernel went earlier than before deferral, and the daemon's back-to-back
   latency suffered (paella demo: SqueezeNet 1.08-1.14x before deferral, up to 1.45x with
   it alone). Its demand is added for the test and taken back: the common path, no
   predecessor, is admits_raw unchanged. */
static int admits_behind(Tracker *self, const PaellaDemand *dm, const PaellaDemand *pd,
                         long long pred_lid)
{
    if (pd == NULL || pred_lid < 0)
        return admits_raw(self, dm, pd);
    int ps = (int)(pred_lid & (self->npairs - 1));
    if (self->lid[ps] != pred_lid || self->pred_of[ps] < 0)
        return admits_raw(self, dm, pd);
    count_demand(self, ps, 1);
    int ok = admits_raw(self, dm, pd);
    count_demand(self, ps, -1);
    return ok;
}

/* A Demand's fields, without the object header. */
static inline PaellaDemand raw(const Demand *d)
{
    PaellaDemand r = {d->blocks, d->warps, d->regs, d->smem, d->entries};
    return r;
}

static int admits_rule(Tracker *self, Demand *dm, Demand *pd, long long pred_lid)
{
    PaellaDemand d = raw(dm), q;
    if (pd != NULL)
        q = raw(pd);
    return admits_behind(self, &d, pd != NULL ? &q : NULL, pred_lid);
}

static PyObject *Tracker_admits(Tracker *self, PyObject *arg)
{
    Demand *dm = as_demand(arg);
    if (!ready(self) || dm == NULL)
        return NULL;
    return PyBool_FromLong(admits_rule(self, dm, NULL, -1));
}

static PyObject *Tracker_admits_after(Tracker *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "admits_after(demand, predecessor_demand, "
                        "predecessor_launch_id=-1)");
        return NULL;
    }
    Demand *dm = as_demand(args[0]);
    if (dm == NULL)
        return NULL;
    Demand *pd = as_demand(args[1]);
    if (!ready(self) || pd == NULL)
        return NULL;
    long long plid = -1;
    if (nargs == 3 && (plid = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(admits_rule(self, dm, pd, plid));
}

/* Do `k` blocks of the launch fit in the resources that are neither resident nor claimed
   by unplaced work? (GPU-wide totals, as the +B rule.) */
static int fits_raw(Tracker *self, const PaellaDemand *dm, int whole)
{
    int64_t k = whole ? dm->blocks : 1;
    int64_t need[4] = {k, k * dm->warps, k * dm->regs, k * dm->smem};
    for (int i = 0; i < 4; i++)
        if (need[i] > self->cap[i] - self->used[i] - self->demand[i])
            return 0;
    return 1;
}

static PyObject *fits(Tracker *self, PyObject *arg, int whole)
{
    Demand *dm = as_demand(arg);
    if (!ready(self) || dm == NULL)
        return NULL;
    PaellaDemand d = raw(dm);
    return PyBool_FromLong(fits_raw(self, &d, whole));
}

static PyObject *Tracker_fits_now(Tracker *self, PyObject *arg)
{
    return fits(self, arg, 1);
}

static PyObject *Tracker_starts_now(Tracker *self, PyObject *arg)
{
    return fits(self, arg, 0);
}

/* A launch's last block completed: the blocks its placements attributed to SMs that its
 * completions did not name come off those SMs now. */
static void take_rest(Tracker *self, int slot)
{
    int64_t *c = self->slot_sm + (size_t)slot * self->nsm;
    int64_t fp[4] = {1, self->fw[slot], self->fr[slot], self->fs[slot]};
    for (int sm = 0; sm < self->nsm; sm++) {
        if (c[sm]) {
            for (int r = 0; r < 4; r++)
                self->sm[4 * sm + r] -= c[sm] * fp[r];
            c[sm] = 0;
        }
    }
    self->resid[slot] = 0;
}

static void finish_slot(Tracker *self, int slot)
{
    self->tok[slot] = NULL;      /* the caller owns the reference now */
    self->lid[slot] = -1;
    self->freeq[(self->free_head + self->free_count) & (self->npairs - 1)] = slot;
    self->free_count++;
}

/* A deferred launch is no longer: unlinked from the launch it waited behind. */
static void undefer(Tracker *self, int slot)
{
    self->succ[self->pred_of[slot]] = -1;
    self->pred_of[slot] = -1;
    self->deferred -= self->blocks[slot];
}

/* A deferred launch's predecessor ended (or it was placed first): its demand counts. */
static void activate(Tracker *self, int slot)
{
    if (self->pred_of[slot] < 0)
        return;
    undefer(self, slot);
    count_demand(self, slot, 1);
}

/* Undo a release whose blocks have not started: its demand and entries go back; a launch
   deferred behind it counts from now on (nothing holds it back any more). */
static void withdraw(Tracker *self, int slot)
{
    if (self->pred_of[slot] >= 0)    /* deferred: its demand was never counted */
        undefer(self, slot);
    else
        count_demand(self, slot, -1);
    if (self->succ[slot] >= 0)
        activate(self, self->succ[slot]);
    self->reserved -= self->entries[slot];
    finish_slot(self, slot);
}

/* Link `slot` (released just now, its demand counted) as deferred behind launch
   `behind`, if that one is in flight, has blocks not ended yet and no launch deferred
   behind it already: 1 if linked (the caller then takes its demand back), else 0. */
static int defer(Tracker *self, int slot, long long behind)
{
    int p = (int)(behind & (self->npairs - 1));
    if (p == slot || self->tok[p] == NULL || self->lid[p] != behind
            || self->ended[p] >= self->blocks[p] || self->succ[p] >= 0)
        return 0;
    self->succ[p] = slot;
    self->pred_of[slot] = p;
    self->deferred += self->blocks[slot];
    return 1;
}

/* The launch id of a new launch, or -1 with RuntimeError (no counter pair free). */
static long long release_raw(Tracker *self, const PaellaDemand *dm, PyObject *tok)
{
    if (!self->free_count) {
        PyErr_SetString(PyExc_RuntimeError, "release() with every counter pair in flight: "
                        "check admits() or flow_ok() first (internal error, please report)");
        return -1;
    }
    int64_t n = dm->blocks, w = dm->warps, r = dm->regs, s = dm->smem;
    int slot = self->freeq[self->free_head];
    self->free_head = (self->free_head + 1) & (self->npairs - 1);
    self->free_count--;
    int64_t g = self->gen[slot] = (self->gen[slot] + 1) & self->gen_mask;
    int64_t lid = (g << self->id_shift) | slot;
    self->tok[slot] = Py_NewRef(tok);
    self->lid[slot] = lid;
    self->blocks[slot] = n;
    self->fw[slot] = w;
    self->fr[slot] = r;
    self->fs[slot] = s;
    self->entries[slot] = dm->entries;
    self->placed[slot] = self->ended[slot] = 0;
    self->t_first[slot] = 0.0;
    self->demand[B] += n;
    self->demand[W] += n * w;
    self->demand[R] += n * r;
    self->demand[S] += n * s;
    self->reserved += dm->entries;
    return lid;
}

/* release_raw behind launch `behind` (-1: none): the new launch's demand is deferred if
   `behind` qualifies (defer). A function of its own, so that release_raw, the common
   path, is what it was. (A free slot has succ and pred_of -1: set at init, cleared
   where they are set.) */
static long long release_behind_raw(Tracker *self, const PaellaDemand *dm, PyObject *tok,
                                    long long behind)
{
    long long lid = release_raw(self, dm, tok);
    if (lid >= 0 && behind >= 0) {
        int slot = (int)(lid & (self->npairs - 1));
        if (defer(self, slot, behind))
            count_demand(self, slot, -1);
    }
    return lid;
}

/* release(demand, token, behind=-1) -> launch id. No Python code runs here. */
static PyObject *Tracker_release(Tracker *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "release(demand, token, behind=-1) takes 2 or 3 "
                        "arguments");
        return NULL;
    }
    Demand *dm = as_demand(args[0]);
    if (!ready(self) || dm == NULL)
        return NULL;
    long long behind = -1;
    if (nargs == 3 && (behind = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred())
        return NULL;
    PaellaDemand d = raw(dm);
    long long lid = release_behind_raw(self, &d, args[1], behind);
    return lid < 0 ? NULL : PyLong_FromLongLong(lid);
}

/* The slot of launch `lid` if it is in flight, else -1 with ValueError. */
static int slot_of(Tracker *self, PyObject *arg, const char *what)
{
    long long lid = PyLong_AsLongLong(arg);
    if (lid == -1 && PyErr_Occurred())
        return -1;
    int slot = (int)(lid & (self->npairs - 1));
    if (lid < 0 || self->tok[slot] == NULL || self->lid[slot] != lid) {
        PyErr_Format(PyExc_ValueError, "%s(): launch %lld is not in flight", what, lid);
        return -1;
    }
    return slot;
}

static PyObject *Tracker_unrelease(Tracker *self, PyObject *arg)
{
    if (!ready(self))
        return NULL;
    int slot = slot_of(self, arg, "unrelease");
    if (slot < 0)
        return NULL;
    if (self->placed[slot] || self->ended[slot]) {
        PyErr_Format(PyExc_ValueError, "unrelease(): launch %lld has blocks on the GPU already; "
                     "unrelease is for a launch the device refused", (long long)self->lid[slot]);
        return NULL;
    }
    PyObject *tok = self->tok[slot];
    withdraw(self, slot);
    Py_DECREF(tok);
    Py_RETURN_NONE;
}

/* -- notification side ---------------------------------------------------------------- */
/* Keep the first Python error of a drain; report any later one as unraisable. */
static void keep_error(PyObject **t, PyObject **v, PyObject **tb)
{
    if (*t == NULL)
        PyErr_Fetch(t, v, tb);
    else
        PyErr_WriteUnraisable(NULL);
}

/* Tokens to report after a drain's batch, in order: a small array, then a list if many. */
typedef struct {
    PyObject *tok[64];
    double t[64];
    int n;
    PyObject *more;              /* list of (token, t) tuples */
} Batch;

static int batch_add(Batch *f, PyObject *tok, double t)   /* steals tok */
{
    if (f->n < 64) {
        f->tok[f->n] = tok;
        f->t[f->n++] = t;
        return 0;
    }
    if (f->more == NULL && (f->more = PyList_New(0)) == NULL) {
        Py_DECREF(tok);
        return -1;
    }
    PyObject *pair = Py_BuildValue("(Nd)", tok, t);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(f->more, pair);
    Py_DECREF(pair);
    return rc;
}

/* Call fn(token) or fn(token, t) for each entry, releasing them; errors are kept. */
static void batch_report(Batch *f, PyObject *fn, int with_time, PyObject **et, PyObject **ev,
                         PyObject **etb)
{
    for (int i = 0; i < f->n; i++) {
        PyObject *r;
        if (fn == NULL) {
            r = Py_NewRef(Py_None);
        } else if (with_time) {
            PyObject *t = PyFloat_FromDouble(f->t[i]);
            PyObject *argv[2] = {f->tok[i], t};
            r = t == NULL ? NULL : PyObject_Vectorcall(fn, argv, 2, NULL);
            Py_XDECREF(t);
        } else {
            r = PyObject_CallOneArg(fn, f->tok[i]);
        }
        Py_DECREF(f->tok[i]);
        if (r == NULL)
            keep_error(et, ev, etb);
        else
            Py_DECREF(r);
    }
    if (f->more != NULL) {
        for (Py_ssize_t j = 0; fn != NULL && j < PyList_GET_SIZE(f->more); j++) {
            PyObject *pair = PyList_GET_ITEM(f->more, j);
            PyObject *r = with_time ? PyObject_Call(fn, pair, NULL)
                                    : PyObject_CallOneArg(fn, PyTuple_GET_ITEM(pair, 0));
            if (r == NULL)
                keep_error(et, ev, etb);
            else
                Py_DECREF(r);
        }
        Py_DECREF(f->more);
    }
}

/* Where a drain reports launches: their first placement (only if `start` is set) and
   their last completion. The Python drain batches them for callbacks after the loop; the
   C API hands completions to the kernel core as they come. */
typedef struct DrainSink {
    void (*start)(struct DrainSink *, PyObject *tok, double now);            /* borrowed */
    void (*done)(struct DrainSink *, int slot, PyObject *tok, double t0);    /* steals */
} DrainSink;

/* Apply every entry from the head until an INVALID slot (or a bad entry: *why is set and
   *bad holds it). Totals, per SM, the launch's counts, its counter pair freed when its
   last block completes. Returns the entries consumed. */
static int64_t apply_entries(Tracker *self, double now, DrainSink *sink, uint64_t *bad,
                             const char **why)
{
    volatile uint64_t *ring = self->ring;
    int64_t head = self->head, mask = self->mask, start = head, pair_mask = self->npairs - 1;
    uint64_t w = ring[head & mask];
    while (w) {
        ring[head & mask] = 0;   /* INVALID back: the slot is free again */
        head++;
        int64_t lid = (int64_t)(w & self->launch_mask);
        int slot = (int)(lid & pair_mask);
        int kind = (int)(w >> self->kind_shift);
        int sm = (int)((w >> self->sm_shift) & 0xFF);
        int64_t n = (int64_t)((w >> self->count_shift) & 0xFF);
        if (self->tok[slot] == NULL || self->lid[slot] != lid) {
            *bad = w, *why = "names a launch that is not in flight";
            break;
        }
        int placing = kind == self->placement;
        if ((!placing && kind != self->completion) || n < 1 || n > self->group) {
            *bad = w, *why = "is malformed (unknown kind, or a block count outside 1..group)";
            break;
        }
        /* %smid need not be contiguous, nor below the SM count (PTX ISA: %nsmid "may be
         * larger than the physical number of SMs"): an id past the count is a real SM all
         * the same, and only the per-SM figures, approximate anyway, fold it in. */
        if (sm >= self->nsm)
            sm %= self->nsm;
        if ((placing ? self->placed[slot] : self->ended[slot]) + n > self->blocks[slot]) {
            *bad = w, *why = "counts more blocks than its launch has";
            break;
        }
        int64_t d[4] = {n, n * self->fw[slot], n * self->fr[slot], n * self->fs[slot]};
        int64_t *usm = self->sm + 4 * sm;
        int64_t *here = self->slot_sm + (size_t)slot * self->nsm + sm;
        if (placing) {
            if (!self->placed[slot]) {
                if (self->deferred && self->pred_of[slot] >= 0)   /* placed before its */
                    activate(self, slot);        /* predecessor's end was read: it counts */
                self->t_first[slot] = now;
                if (sink->start != NULL)
                    sink->start(sink, self->tok[slot], now);
            }
            self->placed[slot] += n;
            *here += n;
            self->resid[slot] += n;
            for (int r = 0; r < 4; r++) {
                self->used[r] += d[r];
                usm[r] += d[r];
                self->demand[r] -= d[r];
            }
        } else {
            int64_t k = n < *here ? n : *here;   /* what this launch put on this SM */
            *here -= k;
            self->resid[slot] -= k;
            int64_t dk[4] = {k, k * self->fw[slot], k * self->fr[slot], k * self->fs[slot]};
            for (int r = 0; r < 4; r++) {
                self->used[r] -= d[r];
                usm[r] -= dk[r];
            }
            if ((self->ended[slot] += n) == self->blocks[slot]) {
                if (self->resid[slot])
                    take_rest(self, slot);
                if (self->deferred && self->succ[slot] >= 0)   /* the one behind it may */
                    activate(self, self->succ[slot]);         /* start now */
                double t0 = self->t_first[slot];
                PyObject *tok = self->tok[slot];
                finish_slot(self, slot);                 /* its reference is ours now */
                sink->done(sink, slot, tok, t0);
            }
        }
        w = ring[head & mask];
    }
    self->head = head;
    return head - start;
}

static PyObject *bad_entry(Tracker *self, uint64_t bad, const char *why)
{
    char word[24];               /* PyErr_Format has no %llx before Python 3.12 */
    snprintf(word, sizeof word, "%#018llx", (unsigned long long)bad);
    PyErr_Format(PyExc_RuntimeError, "notifQ entry %s (launch %llu) %s "
                 "(internal error, please report)", word,
                 (unsigned long long)(bad & self->launch_mask), why);
    return NULL;
}

typedef struct {
    DrainSink base;
    Batch fin, started;
    PyObject *et, *ev, *etb;
} PySink;

static void py_start(DrainSink *s, PyObject *tok, double now)
{
    PySink *p = (PySink *)s;
    if (batch_add(&p->started, Py_NewRef(tok), now) < 0)
        keep_error(&p->et, &p->ev, &p->etb);
}

static void py_done(DrainSink *s, int slot, PyObject *tok, double t0)
{
    PySink *p = (PySink *)s;
    if (batch_add(&p->fin, tok, t0) < 0)
        keep_error(&p->et, &p->ev, &p->etb);
}

/*
 * drain(now, on_done, on_start=None). Every entry is applied in C first (apply_entries);
 * then, after the batch, on_start(token) for each launch whose first block was reported
 * (only if on_start is given) and on_done(token, t_first) for each finished launch, in
 * order. A Python error there does not stop the others: what the GPU did is recorded
 * and every launch is reported; the first error is raised at the end.
 */
static PyObject *Tracker_drain(Tracker *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "drain(now, on_done, on_start=None) takes 2 or 3 "
                        "arguments");
        return NULL;
    }
    if (!ready(self))
        return NULL;
    if (!self->ring[self->head & self->mask])
        return PyLong_FromLong(0);
    double now = PyFloat_AsDouble(args[0]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *on_done = args[1];
    PyObject *on_start = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    PySink sink = {.base = {on_start != NULL ? py_start : NULL, py_done},
                   .fin = {.n = 0, .more = NULL}, .started = {.n = 0, .more = NULL}};
    uint64_t bad = 0;
    const char *why = NULL;
    int64_t consumed = apply_entries(self, now, &sink.base, &bad, &why);
    /* Starts, then completions, in order, even after a bad entry: they did happen. */
    batch_report(&sink.started, on_start, 0, &sink.et, &sink.ev, &sink.etb);
    batch_report(&sink.fin, on_done, 1, &sink.et, &sink.ev, &sink.etb);
    if (sink.et != NULL) {
        PyErr_Restore(sink.et, sink.ev, sink.etb);
        return NULL;
    }
    if (bad)
        return bad_entry(self, bad, why);
    return PyLong_FromLongLong(consumed);
}

/* -- the C API (capi.h) ----------------------------------------------------------------- */
static int api_check(PyObject *t)
{
    if (!PyObject_TypeCheck(t, &TrackerType)) {
        PyErr_Format(PyExc_TypeError, "expected a Tracker, got %.100s", Py_TYPE(t)->tp_name);
        return -1;
    }
    return ready((Tracker *)t) ? 0 : -1;
}

static int api_admits(PyObject *t, const PaellaDemand *d, const PaellaDemand *pred)
{
    return admits_raw((Tracker *)t, d, pred);
}

static int api_admits_behind(PyObject *t, const PaellaDemand *d, const PaellaDemand *pred,
                             long long pred_lid)
{
    return admits_behind((Tracker *)t, d, pred, pred_lid);
}

static int api_flow_ok(PyObject *t, long long entries)
{
    return flow_ok((Tracker *)t, entries);
}

static int api_fits(PyObject *t, const PaellaDemand *d, int whole)
{
    return fits_raw((Tracker *)t, d, whole);
}

static long long api_release(PyObject *t, const PaellaDemand *d, PyObject *tok)
{
    return release_raw((Tracker *)t, d, tok);
}

static long long api_release_behind(PyObject *t, const PaellaDemand *d, PyObject *tok,
                                    long long behind)
{
    return release_behind_raw((Tracker *)t, d, tok, behind);
}

static int api_unrelease(PyObject *t, long long lid)
{
    PyObject *arg = PyLong_FromLongLong(lid);
    if (arg == NULL)
        return -1;
    PyObject *r = Tracker_unrelease((Tracker *)t, arg);
    Py_DECREF(arg);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

typedef struct {
    DrainSink base;
    paella_done_fn fn;
    void *ctx;
} CSink;

static void c_done(DrainSink *s, int slot, PyObject *tok, double t0)
{
    CSink *c = (CSink *)s;
    c->fn(c->ctx, slot, tok, t0);
    Py_DECREF(tok);
}

static long long api_drain(PyObject *t, double now, paella_done_fn done, void *ctx)
{
    Tracker *self = (Tracker *)t;
    if (!self->ring[self->head & self->mask])
        return 0;
    CSink sink = {.base = {NULL, c_done}, .fn = done, .ctx = ctx};
    uint64_t bad = 0;
    const char *why = NULL;
    int64_t consumed = apply_entries(self, now, &sink.base, &bad, &why);
    if (bad) {
        bad_entry(self, bad, why);
        return -1;
    }
    return consumed;
}

static int api_pairs(PyObject *t)
{
    return ((Tracker *)t)->npairs;
}

static PaellaTrackerAPI tracker_api = {
    api_check, api_admits, api_flow_ok, api_fits, api_release, api_unrelease, api_drain,
    api_pairs, api_admits_behind, api_release_behind,
};

/* -- inspection ------------------------------------------------------------------------ */
static PyObject *Tracker_in_flight(Tracker *self, PyObject *unused)
{
    return PyLong_FromLong(self->npairs - self->free_count);
}

static PyObject *Tracker_tokens_in_flight(Tracker *self, PyObject *unused)
{
    if (!ready(self))
        return NULL;
    PyObject *out = PyDict_New();
    for (int i = 0; out != NULL && i < self->npairs; i++) {
        if (self->tok[i] == NULL)
            continue;
        PyObject *k = PyLong_FromLongLong(self->lid[i]);
        if (k == NULL || PyDict_SetItem(out, k, self->tok[i]) < 0)
            Py_CLEAR(out);
        Py_XDECREF(k);
    }
    return out;
}

static PyObject *Tracker_progress(Tracker *self, PyObject *arg)
{
    if (!ready(self))
        return NULL;
    int slot = slot_of(self, arg, "progress");
    if (slot < 0)
        return NULL;
    return Py_BuildValue("(LLd)", (long long)self->placed[slot], (long long)self->ended[slot],
                         self->t_first[slot]);
}

static PyObject *Tracker_sm_usage(Tracker *self, PyObject *arg)
{
    long r = PyLong_AsLong(arg);
    if (r == -1 && PyErr_Occurred())
        return NULL;
    if (r < 0 || r > 3) {
        PyErr_SetString(PyExc_ValueError, "resource index must be 0..3 (blocks, warps, "
                        "registers, shared memory)");
        return NULL;
    }
    PyObject *out = PyList_New(self->nsm);
    for (int i = 0; out != NULL && i < self->nsm; i++) {
        PyObject *v = PyLong_FromLongLong(self->sm[4 * i + r]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
    return out;
}

#define GETTER(name, expr) \
    static PyObject *get_##name(Tracker *self, void *c) { return PyLong_FromLongLong(expr); }
GETTER(head, self->head)
GETTER(slots, self->nslots)
GETTER(mask, self->mask)
GETTER(group, self->group)
GETTER(extra_blocks, self->extra_blocks)
GETTER(blocks, self->used[B])
GETTER(warps, self->used[W])
GETTER(regs, self->used[R])
GETTER(smem, self->used[S])
GETTER(unplaced, self->demand[B])
GETTER(deferred, self->deferred)
GETTER(d_warps, self->demand[W])
GETTER(d_regs, self->demand[R])
GETTER(d_smem, self->demand[S])
GETTER(pending_entries, self->reserved - self->head)

static PyObject *get_cap(Tracker *self, void *c)
{
    return Py_BuildValue("(LLLL)", (long long)self->cap[0], (long long)self->cap[1],
                         (long long)self->cap[2], (long long)self->cap[3]);
}

static PyObject *get_ring(Tracker *self, void *c)
{
    if (!ready(self))
        return NULL;
    return Py_NewRef(self->ring_obj);
}

static int set_extra_blocks(Tracker *self, PyObject *v, void *c)
{
    long long b = v == NULL ? -1 : PyLong_AsLongLong(v);
    if (b == -1 && PyErr_Occurred())
        return -1;
    if (b < 0) {
        PyErr_SetString(PyExc_ValueError, "extra_blocks (B) must be an int >= 0");
        return -1;
    }
    self->extra_blocks = b;
    return 0;
}

static PyGetSetDef Tracker_getset[] = {
    {"head", (getter)get_head, NULL, "notifQ entries consumed so far (the read index)"},
    {"slots", (getter)get_slots, NULL, "notifQ slots"},
    {"mask", (getter)get_mask, NULL, "slots - 1"},
    {"group", (getter)get_group, NULL, "blocks per notification"},
    {"extra_blocks", (getter)get_extra_blocks, (setter)set_extra_blocks, "B of the +B rule"},
    {"blocks", (getter)get_blocks, NULL, "resident blocks"},
    {"warps", (getter)get_warps, NULL, "resident warps"},
    {"regs", (getter)get_regs, NULL, "resident registers"},
    {"smem", (getter)get_smem, NULL, "resident shared memory (bytes)"},
    {"unplaced", (getter)get_unplaced, NULL, "blocks released, not yet placed (deferred "
     "ones excluded)"},
    {"deferred", (getter)get_deferred, NULL, "blocks released behind a running kernel of "
     "their stream, not counted as unplaced until it ends"},
    {"d_warps", (getter)get_d_warps, NULL, "warps released, not yet placed"},
    {"d_regs", (getter)get_d_regs, NULL, "registers released, not yet placed"},
    {"d_smem", (getter)get_d_smem, NULL, "shared memory released, not yet placed"},
    {"pending_entries", (getter)get_pending_entries, NULL,
     "notifQ entries the launches in flight may still post (flow control)"},
    {"cap", (getter)get_cap, NULL, "the GPU's capacity: (blocks, warps, regs, smem)"},
    {"ring", (getter)get_ring, NULL, "the notifQ array"},
    {NULL}
};

static PyMethodDef Tracker_methods[] = {
    {"drain", (PyCFunction)(void (*)(void))Tracker_drain, METH_FASTCALL,
     "drain(now, on_done, on_start=None) -> entries consumed; on_start(token) per launch "
     "whose first block was placed, then on_done(token, t_first) per finished launch"},
    {"admits", (PyCFunction)Tracker_admits, METH_O, "admits(demand): +B rule, flow control"},
    {"admits_after", (PyCFunction)(void (*)(void))Tracker_admits_after, METH_FASTCALL,
     "admits_after(demand, pred): the +B rule once the same-stream launch pred has ended"},
    {"flow_ok", (PyCFunction)Tracker_flow_ok, METH_O,
     "flow_ok(demand): may it launch without a notifQ overrun?"},
    {"starts_now", (PyCFunction)Tracker_starts_now, METH_O,
     "starts_now(demand): would one block be placed at once if released now?"},
    {"fits_now", (PyCFunction)Tracker_fits_now, METH_O,
     "fits_now(demand): would all its blocks fit in what is free after the unplaced ones?"},
    {"release", (PyCFunction)(void (*)(void))Tracker_release, METH_FASTCALL,
     "release(demand, token) -> launch id: account for launching it"},
    {"unrelease", (PyCFunction)Tracker_unrelease, METH_O,
     "unrelease(launch_id): undo release() (a launch the device refused)"},
    {"progress", (PyCFunction)Tracker_progress, METH_O,
     "progress(launch_id) -> (placed, ended, t_first) of a launch in flight"},
    {"in_flight", (PyCFunction)Tracker_in_flight, METH_NOARGS, "launches in flight"},
    {"tokens_in_flight", (PyCFunction)Tracker_tokens_in_flight, METH_NOARGS,
     "{launch id: token} of the launches in flight (a snapshot)"},
    {"_sm_usage", (PyCFunction)Tracker_sm_usage, METH_O, "per-SM usage of one resource"},
    {NULL}
};

static PyTypeObject TrackerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher._tracker.TrackerCore",
    .tp_basicsize = sizeof(Tracker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The occupancy tracker's per-kernel work (see paella.dispatcher.tracker).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tracker_init,
    .tp_dealloc = (destructor)Tracker_dealloc,
    .tp_traverse = (traverseproc)Tracker_traverse,
    .tp_clear = (inquiry)Tracker_clear,
    .tp_methods = Tracker_methods,
    .tp_getset = Tracker_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paella.dispatcher._tracker",
    "C half of the occupancy tracker (paella.dispatcher.tracker).", -1, NULL,
};

PyMODINIT_FUNC PyInit__tracker(void)
{
    if (PyType_Ready(&DemandType) < 0 || PyType_Ready(&TrackerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *api = PyCapsule_New(&tracker_api, PAELLA_TRACKER_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(m, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "TrackerCore", (PyObject *)&TrackerType) < 0 ||
        PyModule_AddObjectRef(m, "Demand", (PyObject *)&DemandType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
