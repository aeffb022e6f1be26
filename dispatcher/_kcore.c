/*
 * The kernel core in C (paella.dispatcher.kernel_core is the reference, and the contract:
 * read it first). Everything per kernel happens here on plain arrays: the notifQ drain
 * (through the tracker's C API), each job's compiled plan run, the SRPT estimates and the
 * model statistics, the built-in policies on indexed heaps, the +B rule, the stream map
 * and the launch into the simulated engine (through the engine's C API). Python objects
 * appear only at the edges: a job's token (handed back in events), its copies' host
 * arrays and a kernel's arguments (for the device's own calls, once per request).
 *
 * Equivalence with the reference is tested event for event (tests/dispatcher/
 * test_kernel_core.py), so every rule below is written in the reference's order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <dlfcn.h>

#include "capi.h"

enum { KERNEL = 0, H2D = 1, D2H = 2, MARKER = 3 };
enum { WAITING = 0, READY = 1, RELEASED = 2, DONE = 3, DROPPED = 4,
       IMPLIED = 5 /* a copy released with no event (Plan.implied, launch_copy) */ };
enum { EV_ALMOST = 1, EV_FINISHED = 2, EV_REFUSED = 3, EV_FAULT = 4,
       EV_OP_RELEASED = 5, EV_OP_ENDED = 6,     /* op events: only while `ops` is set */
       EV_OP_HELD = 7 };                        /* (kind, None, queued, t): a hold */
enum { P_PAELLA, P_SJF, P_RR, P_PRIORITY, P_MSKBK, P_FIFO, P_MSJBJ };
enum { M_POOL, M_STICKY, M_SINGLE };

static const char *policy_names[] = {"paella", "sjf", "rr", "priority", "ms-kbk", "fifo",
                                     "ms-jbj", NULL};

static PaellaTrackerAPI *TAPI;
static PaellaEngineAPI *EAPI;
/* The empty tuple (a pass that changed something and has nothing to report), held
   here: most passes return it, and PyTuple_New(0) is a call each time. */
static PyObject *EMPTY;

#define REBASE 1e9
/* Priority classes first, in every policy: a heap key is class * CLASS_SPAN + the
   policy's own key (whole nanoseconds, a sequence number, a turn), capped below
   CLASS_SPAN. 2^45 (about 9.8 hours of nanoseconds) leaves 8 bits for the class (1..255)
   below 2^53: the sum is an exact integer in a double, so classes and keys order
   lexicographically, exactly (kernel_core.class_key is the same). */
#define CLASS_SPAN 35184372088832.0

/* ===================================================================================== */
/* Indexed min-heap over small integer ids, keyed by (double key, int64 tie).            */
typedef struct {
    int32_t *h, *pos;            /* heap of ids; pos[id]: its index, or -1 */
    double *key;
    int64_t *tie;
    int n, cap;                  /* cap: ids 0..cap-1 */
} IHeap;

static int ih_reserve(IHeap *q, int ids)
{
    if (ids <= q->cap)
        return 0;
    int cap = q->cap ? q->cap : 16;
    while (cap < ids)
        cap *= 2;
    int32_t *h = PyMem_Realloc(q->h, cap * sizeof(int32_t));
    if (h == NULL)
        return -1;
    q->h = h;
    int32_t *pos = PyMem_Realloc(q->pos, cap * sizeof(int32_t));
    if (pos == NULL)
        return -1;
    q->pos = pos;
    double *key = PyMem_Realloc(q->key, cap * sizeof(double));
    if (key == NULL)
        return -1;
    q->key = key;
    int64_t *tie = PyMem_Realloc(q->tie, cap * sizeof(int64_t));
    if (tie == NULL)
        return -1;
    q->tie = tie;
    for (int i = q->cap; i < cap; i++)
        q->pos[i] = -1;
    q->cap = cap;
    return 0;
}

static void ih_free(IHeap *q)
{
    PyMem_Free(q->h);
    PyMem_Free(q->pos);
    PyMem_Free(q->key);
    PyMem_Free(q->tie);
    memset(q, 0, sizeof *q);
}

static inline int ih_less(IHeap *q, int32_t a, int32_t b)
{
    return q->key[a] < q->key[b] || (q->key[a] == q->key[b] && q->tie[a] < q->tie[b]);
}

static void ih_up(IHeap *q, int i)
{
    int32_t x = q->h[i];
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!ih_less(q, x, q->h[p]))
            break;
        q->h[i] = q->h[p];
        q->pos[q->h[i]] = i;
        i = p;
    }
    q->h[i] = x;
    q->pos[x] = i;
}

static void ih_down(IHeap *q, int i)
{
    int32_t x = q->h[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= q->n)
            break;
        if (c + 1 < q->n && ih_less(q, q->h[c + 1], q->h[c]))
            c++;
        if (!ih_less(q, q->h[c], x))
            break;
        q->h[i] = q->h[c];
        q->pos[q->h[i]] = i;
        i = c;
    }
    q->h[i] = x;
    q->pos[x] = i;
}

/* Insert id, or re-key it in place. The caller reserved room for id. */
static void ih_push(IHeap *q, int32_t id, double key, int64_t tie)
{
    int i = q->pos[id];
    q->key[id] = key;
    q->tie[id] = tie;
    if (i < 0) {
        i = q->n++;
        q->h[i] = id;
        q->pos[id] = i;
        ih_up(q, i);
    } else {
        ih_up(q, i);
        ih_down(q, q->pos[id]);
    }
}

static void ih_remove(IHeap *q, int32_t id)
{
    if (id >= q->cap)
        return;
    int i = q->pos[id];
    if (i < 0)
        return;
    q->pos[id] = -1;
    int32_t last = q->h[--q->n];
    if (i == q->n)
        return;
    q->h[i] = last;
    q->pos[last] = i;
    ih_up(q, i);
    ih_down(q, q->pos[last]);
}

static inline int32_t ih_top(IHeap *q) { return q->n ? q->h[0] : -1; }

/* A plain min-heap of (seq, id): paella's arrival-order fifo (lazy deletion). */
typedef struct {
    int64_t *seq;
    int32_t *id;
    int n, cap;
} Fifo;

static int fifo_push(Fifo *f, int64_t seq, int32_t id)
{
    if (f->n == f->cap) {
        int cap = f->cap ? 2 * f->cap : 16;
        int64_t *s = PyMem_Realloc(f->seq, cap * sizeof(int64_t));
        if (s == NULL)
            return -1;
        f->seq = s;
        int32_t *d = PyMem_Realloc(f->id, cap * sizeof(int32_t));
        if (d == NULL)
            return -1;
        f->id = d;
        f->cap = cap;
    }
    int i = f->n++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (f->seq[p] <= seq)
            break;
        f->seq[i] = f->seq[p];
        f->id[i] = f->id[p];
        i = p;
    }
    f->seq[i] = seq;
    f->id[i] = id;
    return 0;
}

static void fifo_sift_down(Fifo *f, int i)
{
    int64_t s = f->seq[i];
    int32_t d = f->id[i];
    for (;;) {
        int c = 2 * i + 1;
        if (c >= f->n)
            break;
        if (c + 1 < f->n && f->seq[c + 1] < f->seq[c])
            c++;
        if (f->seq[c] >= s)
            break;
        f->seq[i] = f->seq[c];
        f->id[i] = f->id[c];
        i = c;
    }
    f->seq[i] = s;
    f->id[i] = d;
}

static void fifo_pop(Fifo *f)
{
    f->n--;
    if (f->n) {
        f->seq[0] = f->seq[f->n];
        f->id[0] = f->id[f->n];
        fifo_sift_down(f, 0);
    }
}

static void fifo_free(Fifo *f)
{
    PyMem_Free(f->seq);
    PyMem_Free(f->id);
    memset(f, 0, sizeof *f);
}

/* ===================================================================================== */
/* What a real GPU's driver needs to launch one kernel (cuda: use_driver/cuda_kernels). */
typedef struct {
    uintptr_t fn;                /* CUfunction */
    unsigned grid[3], block[3], smem;
    int nparams, instrumented;   /* instrumented: the last two are (notifQ ptr, launch id) */
    int *size, *offset;          /* per parameter, into a packed value buffer */
    int bytes;
    char name[128];              /* the kernel's, for errors */
} CudaK;

typedef struct {
    PaellaDemand d;
    int key, shape, effect;
    double flops, nbytes, duration;
    PyObject *record;
    CudaK *cu;                   /* NULL: not launched through the driver */
} KSpec;

/* CUresult cuLaunchKernel(CUfunction, gx, gy, gz, bx, by, bz, smem, CUstream, void **params,
   void **extra): the driver's own signature (cuda.h). */
typedef int (*cu_launch_fn)(uintptr_t, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, uintptr_t, void **, void **);

typedef struct {
    int n, nv, nk, nready, pending0;
    uint8_t *kind, *pp0, *st0, *almost;
    uint8_t *implied;            /* per node: an input copy whose completion its stream
                                    successor tells (implied_copy); no event of its own */
    int32_t *succ, *dstart, *dep, *deps0, *ready, *kernel, *vstream, *pred;
    int64_t *io_start, *io_end;  /* copies: their bytes of the job's io buffer */
    int64_t io_need;             /* the largest io_end */
    KSpec *ks;
} Plan;

typedef struct {
    int nk, window;
    int64_t jobs;
    double *count, *time;
    int64_t *n_time;
    uint8_t *seen;
    int64_t total;
    int dirty;
} Prof;

typedef struct {
    double s;
    int nready, jobs;
    int64_t seq;
    Fifo ready;                  /* client mode */
    PyObject *key;               /* client mode: its client id */
} Unit;

typedef struct {
    PyObject *token, *args, *copies, *io;
    int64_t seq;
    Plan *plan;
    Prof *prof;
    int unit, level, pin, pending, on_device;
    int32_t *deps, *stream, *ahead, *tail, *real, *rq, *kcount;
    uint8_t *pp, *st, *cdone;
    int64_t *lid;
    /* direct copies (the engine's C API): per node, where the bytes go and come from */
    void **cdst;
    const void **csrc;
    int64_t *cbytes;
    int rq_head, rq_n;
    int64_t estimate, remaining;
    uint8_t in_policy, left_policy, almost_sent, finished, queued, infifo, failed, started;
    PyObject *client;
    /* The one block the arrays above live in, kept with the job's slot when the job ends:
       the next job in the slot reuses it (zeroed) if it is large enough. Speed (a trick,
       labelled): no allocation per job on the hot path (a calloc cost ~370 instructions
       per job). Freed with the core. */
    char *blk;
    size_t blk_bytes;
} Job;

typedef struct {
    int32_t job;
    int64_t seq;
    int32_t node;
    PyObject *event;             /* copy events only */
} Ref;

typedef struct {
    Ref *r;
    int head, n, cap;
} RefQ;

static int refq_push(RefQ *q, Ref x)
{
    if (q->n == q->cap) {
        int cap = q->cap ? 2 * q->cap : 8;
        Ref *r = PyMem_Malloc(cap * sizeof(Ref));
        if (r == NULL)
            return -1;
        for (int i = 0; i < q->n; i++)
            r[i] = q->r[(q->head + i) % q->cap];
        PyMem_Free(q->r);
        q->r = r;
        q->head = 0;
        q->cap = cap;
    }
    q->r[(q->head + q->n) % q->cap] = x;
    q->n++;
    return 0;
}

static inline Ref *refq_front(RefQ *q) { return &q->r[q->head]; }

static inline void refq_pop(RefQ *q)
{
    q->head = (q->head + 1) % q->cap;
    q->n--;
}

typedef struct {
    PyObject_HEAD
    PyObject *tracker, *device, *engine, *events, *err_cls, *lost_cls, *faults;
    PyObject *engine_given;      /* the engine (Py_None: none); engine is it or Py_None */
    PyObject *launch_checked, *memcpy_htod, *memcpy_dtoh, *record_event, *event_query;
    int policy, gated, mode, eager, lookahead, group, by_client, n_streams, npairs;
    int ops;                     /* report op events (an instrument listens to ops) */
    int held;                    /* a hold reported since the last release (EV_OP_HELD) */
    int64_t lead;
    double threshold, hold, now;
    /* plans and profiles, owned */
    Plan **plans;
    int nplans;
    Prof **profs;
    int nprofs;
    /* jobs: slots, reused */
    Job **jobs;
    int njobs_cap, nfree, *free_slots;
    int live, queued;
    int class0;                  /* the first job's class (-1: none yet) */
    int sat_at;                  /* saturated() past this many queued jobs: the backlog,
                                    INT_MAX once off (backlog 0, or a second class seen) */
    long long released;
    RefQ arrivals, copies;
    /* streams */
    int32_t *free_s, *busy;
    int free_head, free_n, rr_stream;
    RefQ *cev;                   /* per stream: its copies' events, oldest first */
    int32_t *cev_order;          /* streams with events, in the order they got one */
    int ncev;
    /* tracker slot -> the op released on it */
    int32_t *slot_job, *slot_node;
    /* policies */
    IHeap heap, inflight, dheap;
    Fifo fifo;
    int64_t turn, useq;
    Unit *units;
    int nunits_cap, *unit_free, nunit_free, nunits;
    PyObject *client_units;      /* client id -> unit index (client mode) */
    double G, share;
    int n_live;
    int *lvl, *lvl_count, nlvl;  /* priority: levels with kernels on the device; paella:
                                    levels of live jobs (the class rule) */
    int lvl_cap;                 /* their capacity: grown, never shrunk (no realloc per job) */
    int error;                   /* a Python error inside a drain callback */
    /* the real GPU's driver (use_driver): its launch, streams, notifQ region, counters */
    void *cu_lib;
    cu_launch_fn cu_launch;
    uintptr_t *cu_streams;
    uint64_t cu_region;
    uint32_t *cu_counters;
    int cu_counter_mask;
    unsigned char *cu_values;    /* one launch's parameter values (the driver copies them) */
    void **cu_params;
    int cu_cap;
    PyObject *cu_failed;         /* device.launch_failed(code, name): raises its error */
    long long progress;          /* things done: a driver's "did this step change anything" */
    long long device_calls;      /* the driver calls its launches and copies stand for */
    int meter;                   /* time the entry points (step, admit) into metered_ns */
    long long metered_ns, metered_calls;
    /* Speed (a trick, labelled): the copies' queues are looked at only when something can
       have changed there: a direct copy landed since the last look (the engine's
       callback counts it), or a queue holds a copy whose completion only a device event
       tells (polled every pass, as the reference does). Looking at every pass cost a
       multi-stream plan ~900 instructions per kernel (session 22). */
    long long landed, py_events;
    int realtime;                /* the engine follows the wall clock: sync before submitting */
    int implied_on;              /* implied_copies: Plan.implied copies record no event */
    const int *gates;            /* the engine's gates per stream (direct), else NULL */
    Py_buffer gates_view;        /* else the device's own counts (stream_gates: an int32
                                    array; the process simulator's), if it has them */
    double wall_t0, wall_speed;
} Core;

static PyObject *new_ref_tuple(int kind, PyObject *token, const char *reason, long n)
{
    /* (kind, token[, count | reason]), built by hand: Py_BuildValue parses its format
       string at every call (~500 instructions per event, two events per job) */
    PyObject *third = NULL;
    if (kind == EV_FINISHED)
        third = PyLong_FromLong(n);
    else if (reason != NULL)
        third = PyUnicode_FromString(reason);
    if (third == NULL && (kind == EV_FINISHED || reason != NULL))
        return NULL;
    PyObject *t = PyTuple_New(third != NULL ? 3 : 2);
    PyObject *k = t != NULL ? PyLong_FromLong(kind) : NULL;
    if (k == NULL) {
        Py_XDECREF(t);
        Py_XDECREF(third);
        return NULL;
    }
    PyTuple_SET_ITEM(t, 0, k);
    PyTuple_SET_ITEM(t, 1, Py_NewRef(token));
    if (third != NULL)
        PyTuple_SET_ITEM(t, 2, third);
    return t;
}

static int emit(Core *c, int kind, Job *j, const char *reason)
{
    if (c->events == NULL && (c->events = PyList_New(0)) == NULL)
        return -1;
    long n = 0;
    if (kind == EV_FINISHED)     /* the kernels it released (the metrics' count) */
        for (int k = 0; k < j->prof->nk; k++)
            n += j->kcount[k];
    PyObject *t = new_ref_tuple(kind, j->token, reason, n);
    if (t == NULL)
        return -1;
    int rc = PyList_Append(c->events, t);
    Py_DECREF(t);
    return rc;
}

/* An op event (only while c->ops): (EV_OP_RELEASED, token, node, stream, launch id, t)
   as it goes to its stream, (EV_OP_ENDED, token, node, t_started, t) as it completes;
   t_started < 0 for a copy (the core sees no copy start: it is the copy's release). */
static int emit_op(Core *c, int kind, Job *j, int i, double t0, double t1)
{
    if (c->events == NULL && (c->events = PyList_New(0)) == NULL)
        return -1;
    PyObject *t = kind == EV_OP_RELEASED
        ? Py_BuildValue("(iOiiLd)", kind, j->token, i, j->stream[i],
                        j->plan->kind[i] == KERNEL ? (long long)j->lid[i] : -1LL, t1)
        : Py_BuildValue("(iOidd)", kind, j->token, i, t0, t1);
    if (t == NULL)
        return -1;
    int rc = PyList_Append(c->events, t);
    Py_DECREF(t);
    return rc;
}

/* -- profiles (paella.dispatcher.profile's arithmetic, over kernel indices) ----------- */
static inline int64_t to_ns(double seconds) { return (int64_t)nearbyint(seconds * 1e9); }

static int64_t prof_total(Prof *p)
{
    if (p->dirty) {
        double s = 0.0;
        for (int i = 0; i < p->nk; i++)
            if (p->seen[i])
                s += p->count[i] * p->time[i];
        p->total = to_ns(s);
        p->dirty = 0;
    }
    return p->total;
}

static inline int64_t prof_charge(Prof *p, int i, int done_before)
{
    if (!p->seen[i])
        return 0;
    double left = p->count[i] - done_before;
    if (left <= 0.0)
        return 0;
    return to_ns((left > 1.0 ? 1.0 : left) * p->time[i]);
}

static inline void prof_kernel(Prof *p, int i, double seconds)
{
    p->seen[i] = 1;
    int64_t n = ++p->n_time[i];
    int64_t w = p->window;
    p->time[i] += (seconds - p->time[i]) / (double)(n < w ? n : w);
    p->dirty = 1;
}

static void prof_job(Prof *p, int32_t *counts)
{
    int64_t jobs = ++p->jobs;
    int64_t div = jobs < p->window ? jobs : p->window;
    for (int i = 0; i < p->nk; i++) {
        if (p->seen[i])
            p->count[i] += ((double)counts[i] - p->count[i]) / (double)div;
        else if (counts[i]) {
            p->seen[i] = 1;
            p->count[i] = (double)counts[i] / (double)div;
        }
    }
    p->dirty = 1;
}

/* -- streams -------------------------------------------------------------------------- */
/* `s`, or the next stream after it that holds no gate (the simulated device holding a
   kernel whose answer is still being computed): a new job, or a job's new virtual
   stream, goes there, not behind the held kernel (issue 37). Streams with gates are
   real time only; a core not launching into the engine sees none. It reads the
   engine's own counts (`gates`: no call per job). */
static inline int ungated(Core *c, int s)
{
    if (c->gates == NULL)
        return s;
    for (int k = 0; k < c->n_streams; k++) {
        int t = (s + k) % c->n_streams;
        if (!c->gates[t])
            return t;
    }
    return s;                    /* (every stream held: wait behind the first) */
}

/* Whether op i must wait before its release: it would take its job's first real stream
   (or, sticky, its virtual stream's) while every stream holds a gate, in the modes where
   jobs share streams (single, sticky). In real time the simulator puts a gate ahead of a
   kernel whose answer it asks for when the kernel reaches its stream's head (released
   ahead: an eager policy submits all of a job's work at its start), and such a gate can
   hold the stream for the whole computation of another client's answer. So a job goes
   only where no gate is, and waits for such a stream when there is none (with more jobs
   in flight than streams): waiting, it is released as soon as a job passes its gate;
   queued behind one, it would have waited for that answer (issue 37). Pool mode never
   shares a stream between jobs. One test per op once the job has its stream. */
static inline int must_wait(Core *c, Job *j, int i)
{
    if (c->gates == NULL || c->mode == M_POOL || (j->pin >= 0 && c->mode != M_SINGLE))
        return 0;
    if (j->real[c->mode == M_SINGLE ? 0 : j->plan->vstream[i]] >= 0)
        return 0;
    for (int t = 0; t < c->n_streams; t++)
        if (!c->gates[t])
            return 0;
    return 1;
}

/* The engine's gate counts, read by ungated (none without an engine, or from one with
   fewer streams than the core). */
static void bind_gates(Core *c)
{
    int n = 0;
    const int *g = c->engine != Py_None ? EAPI->stream_gates(c->engine, &n) : NULL;
    if (g == NULL && c->gates_view.obj != NULL) {
        g = (const int *)c->gates_view.buf;
        n = (int)(c->gates_view.len / (Py_ssize_t)sizeof(int));
    }
    c->gates = n >= c->n_streams ? g : NULL;
}

static int assign(Core *c, Job *j, int i, int behind)
{
    int s;
    if (j->pin >= 0 && c->mode != M_SINGLE)
        s = j->pin;
    else if (c->mode == M_POOL) {
        if (behind >= 0)
            s = j->stream[behind];
        else {
            s = c->free_s[c->free_head];
            c->free_head = (c->free_head + 1) % c->n_streams;
            c->free_n--;
        }
    } else if (c->mode == M_SINGLE) {
        s = j->real[0];          /* every op of a job on one stream: 0 unless held */
        if (s < 0)
            s = j->real[0] = ungated(c, 0);
    } else {
        int v = j->plan->vstream[i];
        s = j->real[v];
        if (s < 0) {
            s = j->real[v] = ungated(c, c->rr_stream);
            c->rr_stream = (s + 1) % c->n_streams;
        }
    }
    c->busy[s]++;
    j->stream[i] = s;
    return s;
}

static void stream_done(Core *c, int s)
{
    if (--c->busy[s] == 0 && c->mode == M_POOL) {
        c->free_s[(c->free_head + c->free_n) % c->n_streams] = s;
        c->free_n++;
    }
}

/* -- policies --------------------------------------------------------------------------- */
static int lvl_add(Core *c, int level, int n)
{
    for (int k = 0; k < c->nlvl; k++) {
        if (c->lvl[k] == level) {
            c->lvl_count[k] += n;
            if (c->lvl_count[k] == 0) {
                memmove(c->lvl + k, c->lvl + k + 1, (c->nlvl - k - 1) * sizeof(int));
                memmove(c->lvl_count + k, c->lvl_count + k + 1, (c->nlvl - k - 1) * sizeof(int));
                c->nlvl--;
            }
            return 0;
        }
    }
    if (c->nlvl == c->lvl_cap) {
        int cap = c->lvl_cap ? 2 * c->lvl_cap : 4;
        int *a = PyMem_Realloc(c->lvl, cap * sizeof(int));
        if (a == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->lvl = a;
        int *b = PyMem_Realloc(c->lvl_count, cap * sizeof(int));
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->lvl_count = b;
        c->lvl_cap = cap;
    }
    c->lvl[c->nlvl] = level;
    c->lvl_count[c->nlvl++] = n;
    return 0;
}

static int level_count(Core *c, Job *j, int n)
{
    j->on_device += n;
    return lvl_add(c, j->level, n);
}

static int new_unit(Core *c)
{
    int u;
    if (c->nunit_free)
        u = c->unit_free[--c->nunit_free];
    else {
        if (c->nunits == c->nunits_cap) {
            int cap = c->nunits_cap ? 2 * c->nunits_cap : 16;
            Unit *un = PyMem_Realloc(c->units, cap * sizeof(Unit));
            if (un == NULL)
                return -1;
            c->units = un;
            int *uf = PyMem_Realloc(c->unit_free, cap * sizeof(int));
            if (uf == NULL)
                return -1;
            c->unit_free = uf;
            c->nunits_cap = cap;
        }
        u = c->nunits++;
        memset(&c->units[u], 0, sizeof(Unit));
    }
    if (ih_reserve(&c->dheap, u + 1) < 0)
        return -1;
    Unit *un = &c->units[u];
    un->s = -c->G;
    un->nready = un->jobs = 0;
    un->seq = c->useq++;
    un->ready.n = 0;
    un->key = NULL;
    return u;
}

static int units_alive(Core *c)
{
    return c->by_client ? (int)PyDict_GET_SIZE(c->client_units) : c->n_live;
}

static int job_arrived(Core *c, int32_t id, Job *j)
{
    if (c->policy != P_PAELLA)
        return 0;
    int u = -1;
    if (c->by_client) {
        PyObject *v = PyDict_GetItemWithError(c->client_units, j->client);
        if (v == NULL && PyErr_Occurred())
            return -1;
        if (v != NULL)
            u = (int)PyLong_AsLong(v);
    }
    int created = u < 0;
    if (created) {
        u = new_unit(c);
        if (u < 0)
            return -1;
        if (c->by_client) {
            PyObject *iv = PyLong_FromLong(u);
            if (iv == NULL || PyDict_SetItem(c->client_units, j->client, iv) < 0) {
                Py_XDECREF(iv);
                return -1;
            }
            Py_DECREF(iv);
            c->units[u].key = Py_NewRef(j->client);
        }
    }
    c->units[u].jobs++;
    j->unit = u;
    c->n_live++;
    if (created)
        c->share = 1.0 / (double)units_alive(c);
    ih_push(&c->inflight, id, (double)j->remaining, j->seq);
    return lvl_add(c, j->level, 1);          /* live jobs per class: the class rule */
}

/* The most urgent class of a live job (paella: lvl counts live jobs per class). */
static inline int top_level(Core *c)
{
    int top = c->nlvl ? c->lvl[0] : 0;
    for (int k = 1; k < c->nlvl; k++)
        if (c->lvl[k] < top)
            top = c->lvl[k];
    return top;
}

static int compact(Core *c, Fifo *f)
{
    int k = 0;
    for (int i = 0; i < f->n; i++) {
        Job *j = c->jobs[f->id[i]];
        if (j != NULL && j->seq == f->seq[i] && !j->finished && j->queued) {
            f->seq[k] = f->seq[i];
            f->id[k++] = f->id[i];
        } else if (j != NULL && j->seq == f->seq[i])
            j->infifo = 0;
    }
    f->n = k;
    for (int i = k / 2 - 1; i >= 0; i--)
        fifo_sift_down(f, i);
    return 0;
}

static inline double ckey(const Job *j, double x)
{
    return (double)j->level * CLASS_SPAN + (x < CLASS_SPAN ? x : CLASS_SPAN - 1.0);
}

static int kernel_ready(Core *c, int32_t id, Job *j)
{
    switch (c->policy) {
    case P_FIFO: case P_MSJBJ: case P_MSKBK:
        ih_push(&c->heap, id, ckey(j, (double)j->seq), 0);
        return 0;
    case P_SJF:
        ih_push(&c->heap, id, ckey(j, (double)j->estimate), j->seq);
        return 0;
    case P_RR:
        ih_push(&c->heap, id, ckey(j, (double)c->turn++), 0);
        return 0;
    case P_PRIORITY:
        ih_push(&c->heap, id, ckey(j, (double)j->remaining), j->seq);
        return 0;
    }
    j->queued = 1;
    ih_push(&c->heap, id, ckey(j, (double)j->remaining), j->seq);
    Unit *u = &c->units[j->unit];
    if (!j->infifo) {
        j->infifo = 1;
        Fifo *f = c->by_client ? &u->ready : &c->fifo;
        if (fifo_push(f, j->seq, id) < 0)
            return -1;
        if (f->n > 2 * c->n_live + 64)
            compact(c, f);
    }
    if (++u->nready == 1)
        ih_push(&c->dheap, j->unit, -u->s, u->seq);
    return 0;
}

static int32_t oldest(Core *c, Fifo *f)
{
    while (f->n) {
        int32_t id = f->id[0];
        Job *j = c->jobs[id];
        if (j != NULL && j->seq == f->seq[0] && !j->finished) {
            if (j->queued)
                return id;
            j->infifo = 0;
        }
        fifo_pop(f);
    }
    PyErr_SetString(PyExc_AssertionError, "a unit counted as ready has no ready job");
    return -2;
}

/* The saturation rule (docs/dispatcher.md, "Saturation"): with more jobs waiting for a
   release than `backlog`, their latency is queueing that only the GPU's throughput
   shortens, so the occupancy gate (the +B rule, paella's order and hold rules) is
   lifted and only flow control applies: the hardware queues stay full. Only while every
   job admitted so far was of one class: a more urgent class's bounded wait needs the
   gate (a flood of less urgent blocks in the hardware queues would delay its kernels). */
static inline int saturated(const Core *c)
{
    return c->queued > c->sat_at;       /* Speed: one compare (sat_at folds the rest) */
}

/* The job whose next kernel goes, -1 for none, -2 on error (`sat`: saturated()). */
static int32_t pick(Core *c, int sat)
{
    if (c->policy != P_PAELLA) {
        int32_t id = ih_top(&c->heap);
        if (c->policy == P_PRIORITY && id >= 0 && c->nlvl) {
            int level = c->jobs[id]->level;
            for (int k = 0; k < c->nlvl; k++)
                if (c->lvl[k] < level)
                    return -1;
        }
        return id;
    }
    int32_t u = ih_top(&c->dheap);
    if (u >= 0 && c->G - c->dheap.key[u] >= c->threshold) {
        /* Deficits act within the most urgent class waiting: a starved unit whose oldest
           ready job is of a less urgent class waits for that class to drain. */
        int32_t f = oldest(c, c->by_client ? &c->units[u].ready : &c->fifo);
        int32_t top = ih_top(&c->heap);
        if (f < 0 || top < 0 || c->jobs[f]->level <= c->jobs[top]->level)
            return f;
    }
    int32_t id = ih_top(&c->heap);
    if (id < 0)
        return -1;
    Job *j = c->jobs[id];
    Plan *p = j->plan;
    KSpec *k = &p->ks[p->kernel[j->rq[j->rq_head]]];
    /* The class rule: while a job of a more urgent class is live, no kernel of a less
       urgent one goes (blocks are not preempted: one would delay that job's next kernel,
       and share its SMs while it runs). Slicing bounds the wait for what already runs. */
    if (c->nlvl > 1 && top_level(c) < j->level)
        return -1;
    int32_t other = ih_top(&c->inflight);
    if (other == id)
        return id;
    if (sat)
        return id;
    if (!TAPI->fits(c->tracker, &k->d, 0))
        return -1;
    if (c->hold <= 0.0 || !(c->inflight.key[other] < (double)j->remaining)
            || c->jobs[other]->level > j->level)    /* (no hold for a less urgent class) */
        return id;
    Prof *pr = j->prof;
    if (pr->seen[k->key] && pr->time[k->key] * 1e9 > c->hold * (double)c->jobs[other]->estimate
            && !TAPI->fits(c->tracker, &k->d, 1))
        return -1;
    return id;
}

static int released(Core *c, int32_t id, Job *j)
{
    ih_remove(&c->heap, id);
    if (c->policy == P_PRIORITY)
        return level_count(c, j, 1);
    if (c->policy != P_PAELLA)
        return 0;
    j->queued = 0;
    Unit *u = &c->units[j->unit];
    if (--u->nready == 0)
        ih_remove(&c->dheap, j->unit);
    ih_push(&c->inflight, id, (double)j->remaining, j->seq);
    c->G += c->share;
    u->s -= 1.0;
    if (u->nready)
        ih_push(&c->dheap, j->unit, -u->s, u->seq);
    if (c->G > REBASE) {
        double g = c->G;
        c->G = 0.0;
        for (int k = 0; k < c->nunits; k++)
            c->units[k].s += g;
        for (int k = 0; k < c->dheap.n; k++)
            c->dheap.key[c->dheap.h[k]] -= g;
    }
    return 0;
}

static int job_finished(Core *c, int32_t id, Job *j)
{
    ih_remove(&c->heap, id);
    if (c->policy == P_PRIORITY)
        return j->on_device ? level_count(c, j, -j->on_device) : 0;
    if (c->policy != P_PAELLA)
        return 0;
    Unit *u = &c->units[j->unit];
    if (j->queued) {
        j->queued = 0;
        if (--u->nready == 0)
            ih_remove(&c->dheap, j->unit);
    }
    ih_remove(&c->inflight, id);
    c->n_live--;
    if (lvl_add(c, j->level, -1) < 0)
        return -1;
    if (--u->jobs == 0) {
        if (c->by_client) {
            if (PyDict_DelItem(c->client_units, u->key) < 0)
                return -1;
            Py_CLEAR(u->key);
        }
        u->ready.n = 0;
        c->unit_free[c->nunit_free++] = j->unit;
        int n = units_alive(c);
        if (n)
            c->share = 1.0 / (double)n;
    }
    return 0;
}

/* ===================================================================================== */
/* The plan walk and the job lifecycle.                                                    */
static int queue_job(Core *c, int32_t id, Job *j)
{
    j->in_policy = 1;
    c->queued++;
    return kernel_ready(c, id, j);
}

static int active(Core *c, int32_t id, Job *j, int i)
{
    j->st[i] = READY;
    if (j->plan->kind[i] == KERNEL) {
        j->rq[(j->rq_head + j->rq_n++) % j->plan->n] = i;
        if (!j->in_policy)
            return queue_job(c, id, j);
        return 0;
    }
    Ref r = {id, j->seq, i, NULL};
    return refq_push(&c->copies, r);
}

static int met(Core *c, int32_t id, Job *j, int t, int32_t *stack, int *top)
{
    if (--j->deps[t] != 0 || j->st[t] != WAITING)
        return 0;
    if (j->plan->kind[t] == MARKER) {
        j->st[t] = DONE;
        j->pending--;
        stack[(*top)++] = t;
        return 0;
    }
    return active(c, id, j, t);
}

static int finish_node(Core *c, int32_t id, Job *j, int i)
{
    Plan *p = j->plan;
    j->st[i] = DONE;
    j->pending--;
    int32_t stack_small[64];
    int32_t *stack = p->n <= 64 ? stack_small : PyMem_Malloc(p->n * sizeof(int32_t));
    if (stack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int top = 0, rc = 0;
    stack[top++] = i;
    while (top && rc == 0) {
        int d = stack[--top];
        int s = p->succ[d];
        if (s >= 0 && j->pp[s]) {
            j->pp[s] = 0;
            rc = met(c, id, j, s, stack, &top);
        }
        for (int k = p->dstart[d]; k < p->dstart[d + 1] && rc == 0; k++)
            rc = met(c, id, j, p->dep[k], stack, &top);
    }
    if (stack != stack_small)
        PyMem_Free(stack);
    return rc;
}

static int release_succ(Core *c, int32_t id, Job *j, int i)
{
    Plan *p = j->plan;
    int s = p->succ[i];
    if (s < 0 || !j->pp[s] || p->kind[s] == MARKER)
        return 0;
    j->pp[s] = 0;
    if (--j->deps[s] == 0 && j->st[s] == WAITING)
        return active(c, id, j, s);
    return 0;
}

static inline int behind_of(Core *c, Job *j, int i)
{
    int p = j->plan->pred[i];
    if (p >= 0 && ((j->st[p] == RELEASED && c->lookahead > 1) || j->st[p] == IMPLIED))
        return p;
    return -1;
}

static int almost(Core *c, Job *j)
{
    if (j->almost_sent)
        return 0;
    j->almost_sent = 1;
    return emit(c, EV_ALMOST, j, NULL);
}

static int withdraw(Core *c, int32_t id, Job *j)
{
    if (j->left_policy)
        return 0;
    j->left_policy = 1;
    if (j->in_policy)
        c->queued--;
    j->in_policy = 0;
    return j->started ? job_finished(c, id, j) : 0;   /* (aborted before it started) */
}

static int orphan_before(Core *c, int32_t id, Job *j, int n);

static int fail_job(Core *c, int32_t id, Job *j, int kind, const char *reason)
{
    j->failed = 1;
    if (kind && emit(c, kind, j, reason) < 0)   /* kind 0: aborted, nothing to say */
        return -1;
    for (int n = 0; n < j->plan->n; n++) {
        if (j->st[n] == WAITING || j->st[n] == READY) {
            j->st[n] = DROPPED;
            j->pending--;
            if (orphan_before(c, id, j, n) < 0)
                return -1;
        }
    }
    j->rq_n = 0;
    return withdraw(c, id, j);
}

static void free_job_arrays(Job *j)
{
    j->deps = NULL;              /* its block stays with the slot: see Job.blk */
    Py_CLEAR(j->token);
    Py_CLEAR(j->args);
    Py_CLEAR(j->copies);
    Py_CLEAR(j->io);
    Py_CLEAR(j->client);
}

static int finish_job(Core *c, int32_t id, Job *j)
{
    j->finished = 1;
    c->live--;
    if (!j->failed) {
        prof_job(j->prof, j->kcount);
        if (almost(c, j) < 0)
            return -1;
    }
    if (withdraw(c, id, j) < 0 || emit(c, EV_FINISHED, j, NULL) < 0)
        return -1;
    free_job_arrays(j);
    c->free_slots[c->nfree++] = id;
    return 0;
}

/* The job in slot `id` if it is still the one with this seq (stale refs are skipped). */
static inline Job *job_of(Core *c, int32_t id, int64_t seq)
{
    Job *j = c->jobs[id];
    return j != NULL && j->seq == seq && !j->finished ? j : NULL;
}

static int op_done(Core *c, int32_t id, Job *j, int i)
{
    stream_done(c, j->stream[i]);
    if (finish_node(c, id, j, i) < 0)
        return -1;
    Plan *p = j->plan;
    if (c->lookahead > 1 && p->kind[i] == KERNEL && !c->eager) {
        int v = p->vstream[i];
        j->ahead[v]--;
        int tail = j->tail[v];
        if (tail == i)
            j->tail[v] = -1;
        else if (tail >= 0 && j->st[tail] == RELEASED && release_succ(c, id, j, tail) < 0)
            return -1;
    }
    if (j->pending == 0 && !j->finished)
        return finish_job(c, id, j);
    return 0;
}

/* The implied copies just ahead of node i on its stream (Plan.implied): done, oldest
   first, now that i is seen done (a kernel's last block, a copy's event). Stream order
   says they completed before i started. */
static int implied_done(Core *c, int32_t id, Job *j, int i)
{
    Plan *p = j->plan;
    int first = -1;
    for (int q = p->pred[i]; q >= 0 && j->st[q] == IMPLIED; q = p->pred[q])
        first = q;
    while (first >= 0 && first != i) {
        int next = p->succ[first];
        c->progress++;
        if (c->ops && emit_op(c, EV_OP_ENDED, j, first, -1.0, c->now) < 0)
            return -1;
        if (op_done(c, id, j, first) < 0)
            return -1;
        first = next;
    }
    return 0;
}

/* Copy i's completion is told by the device event `ev` (a new reference, taken over),
   or, ev NULL, by the engine's landing flag (a direct copy: copy_landed). */
static inline int push_event(Core *c, int s, int32_t id, Job *j, int i, PyObject *ev)
{
    if (c->cev[s].n == 0)        /* a stream with no events yet goes last (a dict's order) */
        c->cev_order[c->ncev++] = s;
    Ref ref = {id, j->seq, i, ev};
    if (refq_push(&c->cev[s], ref) < 0) {
        Py_XDECREF(ev);
        return -1;
    }
    if (ev != NULL)
        c->py_events++;
    return 0;
}

/* Node n will not run (dropped, refused): an implied copy just ahead of it, released,
   has nothing left to tell its completion, so an event recorded behind it does (the two
   driver calls it had saved). */
static int orphan_before(Core *c, int32_t id, Job *j, int n)
{
    Plan *p = j->plan;
    int q = p->pred[n];
    if (q < 0 || p->succ[q] != n || j->st[q] != IMPLIED)
        return 0;
    int s = j->stream[q];
    PyObject *stream = PyLong_FromLong(s);
    if (stream == NULL)
        return -1;
    PyObject *ev = PyObject_CallOneArg(c->record_event, stream);
    Py_DECREF(stream);
    if (ev == NULL)
        return -1;
    c->device_calls += 2;
    return push_event(c, s, id, j, q, ev);
}

/* A device call raised: DeviceError (not DeviceLost) fails the job with its message
   (returns 1); anything else stays raised (returns -1). */
static int refused_reason(Core *c, char *buf, size_t n)
{
    if (!PyErr_ExceptionMatches(c->err_cls) || PyErr_ExceptionMatches(c->lost_cls))
        return -1;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *msg = v != NULL ? PyObject_Str(v) : NULL;
    const char *m = msg != NULL ? PyUnicode_AsUTF8(msg) : NULL;
    snprintf(buf, n, "%s: %s", ((PyTypeObject *)t)->tp_name, m != NULL ? m : "?");
    PyErr_Clear();
    Py_XDECREF(msg);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    return 1;
}

/* The engine's completion of a direct copy (inside its event processing: only a flag;
   the next step's poll_copies completes the op, in the reference's order). */
static void copy_landed(void *ctx, uint64_t tag)
{
    Core *c = ctx;
    c->jobs[tag >> 32]->cdone[(uint32_t)tag] = 1;
    c->landed++;
}

static int launch_copy(Core *c, int32_t id, Job *j, int i, int behind)
{
    int s = assign(c, j, i, behind);
    /* Implied (Plan.implied) while streams are not scarce: in pool mode an implied copy
       keeps its stream until its successor is seen done, and that successor waits for the
       policy, so at most half the pool goes to them; with all of it, jobs between two
       kernels waited for a free stream held by jobs the policy ranks after them (a
       deadlock, Figure 2 at 50k jobs/s with the CPU charged). */
    int imp = c->implied_on && j->plan->implied[i]
              && (c->mode != M_POOL || 2 * c->free_n >= c->n_streams);
    c->progress++;
    /* the copy, its event's record, the query that sees it; an implied copy: the copy */
    c->device_calls += imp ? 1 : 3;
    if (j->plan->almost[i] && almost(c, j) < 0)
        return -1;
    if (j->cdst[i] != NULL) {
        /* Direct: the engine moves the bytes at the copy's completion and flags it. */
        if (c->realtime && EAPI->sync_wall(c->engine, c->wall_t0, c->wall_speed) < 0)
            return -1;
        /* (an implied copy: nobody looks at its landing, so no flag, no look at the
           queues for it) */
        if (EAPI->copy(c->engine, j->plan->kind[i], s, j->cbytes[i], j->cdst[i], j->csrc[i],
                       imp ? NULL : copy_landed, c, ((uint64_t)id << 32) | (uint32_t)i) < 0)
            return -1;
        if (!imp && push_event(c, s, id, j, i, NULL) < 0)
            return -1;
        j->st[i] = imp ? IMPLIED : RELEASED;
        if (c->ops && emit_op(c, EV_OP_RELEASED, j, i, 0.0, c->now) < 0)
            return -1;
        if (c->eager || c->lookahead > 1 || imp)
            return release_succ(c, id, j, i);
        return 0;
    }
    PyObject *pair = PyTuple_GET_ITEM(j->copies, i);
    PyObject *dptr = PyTuple_GET_ITEM(pair, 0), *host = PyTuple_GET_ITEM(pair, 1);
    PyObject *view = host == Py_None
        ? PySequence_GetSlice(j->io, j->plan->io_start[i], j->plan->io_end[i]) : NULL;
    if (host == Py_None && (host = view) == NULL)
        return -1;
    PyObject *stream = PyLong_FromLong(s);
    if (stream == NULL) {
        Py_XDECREF(view);
        return -1;
    }
    PyObject *r = j->plan->kind[i] == H2D
        ? PyObject_CallFunctionObjArgs(c->memcpy_htod, dptr, host, stream, NULL)
        : PyObject_CallFunctionObjArgs(c->memcpy_dtoh, host, dptr, stream, NULL);
    PyObject *ev = r == NULL ? NULL
        : imp ? Py_NewRef(Py_None) : PyObject_CallOneArg(c->record_event, stream);
    Py_DECREF(stream);
    Py_XDECREF(view);
    Py_XDECREF(r);
    if (ev == NULL) {
        char reason[512];
        if (refused_reason(c, reason, sizeof reason) < 0)
            return -1;
        stream_done(c, s);
        if (orphan_before(c, id, j, i) < 0)
            return -1;
        j->st[i] = RELEASED;
        if (fail_job(c, id, j, EV_REFUSED, reason) < 0 || finish_node(c, id, j, i) < 0)
            return -1;
        return j->pending == 0 && !j->finished ? finish_job(c, id, j) : 0;
    }
    if (imp)
        Py_DECREF(ev);
    else if (push_event(c, s, id, j, i, ev) < 0)
        return -1;
    j->st[i] = imp ? IMPLIED : RELEASED;
    if (c->ops && emit_op(c, EV_OP_RELEASED, j, i, 0.0, c->now) < 0)
        return -1;
    if (c->eager || c->lookahead > 1 || imp)
        return release_succ(c, id, j, i);
    return 0;
}

static int flush_copies(Core *c)
{
    while (c->copies.n) {
        Ref *r = refq_front(&c->copies);
        Job *j = job_of(c, r->job, r->seq);
        if (j == NULL || j->st[r->node] == DROPPED) {
            refq_pop(&c->copies);
            continue;
        }
        int b = behind_of(c, j, r->node);
        if (b < 0 && c->mode == M_POOL && !c->free_n)
            return 0;
        if (b < 0 && must_wait(c, j, r->node))
            return 0;
        int32_t id = r->job;
        int node = r->node;
        refq_pop(&c->copies);
        if (launch_copy(c, id, j, node, b) < 0)
            return -1;
    }
    return 0;
}

static int poll_copies(Core *c)
{
    int k = 0;
    c->landed = 0;               /* (one that lands during this look is seen next pass) */
    while (k < c->ncev) {
        int s = c->cev_order[k];
        RefQ *q = &c->cev[s];
        while (q->n) {
            Ref *r = refq_front(q);
            int done;
            if (r->event == NULL)
                done = c->jobs[r->job]->cdone[r->node];
            else {
                PyObject *res = PyObject_CallOneArg(c->event_query, r->event);
                if (res == NULL)
                    return -1;
                done = PyObject_IsTrue(res);
                Py_DECREF(res);
                if (done < 0)
                    return -1;
            }
            if (!done)
                break;
            Ref x = *r;
            refq_pop(q);
            c->progress++;
            if (x.event != NULL) {
                c->py_events--;
                Py_DECREF(x.event);
            }
            Job *j = job_of(c, x.job, x.seq);
            int q = j != NULL ? j->plan->pred[x.node] : -1;
            if (q >= 0 && j->st[q] == IMPLIED && implied_done(c, x.job, j, x.node) < 0)
                return -1;
            if (j != NULL && c->ops && emit_op(c, EV_OP_ENDED, j, x.node, -1.0, c->now) < 0)
                return -1;
            if (j != NULL && op_done(c, x.job, j, x.node) < 0)
                return -1;
        }
        if (!q->n) {
            memmove(c->cev_order + k, c->cev_order + k + 1, (c->ncev - k - 1) * sizeof(int32_t));
            c->ncev--;
        } else
            k++;
    }
    return 0;
}

/* The tracker's drain callback: a kernel's last block completed. */
static void kernel_done(void *ctx, int slot, PyObject *tok, double t_first)
{
    Core *c = ctx;
    if (c->error)
        return;
    int32_t id = c->slot_job[slot];
    int i = c->slot_node[slot];
    Job *j = c->jobs[id];
    Plan *p = j->plan;
    KSpec *k = &p->ks[p->kernel[i]];
    int q = p->pred[i];
    if (q >= 0 && j->st[q] == IMPLIED && implied_done(c, id, j, i) < 0) {
        c->error = 1;
        return;
    }
    prof_kernel(j->prof, k->key, c->now - t_first);
    if (c->ops && emit_op(c, EV_OP_ENDED, j, i, t_first, c->now) < 0) {
        c->error = 1;
        return;
    }
    if (c->faults != NULL && PyDict_GET_SIZE(c->faults)) {
        PyObject *lid = PyLong_FromLongLong(j->lid[i]);
        PyObject *reason = lid != NULL ? PyDict_GetItemWithError(c->faults, lid) : NULL;
        if (reason != NULL) {
            Py_INCREF(reason);
            const char *m = PyUnicode_AsUTF8(reason);
            int rc = PyDict_DelItem(c->faults, lid);
            if (rc == 0 && !j->finished && !j->failed)
                rc = fail_job(c, id, j, EV_FAULT, m != NULL ? m : "kernel fault");
            Py_DECREF(reason);
            if (rc < 0)
                c->error = 1;
        } else if (PyErr_Occurred())
            c->error = 1;
        Py_XDECREF(lid);
        if (c->error)
            return;
    }
    if (c->policy == P_PRIORITY && j->on_device && level_count(c, j, -1) < 0) {
        c->error = 1;
        return;
    }
    if (op_done(c, id, j, i) < 0)
        c->error = 1;
}

/* One parameter's value into the packed buffer: an int (a device pointer, a count) in
   `size` little-endian bytes, a float as float32/float64, bytes as they are (the device's
   _ParamPack rules). 0, or -1 with TypeError/ValueError. */
static int pack_value(unsigned char *dst, int size, PyObject *v, const char *kname, int idx)
{
    if (PyLong_Check(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        unsigned long long ux = (unsigned long long)x;
        if (overflow > 0) {
            ux = PyLong_AsUnsignedLongLong(v);
            if (ux == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
        } else if (overflow < 0 || (x == -1 && PyErr_Occurred()))
            goto range;
        if (size < 8) {
            long long lo = -(1LL << (8 * size - 1));
            unsigned long long hi = (1ULL << (8 * size)) - 1;
            if ((overflow == 0 && x < lo) || (x >= 0 && ux > hi) || overflow > 0)
                goto range;
        } else if (size != 8)
            goto type;
        for (int b = 0; b < size; b++)
            dst[b] = (unsigned char)(ux >> (8 * b));
        return 0;
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        if (size == 8)
            memcpy(dst, &d, 8);
        else if (size == 4) {
            float f = (float)d;
            memcpy(dst, &f, 4);
        } else
            goto type;
        return 0;
    }
    if (PyBytes_Check(v) && PyBytes_GET_SIZE(v) == size) {
        memcpy(dst, PyBytes_AS_STRING(v), size);
        return 0;
    }
    if (PyObject_CheckBuffer(v)) {           /* a numpy scalar of the parameter's size (a
                                                plan's ScalarArg.typed(): np.uint32, ...) */
        Py_buffer b;
        if (PyObject_GetBuffer(v, &b, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            goto type;
        }
        int fits = b.len == size;
        if (fits)
            memcpy(dst, b.buf, size);
        PyBuffer_Release(&b);
        if (fits)
            return 0;
    }
type:
    PyErr_Format(PyExc_TypeError, "kernel %s parameter %d is %d bytes; a %.50s cannot fill it",
                 kname, idx, size, Py_TYPE(v)->tp_name);
    return -1;
range:
    PyErr_Format(PyExc_ValueError, "kernel %s parameter %d is %d bytes; the value does not fit",
                 kname, idx, size);
    return -1;
}

/* Launch through the driver's cuLaunchKernel (use_driver): the job's arguments packed
   as the compiled kernel's parameters, then, for an instrumented kernel, the notifQ
   region's device pointer and the launch id; its counter pair zeroed first. A driver
   error goes to device.launch_failed, which raises what the device's own path would. */
static int cuda_launch(Core *c, Job *j, int i, KSpec *k, int s, long long lid)
{
    CudaK *cu = k->cu;
    PyObject *args = j->args != NULL && j->args != Py_None ? PyTuple_GET_ITEM(j->args, i) : NULL;
    Py_ssize_t n = args != NULL && PyTuple_Check(args) ? PyTuple_GET_SIZE(args) : 0;
    int own = cu->nparams - (cu->instrumented ? 2 : 0);
    const char *kname = cu->name;
    if (n != own) {
        PyErr_Format(c->err_cls, "kernel %s takes %d argument(s) of its own, %zd given",
                     kname != NULL ? kname : "?", own, n);
        return -1;
    }
    unsigned char *vals = c->cu_values;
    for (int a = 0; a < own; a++)
        if (pack_value(vals + cu->offset[a], cu->size[a], PyTuple_GET_ITEM(args, a), kname, a) < 0)
            return -1;
    if (cu->instrumented) {
        uint64_t region = c->cu_region;
        uint32_t id = (uint32_t)lid;
        memcpy(vals + cu->offset[own], &region, 8);
        memcpy(vals + cu->offset[own + 1], &id, 4);
        uint32_t *ctr = c->cu_counters + 2 * (lid & c->cu_counter_mask);
        ctr[0] = ctr[1] = 0;
    }
    for (int a = 0; a < cu->nparams; a++)
        c->cu_params[a] = vals + cu->offset[a];
    int rc = c->cu_launch(cu->fn, cu->grid[0], cu->grid[1], cu->grid[2], cu->block[0],
                          cu->block[1], cu->block[2], cu->smem, c->cu_streams[s],
                          cu->nparams ? c->cu_params : NULL, NULL);
    if (rc == 0)
        return 0;
    PyObject *r = PyObject_CallFunction(c->cu_failed, "is", rc, kname != NULL ? kname : "?");
    if (r != NULL) {             /* it must raise; if it did not, say so */
        Py_DECREF(r);
        PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel returned %d", rc);
    }
    return -1;
}

static int launch_kernel(Core *c, int32_t id, Job *j, int i, KSpec *k, int s, long long lid)
{
    int rc;
    c->device_calls++;           /* cuLaunchKernel */
    if (k->cu != NULL && c->cu_launch != NULL) {
        rc = cuda_launch(c, j, i, k, s, lid);
    } else if (k->effect || c->engine == Py_None) {
        PyObject *args = j->args != NULL && j->args != Py_None ? PyTuple_GET_ITEM(j->args, i)
                                                                : NULL;
        PyObject *r = PyObject_CallFunction(c->launch_checked, "OiLOi", k->record, s, lid,
                                            args != NULL ? args : Py_None, c->group);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    } else {
        rc = c->realtime ? EAPI->sync_wall(c->engine, c->wall_t0, c->wall_speed) : 0;
        if (rc == 0)
            rc = EAPI->launch(c->engine, k->shape, k->d.blocks, k->flops, k->nbytes,
                              k->duration, s, (uint32_t)lid, 1, c->group);
    }
    if (rc == 0)
        return 1;
    char reason[512];
    if (refused_reason(c, reason, sizeof reason) < 0)
        return -1;
    if (TAPI->unrelease(c->tracker, lid) < 0)
        return -1;
    stream_done(c, s);
    if (orphan_before(c, id, j, i) < 0)
        return -1;
    j->st[i] = RELEASED;
    if (fail_job(c, id, j, EV_REFUSED, reason) < 0 || finish_node(c, id, j, i) < 0)
        return -1;
    if (j->pending == 0 && !j->finished && finish_job(c, id, j) < 0)
        return -1;
    return 0;
}

static int release_loop(Core *c)
{
    if (c->copies.n && flush_copies(c) < 0)
        return -1;
    int pool = c->mode == M_POOL;
    while (c->queued) {
        int sat = saturated(c);
        int32_t id = pick(c, sat);
        if (id == -2)
            return -1;
        if (id < 0) {
            if (c->ops && !c->held) {        /* the policy holds ready work back */
                c->held = 1;
                if (c->events == NULL && (c->events = PyList_New(0)) == NULL)
                    return -1;
                PyObject *t = Py_BuildValue("(iOid)", EV_OP_HELD, Py_None, c->queued, c->now);
                if (t == NULL || PyList_Append(c->events, t) < 0) {
                    Py_XDECREF(t);
                    return -1;
                }
                Py_DECREF(t);
            }
            return 0;
        }
        Job *j = c->jobs[id];
        Plan *p = j->plan;
        int i = j->rq[j->rq_head];
        KSpec *k = &p->ks[p->kernel[i]];
        int b = behind_of(c, j, i);
        int gated = c->gated && !sat;
        if (b >= 0 && gated && p->kind[b] == KERNEL) {
            if (!TAPI->admits_behind(c->tracker, &k->d, &p->ks[p->kernel[b]].d, j->lid[b]))
                return 0;
        } else if (!(gated ? TAPI->admits(c->tracker, &k->d, NULL)
                           : TAPI->flow_ok(c->tracker, k->d.entries)))
            return 0;
        else if (pool && !c->free_n && b < 0 && j->pin < 0)
            return 0;
        else if (!pool && b < 0 && must_wait(c, j, i))
            return 0;
        j->rq_head = (j->rq_head + 1) % p->n;
        j->rq_n--;
        j->in_policy = 0;
        c->queued--;
        int cnt = j->kcount[k->key];
        int64_t left = j->remaining = j->remaining - prof_charge(j->prof, k->key, cnt);
        j->kcount[k->key] = cnt + 1;
        if (released(c, id, j) < 0)
            return -1;
        int s = assign(c, j, i, b);
        long long lid = b >= 0 && p->kind[b] == KERNEL
            ? TAPI->release_behind(c->tracker, &k->d, Py_None, j->lid[b])
            : TAPI->release(c->tracker, &k->d, Py_None);
        if (lid < 0)
            return -1;
        int slot = (int)(lid & (c->npairs - 1));
        c->slot_job[slot] = id;
        c->slot_node[slot] = i;
        j->lid[i] = lid;
        c->released++;
        c->held = 0;
        c->progress++;
        int ok = launch_kernel(c, id, j, i, k, s, lid);
        if (ok < 0)
            return -1;
        if (ok) {
            /* (the wake-up first, as on the dispatcher's own path and for copies) */
            if ((p->almost[i] || (c->lead && left <= c->lead && !j->almost_sent
                                  && j->estimate > 0)) && almost(c, j) < 0)
                return -1;
            if (c->ops && emit_op(c, EV_OP_RELEASED, j, i, 0.0, c->now) < 0)
                return -1;
            j->st[i] = RELEASED;
            if (c->eager) {
                if (release_succ(c, id, j, i) < 0)
                    return -1;
            } else if (c->lookahead > 1) {
                int v = p->vstream[i];
                j->ahead[v]++;
                j->tail[v] = i;
                if (j->ahead[v] < c->lookahead && release_succ(c, id, j, i) < 0)
                    return -1;
            }
        }
        if (c->copies.n && flush_copies(c) < 0)
            return -1;
        if (j->rq_n && !j->in_policy && !j->finished && queue_job(c, id, j) < 0)
            return -1;
    }
    return 0;
}

/* -- admission -------------------------------------------------------------------------- */
static int init_job_arrays(Job *j, Plan *p, Prof *pr)
{
    /* One block: int32 arrays, then int64, then bytes. */
    size_t n = p->n, nv = p->nv, nk = pr->nk;
    size_t i32 = 3 * n + 3 * nv + nk;   /* deps, stream, rq; ahead, tail, real; kcount */
    size_t bytes = i32 * 4 + 8 + n * 8 * 4 + 3 * n + 8;
    char *mem = j->blk;
    if (mem != NULL && j->blk_bytes >= bytes)
        memset(mem, 0, bytes);
    else {
        PyMem_Free(j->blk);
        j->blk = NULL;
        if ((mem = PyMem_Calloc(1, bytes)) == NULL)
            return -1;
        j->blk = mem, j->blk_bytes = bytes;
    }
    int32_t *a = (int32_t *)mem;
    j->deps = a, a += n;
    j->stream = a, a += n;
    j->rq = a, a += n;
    j->ahead = a, a += nv;
    j->tail = a, a += nv;
    j->real = a, a += nv;
    j->kcount = a, a += nk;
    char *q = (char *)a;
    q += (8 - ((uintptr_t)q & 7)) & 7;
    j->lid = (int64_t *)q, q += n * 8;
    j->cbytes = (int64_t *)q, q += n * 8;
    j->cdst = (void **)q, q += n * 8;
    j->csrc = (const void **)q, q += n * 8;
    j->pp = (uint8_t *)q, q += n;
    j->st = (uint8_t *)q, q += n;
    j->cdone = (uint8_t *)q;
    memcpy(j->deps, p->deps0, n * sizeof(int32_t));
    memcpy(j->pp, p->pp0, n);
    memcpy(j->st, p->st0, n);
    for (size_t k = 0; k < n; k++)
        j->stream[k] = -1;
    for (size_t k = 0; k < nv; k++)
        j->tail[k] = j->real[k] = -1;
    return 0;
}

static int start_job(Core *c, int32_t id, Job *j)
{
    c->progress++;
    j->started = 1;
    if (job_arrived(c, id, j) < 0)
        return -1;
    Plan *p = j->plan;
    for (int k = 0; k < p->nready; k++) {
        int i = p->ready[k];
        if (j->st[i] == READY && active(c, id, j, i) < 0)
            return -1;
    }
    if (j->pending == 0)
        return finish_job(c, id, j);
    return 0;
}

/* ===================================================================================== */
/* Python interface.                                                                       */
static int seq_ints(PyObject *seq, Py_ssize_t n, int32_t *out, long lo, long hi, const char *what)
{
    PyObject *f = PySequence_Fast(seq, what);
    if (f == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(f) != n) {
        PyErr_Format(PyExc_ValueError, "PlanSpec.%s: %zd entries, expected %zd", what,
                     PySequence_Fast_GET_SIZE(f), n);
        Py_DECREF(f);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(f, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(f);
            return -1;
        }
        if (v < lo || v >= hi) {
            PyErr_Format(PyExc_ValueError, "PlanSpec.%s[%zd] = %ld is out of range", what, i, v);
            Py_DECREF(f);
            return -1;
        }
        out[i] = (int32_t)v;
    }
    Py_DECREF(f);
    return 0;
}

static Py_ssize_t attr_len(PyObject *o, const char *name)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL)
        return -1;
    Py_ssize_t n = PySequence_Size(v);
    Py_DECREF(v);
    return n;
}

static int attr_ints(PyObject *o, const char *name, Py_ssize_t n, int32_t *out, long lo, long hi)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL)
        return -1;
    int rc = seq_ints(v, n, out, lo, hi, name);
    Py_DECREF(v);
    return rc;
}

static double attr_double(PyObject *o, const char *name)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL)
        return -1.0;
    double d = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return d;
}

static long long attr_ll(PyObject *o, const char *name)
{
    PyObject *v = PyObject_GetAttrString(o, name);
    if (v == NULL)
        return -1;
    long long d = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return d;
}

static void plan_free(Plan *p)
{
    if (p == NULL)
        return;
    for (int k = 0; k < p->nk; k++) {
        Py_XDECREF(p->ks[k].record);
        if (p->ks[k].cu != NULL) {
            PyMem_Free(p->ks[k].cu->size);
            PyMem_Free(p->ks[k].cu);
        }
    }
    PyMem_Free(p->ks);
    PyMem_Free(p->kind);
    PyMem_Free(p->succ);
    PyMem_Free(p->io_start);
    PyMem_Free(p);
}

/* add_plan(spec: PlanSpec) -> plan index. Everything is copied and checked once. */
static PyObject *Core_add_plan(Core *c, PyObject *spec)
{
    Py_ssize_t n = attr_len(spec, "kinds");
    Py_ssize_t ndep = attr_len(spec, "dep"), nready = attr_len(spec, "ready");
    Py_ssize_t nk = attr_len(spec, "kernels");
    long long nv = attr_ll(spec, "n_vstreams");
    if (n < 0 || ndep < 0 || nready < 0 || nk < 0 || (nv == -1 && PyErr_Occurred()))
        return NULL;
    if (n < 1 || nv < 1 || n > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "a PlanSpec needs 1..2^24 nodes and a stream");
        return NULL;
    }
    Plan *p = PyMem_Calloc(1, sizeof(Plan));
    if (p == NULL)
        return PyErr_NoMemory();
    p->n = (int)n, p->nv = (int)nv, p->nk = (int)nk, p->nready = (int)nready;
    /* uint8 arrays: kind, pp0, st0, almost, implied; int32: succ, dstart, dep, deps0,
       ready, kernel, vstream, pred */
    p->kind = PyMem_Calloc(5 * n + 1, 1);
    p->succ = PyMem_Calloc(7 * n + 1 + ndep + nready + 1, sizeof(int32_t));
    p->ks = PyMem_Calloc(nk + 1, sizeof(KSpec));
    if (p->kind == NULL || p->succ == NULL || p->ks == NULL) {
        plan_free(p);
        return PyErr_NoMemory();
    }
    p->pp0 = p->kind + n, p->st0 = p->pp0 + n, p->almost = p->st0 + n;
    p->implied = p->almost + n;
    p->dstart = p->succ + n, p->dep = p->dstart + n + 1, p->deps0 = p->dep + ndep;
    p->ready = p->deps0 + n, p->kernel = p->ready + nready, p->vstream = p->kernel + n;
    p->pred = p->vstream + n;
    int32_t *tmp = PyMem_Calloc(n + 1, sizeof(int32_t));
    if (tmp == NULL) {
        plan_free(p);
        return PyErr_NoMemory();
    }
    int rc = attr_ints(spec, "kinds", n, tmp, 0, 4);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        p->kind[i] = (uint8_t)tmp[i];
    rc = rc ? rc : attr_ints(spec, "pp", n, tmp, 0, 2);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        p->pp0[i] = (uint8_t)tmp[i];
    rc = rc ? rc : attr_ints(spec, "st", n, tmp, 0, 5);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        p->st0[i] = (uint8_t)tmp[i];
    rc = rc ? rc : attr_ints(spec, "almost", n, tmp, 0, 2);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        p->almost[i] = (uint8_t)tmp[i];
    rc = rc ? rc : attr_ints(spec, "implied", n, tmp, 0, 2);   /* kernel_core.implied_copies */
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++)
        p->implied[i] = (uint8_t)tmp[i];
    PyMem_Free(tmp);
    rc = rc ? rc : attr_ints(spec, "succ", n, p->succ, -1, n);
    rc = rc ? rc : attr_ints(spec, "dstart", n + 1, p->dstart, 0, ndep + 1);
    rc = rc ? rc : attr_ints(spec, "dep", ndep, p->dep, 0, n);
    rc = rc ? rc : attr_ints(spec, "deps", n, p->deps0, 0, 1 << 30);
    rc = rc ? rc : attr_ints(spec, "ready", nready, p->ready, 0, n);
    rc = rc ? rc : attr_ints(spec, "kernel", n, p->kernel, -1, nk);
    rc = rc ? rc : attr_ints(spec, "vstream", n, p->vstream, 0, nv);
    rc = rc ? rc : attr_ints(spec, "pred", n, p->pred, -1, n);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        int s = p->implied[i] ? p->succ[i] : 0;   /* the rule's shape, checked again */
        if (p->implied[i] && (p->kind[i] != H2D || s < 0 || p->pred[s] != i
                              || (p->kind[s] != KERNEL && p->kind[s] != H2D))) {
            PyErr_Format(PyExc_ValueError, "PlanSpec: node %zd is no implied copy", i);
            rc = -1;
        }
        if (p->kind[i] == KERNEL && p->kernel[i] < 0) {
            PyErr_Format(PyExc_ValueError, "PlanSpec: kernel node %zd names no kernel", i);
            rc = -1;
        }
        if (p->st0[i] != DONE)
            p->pending0++;
        if (i < n - 1 && p->dstart[i] > p->dstart[i + 1]) {
            PyErr_SetString(PyExc_ValueError, "PlanSpec.dstart must not decrease");
            rc = -1;
        }
    }
    p->io_start = rc == 0 ? PyMem_Calloc(2 * n + 1, sizeof(int64_t)) : NULL;
    if (rc == 0 && p->io_start == NULL) {
        PyErr_NoMemory();
        rc = -1;
    }
    if (rc == 0) {
        p->io_end = p->io_start + n;
        PyObject *a = PyObject_GetAttrString(spec, "io_start");
        PyObject *e = a != NULL ? PyObject_GetAttrString(spec, "io_end") : NULL;
        Py_ssize_t na = a != NULL ? PySequence_Size(a) : -1;
        Py_ssize_t ne = e != NULL ? PySequence_Size(e) : -1;
        if (na == 0 && ne == 0)
            ;                    /* no io offsets: every copy brings its host array */
        else if (na != n || ne != n) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "PlanSpec.io_start/io_end: one per node");
            rc = -1;
        }
        for (Py_ssize_t i = 0; rc == 0 && na == n && i < n; i++) {
            PyObject *x = PySequence_GetItem(a, i), *y = PySequence_GetItem(e, i);
            p->io_start[i] = x != NULL ? PyLong_AsLongLong(x) : -1;
            p->io_end[i] = y != NULL ? PyLong_AsLongLong(y) : -1;
            Py_XDECREF(x);
            Py_XDECREF(y);
            if (PyErr_Occurred() || p->io_start[i] < 0 || p->io_end[i] < p->io_start[i]) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "PlanSpec: node %zd's io range is bad", i);
                rc = -1;
            } else if (p->io_end[i] > p->io_need)
                p->io_need = p->io_end[i];
        }
        Py_XDECREF(a);
        Py_XDECREF(e);
    }
    PyObject *kernels = rc == 0 ? PyObject_GetAttrString(spec, "kernels") : NULL;
    for (Py_ssize_t k = 0; kernels != NULL && k < nk; k++) {
        PyObject *ks = PySequence_GetItem(kernels, k);
        if (ks == NULL) {
            rc = -1;
            break;
        }
        KSpec *x = &p->ks[k];
        x->key = (int)attr_ll(ks, "key");
        x->d.blocks = attr_ll(ks, "blocks");
        x->d.warps = attr_ll(ks, "warps");
        x->d.regs = attr_ll(ks, "regs");
        x->d.smem = attr_ll(ks, "smem");
        x->d.entries = attr_ll(ks, "entries");
        x->shape = (int)attr_ll(ks, "shape");
        x->flops = attr_double(ks, "flops");
        x->nbytes = attr_double(ks, "nbytes");
        x->duration = attr_double(ks, "duration");
        x->effect = (int)attr_ll(ks, "effect");
        x->record = PyObject_GetAttrString(ks, "record");
        Py_DECREF(ks);
        if (PyErr_Occurred()) {
            rc = -1;
            break;
        }
        if (x->key < 0 || x->d.blocks < 1 || x->d.entries < 2) {
            PyErr_Format(PyExc_ValueError, "PlanSpec.kernels[%zd]: bad key, blocks or entries", k);
            rc = -1;
            break;
        }
    }
    Py_XDECREF(kernels);
    if (rc < 0) {
        plan_free(p);
        return NULL;
    }
    Plan **plans = PyMem_Realloc(c->plans, (c->nplans + 1) * sizeof(Plan *));
    if (plans == NULL) {
        plan_free(p);
        return PyErr_NoMemory();
    }
    c->plans = plans;
    c->plans[c->nplans] = p;
    return PyLong_FromLong(c->nplans++);
}

static void prof_free(Prof *p)
{
    if (p == NULL)
        return;
    PyMem_Free(p->count);
    PyMem_Free(p);
}

/* add_profile(count, time, n_time, seen, jobs, window) -> profile index (a model's
   statistics over kernel indices; the core owns and updates them). */
static PyObject *Core_add_profile(Core *c, PyObject *args)
{
    PyObject *count, *time, *n_time, *seen;
    long long jobs;
    int window;
    if (!PyArg_ParseTuple(args, "OOOOLi", &count, &time, &n_time, &seen, &jobs, &window))
        return NULL;
    Py_ssize_t nk = PySequence_Size(count);
    if (nk < 0)
        return NULL;
    if (window < 1 || PySequence_Size(time) != nk || PySequence_Size(n_time) != nk
            || PySequence_Size(seen) != nk) {
        PyErr_SetString(PyExc_ValueError, "add_profile: one entry per kernel in each list, "
                        "window >= 1");
        return NULL;
    }
    Prof *p = PyMem_Calloc(1, sizeof(Prof));
    if (p == NULL)
        return PyErr_NoMemory();
    p->nk = (int)nk, p->window = window, p->jobs = jobs, p->dirty = 1;
    char *mem = PyMem_Calloc(nk + 1, 2 * sizeof(double) + sizeof(int64_t) + 1);
    if (mem == NULL) {
        PyMem_Free(p);
        return PyErr_NoMemory();
    }
    p->count = (double *)mem;
    p->time = p->count + nk;
    p->n_time = (int64_t *)(p->time + nk);
    p->seen = (uint8_t *)(p->n_time + nk);
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *a = PySequence_GetItem(count, i), *b = PySequence_GetItem(time, i);
        PyObject *d = PySequence_GetItem(n_time, i), *e = PySequence_GetItem(seen, i);
        if (a && b && d && e) {
            p->count[i] = PyFloat_AsDouble(a);
            p->time[i] = PyFloat_AsDouble(b);
            p->n_time[i] = PyLong_AsLongLong(d);
            p->seen[i] = (uint8_t)PyObject_IsTrue(e);
        }
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(d);
        Py_XDECREF(e);
        if (PyErr_Occurred()) {
            prof_free(p);
            return NULL;
        }
    }
    Prof **profs = PyMem_Realloc(c->profs, (c->nprofs + 1) * sizeof(Prof *));
    if (profs == NULL) {
        prof_free(p);
        return PyErr_NoMemory();
    }
    c->profs = profs;
    c->profs[c->nprofs] = p;
    return PyLong_FromLong(c->nprofs++);
}

/* profile(index) -> (count, time, n_time, seen, jobs, total_ns) */
static PyObject *Core_profile(Core *c, PyObject *arg)
{
    long k = PyLong_AsLong(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (k < 0 || k >= c->nprofs) {
        PyErr_Format(PyExc_ValueError, "no profile %ld", k);
        return NULL;
    }
    Prof *p = c->profs[k];
    PyObject *a = PyList_New(p->nk), *b = PyList_New(p->nk), *d = PyList_New(p->nk);
    PyObject *e = PyList_New(p->nk);
    if (!a || !b || !d || !e)
        goto fail;
    for (int i = 0; i < p->nk; i++) {
        PyList_SET_ITEM(a, i, PyFloat_FromDouble(p->count[i]));
        PyList_SET_ITEM(b, i, PyFloat_FromDouble(p->time[i]));
        PyList_SET_ITEM(d, i, PyLong_FromLongLong(p->n_time[i]));
        PyList_SET_ITEM(e, i, PyBool_FromLong(p->seen[i]));
    }
    return Py_BuildValue("(NNNNLL)", a, b, d, e, (long long)p->jobs,
                         (long long)prof_total(p));
fail:
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(d);
    Py_XDECREF(e);
    return NULL;
}

/* The raw bytes of a buffer-protocol object (kept alive by the job's copies tuple), or
   NULL with the reason; `writable` for a copy's destination. */
static void *raw_bytes(PyObject *o, int writable, Py_ssize_t *len)
{
    Py_buffer v;
    if (PyObject_GetBuffer(o, &v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return NULL;
    void *p = v.buf;
    *len = v.len;
    /* Trick (labelled): the view is released at once; the pointer stays valid while the
       object lives (numpy arrays and bytearrays do not move their data while viewed or
       not: neither is resized here), and the job holds the object until it finishes. */
    PyBuffer_Release(&v);
    return p;
}

/* Direct copies: each copy node's entry (dptr, host, device_view) gives raw pointers;
   an entry without a device view (None: its range is not on the device) keeps the
   device's Python path, which refuses it with the reason. */
static int direct_copies(Job *j, Plan *p, PyObject *copies)
{
    char *io = NULL;                 /* the job's io buffer, taken once */
    for (int i = 0; i < p->n; i++) {
        if (p->kind[i] != H2D && p->kind[i] != D2H)
            continue;
        PyObject *e = PyTuple_GET_ITEM(copies, i);
        if (PyTuple_GET_SIZE(e) < 3 || PyTuple_GET_ITEM(e, 2) == Py_None)
            continue;
        Py_ssize_t nh, nd;
        int h2d = p->kind[i] == H2D;
        PyObject *h = PyTuple_GET_ITEM(e, 1);
        char *host;
        if (h == Py_None) {          /* the job's io buffer at the plan's offsets */
            if (io == NULL && (io = raw_bytes(j->io, 1, &nh)) == NULL)
                return -1;
            host = io + p->io_start[i];
            nh = p->io_end[i] - p->io_start[i];
        } else
            host = raw_bytes(h, !h2d, &nh);
        void *dev = NULL;
        if (host != NULL && PyTuple_GET_SIZE(e) >= 5) {
            /* the view's address and size, read once per buffer set (set_operands) */
            dev = PyLong_AsVoidPtr(PyTuple_GET_ITEM(e, 3));
            nd = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 4));
            if (PyErr_Occurred())
                return -1;
        } else if (host != NULL)
            dev = raw_bytes(PyTuple_GET_ITEM(e, 2), h2d, &nd);
        if (dev == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "admit: copy node %d has no device address", i);
            return -1;
        }
        if (nh != nd) {
            PyErr_Format(PyExc_ValueError, "admit: copy node %d has %zd host bytes and %zd "
                         "device bytes", i, nh, nd);
            return -1;
        }
        j->cdst[i] = h2d ? dev : host;
        j->csrc[i] = h2d ? host : dev;
        j->cbytes[i] = nh;
    }
    return 0;
}

static int grow_jobs(Core *c)
{
    int cap = c->njobs_cap ? 2 * c->njobs_cap : 64;
    Job **jobs = PyMem_Realloc(c->jobs, cap * sizeof(Job *));
    if (jobs == NULL)
        return -1;
    c->jobs = jobs;
    int *fs = PyMem_Realloc(c->free_slots, cap * sizeof(int));
    if (fs == NULL)
        return -1;
    c->free_slots = fs;
    for (int i = cap - 1; i >= c->njobs_cap; i--) {
        c->jobs[i] = NULL;
        c->free_slots[c->nfree++] = i;
    }
    c->njobs_cap = cap;
    if (ih_reserve(&c->heap, cap) < 0 || ih_reserve(&c->inflight, cap) < 0)
        return -1;
    return 0;
}

static PyObject *admit(Core *c, PyObject *token, long long seq, int plan, int prof,
                       PyObject *client, int level, int pin, PyObject *jargs, PyObject *copies,
                       PyObject *io);

/* admit(token, seq, plan, profile, client=0, level=0, pin=-1, args=None, copies=None,
         io=None) */
static PyObject *Core_admit(Core *c, PyObject *args, PyObject *kw)
{
    static char *kws[] = {"token", "seq", "plan", "profile", "client", "level", "pin", "args",
                          "copies", "io", NULL};
    PyObject *token, *client = NULL, *jargs = Py_None, *copies = Py_None, *io = Py_None;
    long long seq;
    int plan, prof, level = 0, pin = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLii|OiiOOO", kws, &token, &seq, &plan, &prof,
                                     &client, &level, &pin, &jargs, &copies, &io))
        return NULL;
    return admit(c, token, seq, plan, prof, client, level, pin, jargs, copies, io);
}

/* Speed: admit with positional arguments only (the control plane's call, once per job)
   skips the keyword parser (~1k instructions); keywords take the general path. */
static PyObject *admit_fast(Core *c, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    if (kwnames != NULL || nargs < 4 || nargs > 10) {
        PyObject *tup = PyTuple_New(nargs), *kw = NULL;
        if (tup == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < nargs; i++)
            PyTuple_SET_ITEM(tup, i, Py_NewRef(args[i]));
        Py_ssize_t nk = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
        if (nk && (kw = PyDict_New()) != NULL)
            for (Py_ssize_t i = 0; i < nk; i++)
                if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
                    Py_CLEAR(kw);
        PyObject *r = nk && kw == NULL ? NULL : Core_admit(c, tup, kw);
        Py_DECREF(tup);
        Py_XDECREF(kw);
        return r;
    }
    long long seq = PyLong_AsLongLong(args[1]);
    long plan = PyLong_AsLong(args[2]), prof = PyLong_AsLong(args[3]);
    long level = nargs > 5 ? PyLong_AsLong(args[5]) : 0;
    long pin = nargs > 6 ? PyLong_AsLong(args[6]) : -1;
    if (PyErr_Occurred())
        return NULL;
    if (plan < INT32_MIN || plan > INT32_MAX || prof < INT32_MIN || prof > INT32_MAX
            || level < INT32_MIN || level > INT32_MAX || pin < INT32_MIN || pin > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "admit: an index does not fit a C int");
        return NULL;
    }
    return admit(c, args[0], seq, (int)plan, (int)prof, nargs > 4 ? args[4] : NULL,
                 (int)level, (int)pin, nargs > 7 ? args[7] : Py_None,
                 nargs > 8 ? args[8] : Py_None, nargs > 9 ? args[9] : Py_None);
}

static PyObject *admit(Core *c, PyObject *token, long long seq, int plan, int prof,
                       PyObject *client, int level, int pin, PyObject *jargs, PyObject *copies,
                       PyObject *io)
{
    if (plan < 0 || plan >= c->nplans || prof < 0 || prof >= c->nprofs) {
        PyErr_SetString(PyExc_ValueError, "admit: unknown plan or profile index");
        return NULL;
    }
    Plan *p = c->plans[plan];
    Prof *pr = c->profs[prof];
    if (pin >= c->n_streams) {
        PyErr_Format(PyExc_ValueError, "admit: pinned stream %d is not one of %d", pin,
                     c->n_streams);
        return NULL;
    }
    for (int k = 0; k < p->nk; k++) {
        if (p->ks[k].key >= pr->nk) {
            PyErr_SetString(PyExc_ValueError, "admit: the plan names a kernel the profile lacks");
            return NULL;
        }
    }
    int has_copy = 0;
    for (int i = 0; i < p->n; i++)
        if (p->kind[i] == H2D || p->kind[i] == D2H)
            has_copy = 1;
    if (has_copy) {
        if (!PyTuple_Check(copies) || PyTuple_GET_SIZE(copies) != p->n) {
            PyErr_SetString(PyExc_ValueError, "admit: copies must be a tuple with one entry per "
                            "node, (dptr, host) for each copy");
            return NULL;
        }
        for (int i = 0; i < p->n; i++) {
            PyObject *e = PyTuple_GET_ITEM(copies, i);
            if ((p->kind[i] == H2D || p->kind[i] == D2H)
                    && (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) < 2 || PyTuple_GET_SIZE(e) == 4
                        || PyTuple_GET_SIZE(e) > 5)) {
                PyErr_Format(PyExc_ValueError, "admit: copies[%d] must be (dptr, host), "
                             "(dptr, host, device view) or (dptr, host, device view, its "
                             "address, its bytes)", i);
                return NULL;
            }
            if ((p->kind[i] == H2D || p->kind[i] == D2H) && PyTuple_GET_ITEM(e, 1) == Py_None) {
                Py_ssize_t len = io != Py_None ? PyObject_Length(io) : -1;
                if (len < 0 && PyErr_Occurred())
                    return NULL;
                if (len < p->io_need || p->io_end[i] == 0) {
                    PyErr_Format(PyExc_ValueError, "admit: copies[%d] takes its host bytes "
                                 "from io, which must hold the plan's %lld bytes", i,
                                 (long long)p->io_need);
                    return NULL;
                }
            }
        }
    }
    if (jargs != Py_None && (!PyTuple_Check(jargs) || PyTuple_GET_SIZE(jargs) != p->n)) {
        PyErr_SetString(PyExc_ValueError, "admit: args must be None or a tuple per node");
        return NULL;
    }
    if (!c->nfree && grow_jobs(c) < 0)
        return PyErr_NoMemory();
    int32_t id = c->free_slots[--c->nfree];
    Job *j = c->jobs[id];
    if (j == NULL && (j = c->jobs[id] = PyMem_Calloc(1, sizeof(Job))) == NULL) {
        c->free_slots[c->nfree++] = id;
        return PyErr_NoMemory();
    }
    char *blk = j->blk;
    size_t blk_bytes = j->blk_bytes;
    memset(j, 0, sizeof(Job));
    j->blk = blk, j->blk_bytes = blk_bytes;
    if (init_job_arrays(j, p, pr) < 0) {
        c->free_slots[c->nfree++] = id;
        j->finished = 1;
        return PyErr_NoMemory();
    }
    j->token = Py_NewRef(token);
    j->args = Py_NewRef(jargs);
    j->copies = Py_NewRef(copies);
    j->io = Py_NewRef(io);
    j->client = client != NULL ? Py_NewRef(client) : PyLong_FromLong(0);
    if (has_copy && c->engine != Py_None && direct_copies(j, p, copies) < 0) {
        free_job_arrays(j);
        j->finished = 1;
        c->free_slots[c->nfree++] = id;
        return NULL;
    }
    j->seq = seq, j->plan = p, j->prof = pr, j->level = level, j->pin = pin;
    if (c->class0 < 0)
        c->class0 = level;
    else if (level != c->class0)
        c->sat_at = INT_MAX;
    j->unit = -1;
    j->pending = p->pending0;
    j->estimate = j->remaining = prof_total(pr);
    Ref r = {id, seq, 0, NULL};
    if (refq_push(&c->arrivals, r) < 0) {
        free_job_arrays(j);
        j->finished = 1;
        c->free_slots[c->nfree++] = id;
        return PyErr_NoMemory();
    }
    c->live++;
    return PyLong_FromLong(id);
}

static long long monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* With `meter` on, the wall time inside the two entry points a driver calls per kernel
   (step and admit) adds up in metered_ns: the kernel core's own cost, apart from the
   loop that calls it (a benchmark's measure, as callgrind's toggles on the same two
   functions are). Off, it costs one branch. */
static PyObject *__attribute__((noinline))
metered_admit(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    long long t0 = monotonic_ns();
    PyObject *r = admit_fast(c, args, nargs, kwnames);
    c->metered_ns += monotonic_ns() - t0;
    c->metered_calls++;
    return r;
}

/* Speed (labelled): the metered paths are functions of their own, so that unmetered the
   entry points stay a test and a tail call (metering inline cost ~20 instructions per
   kernel: a frame for every call). */
static PyObject *Core_admit_fast(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    if (__builtin_expect(c->meter, 0))
        return metered_admit(c, args, nargs, kwnames);
    return admit_fast(c, args, nargs, kwnames);
}

/* abort(handle, token) -> events: the job stops (its client went away): its unreleased
   ops are dropped and it leaves the policy; it finishes once its released ops drain
   (now, if none is in flight: the FINISHED event is returned here). */
static PyObject *Core_abort(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "abort(handle, token)");
        return NULL;
    }
    long id = PyLong_AsLong(args[0]);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    Job *j = id >= 0 && id < c->njobs_cap ? c->jobs[id] : NULL;
    if (j == NULL || j->finished || j->token != args[1]) {
        PyErr_Format(PyExc_ValueError, "abort: handle %ld is not that job's", id);
        return NULL;
    }
    Py_CLEAR(c->events);
    if (!j->failed && fail_job(c, (int32_t)id, j, 0, NULL) < 0)
        return NULL;
    if (j->pending == 0 && finish_job(c, (int32_t)id, j) < 0)
        return NULL;
    c->progress++;
    if (c->events == NULL)
        return PyTuple_New(0);
    PyObject *out = c->events;
    c->events = NULL;
    return out;
}

/* job_of(launch_id) -> the token of the live job whose kernel was released as
   `launch_id`, or None. For a kernel that failed after its completion was reported
   (Device.late_faults: the process simulator's answer failed at the completion): the
   dispatcher fails that job with the reason. Rare, so a scan of the job slots, not an
   index kept per release. */
static PyObject *Core_job_of(Core *c, PyObject *arg)
{
    long long lid = PyLong_AsLongLong(arg);
    if (lid == -1 && PyErr_Occurred())
        return NULL;
    for (int id = 0; id < c->njobs_cap; id++) {
        Job *j = c->jobs[id];
        if (j == NULL || j->finished)
            continue;
        const Plan *p = j->plan;
        for (int i = 0; i < p->n; i++)
            if (p->kind[i] == KERNEL && j->lid[i] == lid
                    && (j->st[i] == RELEASED || j->st[i] == DONE))
                return Py_NewRef(j->token);
    }
    Py_RETURN_NONE;
}

/* reserve(stream): a named stream (Dispatcher.stream_named) leaves the pool for good: a
   sentinel count keeps it busy, so it never returns to the free list. */
static PyObject *Core_reserve(Core *c, PyObject *arg)
{
    long s = PyLong_AsLong(arg);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    if (s < 0 || s >= c->n_streams) {
        PyErr_Format(PyExc_ValueError, "reserve: no stream %ld", s);
        return NULL;
    }
    int k = 0;
    for (int i = 0; i < c->free_n; i++) {
        int32_t x = c->free_s[(c->free_head + i) % c->n_streams];
        if (x != s)
            c->free_s[(c->free_head + k++) % c->n_streams] = x;
    }
    c->free_n = k;
    c->busy[s]++;
    Py_RETURN_NONE;
}

/* use_driver(library, streams, region_dptr, counters_address, counter_mask, launch_failed):
   launch kernels through the GPU driver's cuLaunchKernel, loaded from `library` (the
   real libcuda, or the tests' recording stub), on these CUstream handles. */
static PyObject *Core_use_driver(Core *c, PyObject *args)
{
    const char *lib;
    PyObject *streams, *failed;
    unsigned long long region, counters;
    int mask;
    if (!PyArg_ParseTuple(args, "sOKKiO", &lib, &streams, &region, &counters, &mask, &failed))
        return NULL;
    Py_ssize_t n = PySequence_Size(streams);
    if (n < 0)
        return NULL;
    if (n != c->n_streams || mask < 0 || (mask & (mask + 1)) || !PyCallable_Check(failed)) {
        PyErr_Format(PyExc_ValueError, "use_driver: %d stream handles, a counter mask 2**k-1 "
                     "and a callable launch_failed are needed", c->n_streams);
        return NULL;
    }
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "cannot load the GPU driver library %s: %s", lib, dlerror());
        return NULL;
    }
    cu_launch_fn fn = (cu_launch_fn)dlsym(h, "cuLaunchKernel");
    if (fn == NULL) {
        PyErr_Format(PyExc_OSError, "%s has no cuLaunchKernel", lib);
        dlclose(h);
        return NULL;
    }
    uintptr_t *st = PyMem_Calloc(n, sizeof(uintptr_t));
    if (st == NULL) {
        dlclose(h);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_GetItem(streams, i);
        st[i] = o != NULL ? (uintptr_t)PyLong_AsUnsignedLongLong(o) : 0;
        Py_XDECREF(o);
        if (PyErr_Occurred()) {
            PyMem_Free(st);
            dlclose(h);
            return NULL;
        }
    }
    if (c->cu_lib != NULL)
        dlclose(c->cu_lib);
    PyMem_Free(c->cu_streams);
    c->cu_lib = h, c->cu_launch = fn, c->cu_streams = st;
    c->cu_region = region, c->cu_counters = (uint32_t *)(uintptr_t)counters;
    c->cu_counter_mask = mask;
    Py_XSETREF(c->cu_failed, Py_NewRef(failed));
    Py_RETURN_NONE;
}

/* cuda_kernels(plan, [(fn, grid, block, smem, sizes, instrumented, name) or None per
   kernel spec]): None keeps that kernel on the device's own launch. */
static PyObject *Core_cuda_kernels(Core *c, PyObject *args)
{
    int plan;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "iO", &plan, &list))
        return NULL;
    if (plan < 0 || plan >= c->nplans) {
        PyErr_SetString(PyExc_ValueError, "cuda_kernels: unknown plan");
        return NULL;
    }
    Plan *p = c->plans[plan];
    if (PySequence_Size(list) != p->nk) {
        PyErr_SetString(PyExc_ValueError, "cuda_kernels: one entry per kernel of the plan");
        return NULL;
    }
    for (int k = 0; k < p->nk; k++) {
        PyObject *e = PySequence_GetItem(list, k);
        if (e == NULL)
            return NULL;
        if (e == Py_None) {         /* this kernel keeps the device's own launch */
            Py_DECREF(e);
            continue;
        }
        unsigned long long fn;
        const char *kn;
        unsigned g[3], b[3], smem;
        PyObject *sizes;
        int instr;
        int ok = PyArg_ParseTuple(e, "K(III)(III)IOps", &fn, &g[0], &g[1], &g[2], &b[0], &b[1],
                                  &b[2], &smem, &sizes, &instr, &kn);
        char name[128];
        if (ok)
            snprintf(name, sizeof name, "%s", kn);
        Py_DECREF(e);
        if (!ok)
            return NULL;
        Py_ssize_t np = PySequence_Size(sizes);
        if (np < 0 || np > 4096 || (instr && np < 2)) {
            PyErr_SetString(PyExc_ValueError, "cuda_kernels: bad parameter list");
            return NULL;
        }
        CudaK *cu = PyMem_Calloc(1, sizeof(CudaK));
        int *mem = cu != NULL ? PyMem_Calloc(2 * np + 1, sizeof(int)) : NULL;
        if (mem == NULL) {
            PyMem_Free(cu);
            return PyErr_NoMemory();
        }
        cu->fn = (uintptr_t)fn, cu->smem = smem, cu->nparams = (int)np, cu->instrumented = instr;
        memcpy(cu->name, name, sizeof name);
        memcpy(cu->grid, g, sizeof g);
        memcpy(cu->block, b, sizeof b);
        cu->size = mem, cu->offset = mem + np;
        int off = 0;
        for (Py_ssize_t a = 0; a < np; a++) {
            PyObject *o = PySequence_GetItem(sizes, a);
            long sz = o != NULL ? PyLong_AsLong(o) : -1;
            Py_XDECREF(o);
            if (sz < 1 || sz > 4096) {
                PyMem_Free(mem);
                PyMem_Free(cu);
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "cuda_kernels: a parameter size is not 1..4096");
                return NULL;
            }
            int align = sz > 8 ? 16 : 8;     /* as the device's _ParamPack */
            off = (off + align - 1) / align * align;
            cu->size[a] = (int)sz, cu->offset[a] = off;
            off += (int)sz;
        }
        cu->bytes = off;
        if (off + 16 > c->cu_cap || np > c->cu_cap) {
            int cap = off + 16 > (int)np ? off + 16 : (int)np;
            unsigned char *v = PyMem_Realloc(c->cu_values, cap);
            void **pp = v != NULL ? PyMem_Realloc(c->cu_params, cap * sizeof(void *)) : NULL;
            if (v != NULL)
                c->cu_values = v;
            if (pp == NULL) {
                PyMem_Free(mem);
                PyMem_Free(cu);
                return PyErr_NoMemory();
            }
            c->cu_params = pp;
            c->cu_cap = cap;
        }
        if (p->ks[k].cu != NULL) {
            PyMem_Free(p->ks[k].cu->size);
            PyMem_Free(p->ks[k].cu);
        }
        p->ks[k].cu = cu;
    }
    Py_RETURN_NONE;
}

/* real_time(t0, speed): the engine follows the wall clock (a SimDevice in real time):
   each direct submission first fires what is due by then. */
static PyObject *Core_real_time(Core *c, PyObject *args)
{
    if (!PyArg_ParseTuple(args, "dd", &c->wall_t0, &c->wall_speed))
        return NULL;
    c->realtime = 1;
    Py_RETURN_NONE;
}

/* One pass at `now`: events, the empty tuple (something changed, nothing to report) or
   None (nothing changed); NULL with an exception set. */
static PyObject *core_pass(Core *c, double now)
{
    long long p0 = c->progress;
    c->now = now;
    Py_CLEAR(c->events);         /* made by the first event (most steps have none) */
    c->error = 0;
    long long drained = TAPI->drain(c->tracker, now, kernel_done, c);
    if (drained < 0 || c->error)
        goto fail;
    c->progress += drained;
    if (c->ncev && (c->landed || c->py_events) && poll_copies(c) < 0)
        goto fail;
    while (c->arrivals.n) {
        Ref r = *refq_front(&c->arrivals);
        refq_pop(&c->arrivals);
        Job *j = job_of(c, r.job, r.seq);
        if (j != NULL && start_job(c, r.job, j) < 0)
            goto fail;
    }
    if ((c->queued || c->copies.n) && release_loop(c) < 0)
        goto fail;
    if (c->events == NULL) {
        if (c->progress == p0)
            Py_RETURN_NONE;
        return Py_NewRef(EMPTY);
    }
    return Py_NewRef(c->events);
fail:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "kernel core: error in a completion");
    return NULL;
}

static PyObject *__attribute__((noinline)) metered_pass(Core *c, double now)
{
    long long t0 = monotonic_ns();
    PyObject *r = core_pass(c, now);
    c->metered_ns += monotonic_ns() - t0;
    c->metered_calls++;
    return r;
}

/* step(now) -> events, or None when the pass changed nothing (a driver's idle test) */
static PyObject *Core_step(Core *c, PyObject *arg)
{
    /* (an exact float, the drivers' clock, is read without the conversion's call or
       its error test) */
    double now;
    if (PyFloat_CheckExact(arg))
        now = PyFloat_AS_DOUBLE(arg);
    else if ((now = PyFloat_AsDouble(arg)) == -1.0 && PyErr_Occurred())
        return NULL;
    if (__builtin_expect(c->meter, 0))            /* (meter: above Core_admit_fast) */
        return metered_pass(c, now);
    return core_pass(c, now);
}

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Did any word the probe points at change since `seen` was taken? */
static int probe_changed(const uint64_t *addr, const uint64_t *seen, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (*(volatile const uint64_t *)(uintptr_t)addr[i] != seen[i])
            return 1;
    return 0;
}

/* spin(until, probe, near) -> events, the empty tuple or None, as step().

   Real time on the simulated GPU, launching into its engine: the paper's dispatcher
   loop, in C. Pass after pass (bring the engine to the wall clock, drain the notifQ,
   complete, release) until there is something for the control plane: events; nothing
   in flight; the device's host side has something to collect (Gpu.reached); a word
   of `probe` changed (a buffer of uint64 addresses: the clients' request-ring tails,
   so a request pushed meanwhile ends the spin); CLOCK_MONOTONIC reached `until`
   (seconds: the loop's other duties, sockets and batch timers, are due); or the
   device's next event is more than `near` seconds of device time away (the loop may
   sleep). Why: each pass of the Python loop costs microseconds, and at every kernel
   boundary of a job the GPU waits for the pass that sees its kernel complete; here a
   pass costs tens of nanoseconds when nothing happens.
   Every SPIN_SIGNAL_PERIOD of spinning, between two passes, the spin runs the signal
   handlers due (their exception, if any, ends it), so a signal waits no longer than
   that however long the caller lets it spin. (The daemon's other threads get the GIL
   when the spin returns: CPython hands it over in its eval loop, on a request the
   waiting thread makes after 5 ms; a release and retake here would not hand it over,
   the retake counting as a switch, and would starve them. Hence the daemon's 1 ms
   bound on a spin.)
   Safety: the probe's addresses are the caller's (mappings it keeps alive for the
   call). */
#define SPIN_SIGNAL_PERIOD 100e-6
static PyObject *Core_spin(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "spin(until, probe, near)");
        return NULL;
    }
    double until = PyFloat_AsDouble(args[0]), near = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (!c->realtime || c->engine == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "spin: the core must launch into a real-time "
                        "engine (real_time() and direct launches)");
        return NULL;
    }
    Py_buffer view = {0};
    int have_view = 0;
    uint64_t small[64], *seen = small;
    const uint64_t *addr = NULL;
    Py_ssize_t n = 0;
    if (args[1] != Py_None) {
        if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
            return NULL;
        have_view = 1;
        n = view.len / (Py_ssize_t)sizeof(uint64_t);
        addr = (const uint64_t *)view.buf;
        if (n > 64 && (seen = PyMem_Malloc((size_t)n * sizeof(uint64_t))) == NULL) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++)
            seen[i] = *(volatile const uint64_t *)(uintptr_t)addr[i];
    }
    PyObject *r = NULL;
    int changed = 0;
    double signals_at = monotonic_s() + SPIN_SIGNAL_PERIOD;
    for (;;) {
        if (EAPI->sync_wall(c->engine, c->wall_t0, c->wall_speed) < 0)
            goto done;
        double mono = monotonic_s();
        double now = (mono - c->wall_t0) * c->wall_speed;
        r = core_pass(c, now);
        if (r == NULL)
            goto done;
        if (r != Py_None) {
            changed = 1;
            if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r))
                goto done;                       /* events: the control plane's turn */
        }
        Py_CLEAR(r);
        if (c->live == 0 || EAPI->host_pending(c->engine) || mono >= until
                || (n && probe_changed(addr, seen, n)))
            break;
        if (!c->queued && !c->copies.n) {
            double next = EAPI->next_time(c->engine);
            if (isnan(next))
                goto done;
            if (next - now > near * c->wall_speed)
                break;                           /* far: the loop may sleep */
        }
        if (mono >= signals_at) {                /* (above) */
            signals_at = mono + SPIN_SIGNAL_PERIOD;
            if (PyErr_CheckSignals() < 0)
                goto done;
        }
    }
    r = Py_NewRef(changed ? EMPTY : Py_None);
done:
    if (seen != small)
        PyMem_Free(seen);
    if (have_view)
        PyBuffer_Release(&view);
    return r;
}

static void Core_dealloc(Core *c)
{
    PyObject_GC_UnTrack(c);
    if (c->gates_view.obj != NULL)
        PyBuffer_Release(&c->gates_view);
    for (int i = 0; i < c->njobs_cap; i++) {
        if (c->jobs[i] != NULL) {
            if (!c->jobs[i]->finished)
                free_job_arrays(c->jobs[i]);
            PyMem_Free(c->jobs[i]->blk);
            PyMem_Free(c->jobs[i]);
        }
    }
    for (int s = 0; c->cev != NULL && s < c->n_streams; s++) {
        RefQ *q = &c->cev[s];
        while (q->n) {
            Py_XDECREF(refq_front(q)->event);
            refq_pop(q);
        }
        PyMem_Free(q->r);
    }
    for (int k = 0; k < c->nplans; k++)
        plan_free(c->plans[k]);
    for (int k = 0; k < c->nprofs; k++)
        prof_free(c->profs[k]);
    for (int u = 0; u < c->nunits; u++) {
        fifo_free(&c->units[u].ready);
        Py_XDECREF(c->units[u].key);
    }
    PyMem_Free(c->units);
    PyMem_Free(c->unit_free);
    PyMem_Free(c->plans);
    PyMem_Free(c->profs);
    PyMem_Free(c->jobs);
    PyMem_Free(c->free_slots);
    PyMem_Free(c->arrivals.r);
    PyMem_Free(c->copies.r);
    PyMem_Free(c->free_s);
    PyMem_Free(c->busy);
    PyMem_Free(c->cev);
    PyMem_Free(c->cev_order);
    PyMem_Free(c->slot_job);
    PyMem_Free(c->slot_node);
    PyMem_Free(c->lvl);
    PyMem_Free(c->lvl_count);
    if (c->cu_lib != NULL)
        dlclose(c->cu_lib);
    PyMem_Free(c->cu_streams);
    PyMem_Free(c->cu_values);
    PyMem_Free(c->cu_params);
    Py_XDECREF(c->cu_failed);
    ih_free(&c->heap);
    ih_free(&c->inflight);
    ih_free(&c->dheap);
    fifo_free(&c->fifo);
    Py_XDECREF(c->tracker);
    Py_XDECREF(c->device);
    Py_XDECREF(c->engine);
    Py_XDECREF(c->engine_given);
    Py_XDECREF(c->events);
    Py_XDECREF(c->err_cls);
    Py_XDECREF(c->lost_cls);
    Py_XDECREF(c->faults);
    Py_XDECREF(c->launch_checked);
    Py_XDECREF(c->memcpy_htod);
    Py_XDECREF(c->memcpy_dtoh);
    Py_XDECREF(c->record_event);
    Py_XDECREF(c->event_query);
    Py_XDECREF(c->client_units);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Core_traverse(Core *c, visitproc visit, void *arg)
{
    Py_VISIT(c->tracker);
    Py_VISIT(c->device);
    Py_VISIT(c->engine);
    Py_VISIT(c->engine_given);
    Py_VISIT(c->events);
    for (int i = 0; i < c->njobs_cap; i++) {
        Job *j = c->jobs[i];
        if (j != NULL && !j->finished) {
            Py_VISIT(j->token);
            Py_VISIT(j->args);
            Py_VISIT(j->copies);
            Py_VISIT(j->io);
        }
    }
    return 0;
}

/* The device's methods the core calls, looked up as the device has them now. */
static int bind_device(Core *c)
{
    static const char *names[] = {"launch_checked", "memcpy_htod", "memcpy_dtoh",
                                  "record_event", "event_query"};
    PyObject **slots[] = {&c->launch_checked, &c->memcpy_htod, &c->memcpy_dtoh,
                          &c->record_event, &c->event_query};
    for (int k = 0; k < 5; k++) {
        PyObject *m = PyObject_GetAttrString(c->device, names[k]);
        if (m == NULL)
            return -1;
        Py_XSETREF(*slots[k], m);
    }
    return 0;
}

/* KernelCore(tracker, device, engine|None, n_streams, policy, lookahead, group, wake_lead,
              threshold, by_client, hold, device_error, device_lost, backlog=0) */
static int Core_init(Core *c, PyObject *args, PyObject *kw)
{
    static char *kws[] = {"tracker", "device", "engine", "n_streams", "policy", "lookahead",
                          "group", "wake_lead", "threshold", "by_client", "hold",
                          "device_error", "device_lost", "backlog", NULL};
    PyObject *tracker, *device, *engine, *err, *lost;
    const char *policy;
    int n_streams, lookahead, group, by_client, backlog = 0;
    double lead, threshold, hold;
    if (c->tracker != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a KernelCore is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOisiiddpdOO|i", kws, &tracker, &device,
                                     &engine, &n_streams, &policy, &lookahead, &group, &lead,
                                     &threshold, &by_client, &hold, &err, &lost, &backlog))
        return -1;
    if (TAPI->check(tracker) < 0 || (engine != Py_None && EAPI->check(engine) < 0))
        return -1;
    int pol = -1;
    for (int k = 0; policy_names[k] != NULL; k++)
        if (strcmp(policy, policy_names[k]) == 0)
            pol = k;
    if (pol < 0) {
        PyErr_Format(PyExc_ValueError, "the kernel core has no built-in policy %s", policy);
        return -1;
    }
    if (n_streams < 1 || lookahead < 1 || group < 1) {
        PyErr_SetString(PyExc_ValueError, "n_streams, lookahead and group must be >= 1");
        return -1;
    }
    if (backlog < 0) {
        PyErr_SetString(PyExc_ValueError, "backlog must be >= 0 (0: no saturation rule)");
        return -1;
    }
    c->class0 = -1;
    c->sat_at = backlog > 0 ? backlog : INT_MAX;
    c->policy = pol;
    c->gated = pol <= P_PRIORITY;
    c->mode = pol == P_FIFO ? M_SINGLE : pol == P_MSJBJ ? M_STICKY : M_POOL;
    c->eager = pol == P_FIFO || pol == P_MSJBJ;
    c->lookahead = lookahead, c->group = group, c->n_streams = n_streams;
    c->implied_on = 1;
    c->lead = to_ns(lead), c->threshold = threshold, c->by_client = by_client, c->hold = hold;
    c->tracker = Py_NewRef(tracker);
    c->device = Py_NewRef(device);
    c->engine = Py_NewRef(engine);
    c->engine_given = Py_NewRef(engine);
    /* A device that is no engine may count its own gates (stream_gates, an int32 array:
       the process simulator's kernels that may be held for their answers). */
    PyObject *sg = PyObject_GetAttrString(device, "stream_gates");
    if (sg == NULL)
        PyErr_Clear();
    else {
        if (c->gates_view.obj != NULL)
            PyBuffer_Release(&c->gates_view);
        if (PyObject_GetBuffer(sg, &c->gates_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            PyErr_Clear();
        else if (c->gates_view.itemsize != (Py_ssize_t)sizeof(int) || c->gates_view.format == NULL
                 || (strcmp(c->gates_view.format, "i") != 0 && strcmp(c->gates_view.format, "=i") != 0
                     && strcmp(c->gates_view.format, "<i") != 0))
            PyBuffer_Release(&c->gates_view);
        Py_DECREF(sg);
    }
    bind_gates(c);
    c->err_cls = Py_NewRef(err);
    c->lost_cls = Py_NewRef(lost);
    c->faults = PyObject_GetAttrString(device, "faults");
    if (c->faults == NULL)
        PyErr_Clear();
    else if (!PyDict_Check(c->faults))
        Py_CLEAR(c->faults);
    c->client_units = PyDict_New();
    if (c->client_units == NULL || bind_device(c) < 0)
        return -1;
    c->npairs = TAPI->pairs(tracker);
    c->free_s = PyMem_Calloc(n_streams, sizeof(int32_t));
    c->busy = PyMem_Calloc(n_streams, sizeof(int32_t));
    c->cev = PyMem_Calloc(n_streams, sizeof(RefQ));
    c->cev_order = PyMem_Calloc(n_streams, sizeof(int32_t));
    c->slot_job = PyMem_Calloc(c->npairs, sizeof(int32_t));
    c->slot_node = PyMem_Calloc(c->npairs, sizeof(int32_t));
    if (!c->free_s || !c->busy || !c->cev || !c->cev_order || !c->slot_job || !c->slot_node) {
        PyErr_NoMemory();
        return -1;
    }
    for (int s = 0; s < n_streams; s++)
        c->free_s[s] = s;
    c->free_n = n_streams;
    return 0;
}

static PyObject *get_jobs(Core *c, void *x) { return PyLong_FromLong(c->live); }
static PyObject *get_queued(Core *c, void *x) { return PyLong_FromLong(c->queued); }
static PyObject *get_released(Core *c, void *x) { return PyLong_FromLongLong(c->released); }
static PyObject *get_arrivals(Core *c, void *x) { return PyLong_FromLong(c->arrivals.n); }
static PyObject *get_free_streams(Core *c, void *x) { return PyLong_FromLong(c->free_n); }
static PyObject *get_progress(Core *c, void *x) { return PyLong_FromLongLong(c->progress); }
static int bind_device(Core *c);
static PyObject *get_device_calls(Core *c, void *x)
{
    return PyLong_FromLongLong(c->device_calls);
}

static PyObject *get_direct(Core *c, void *x) { return PyBool_FromLong(c->engine != Py_None); }
static PyObject *get_ops(Core *c, void *x) { return PyBool_FromLong(c->ops); }
/* A boolean attribute's new value: 1, 0, or -1 with an exception (deleted, no truth). */
static int truth(PyObject *v, const char *name)
{
    if (v == NULL) {
        PyErr_Format(PyExc_TypeError, "%s cannot be deleted", name);
        return -1;
    }
    return PyObject_IsTrue(v);
}

static PyObject *get_meter(Core *c, void *x) { return PyBool_FromLong(c->meter); }
static PyObject *get_metered(Core *c, void *x)
{
    return Py_BuildValue("(dL)", 1e-9 * (double)c->metered_ns, c->metered_calls);
}

/* meter = True starts the count afresh; False stops it (the count stays readable). */
static int set_meter(Core *c, PyObject *v, void *x)
{
    int on = truth(v, "meter");
    if (on < 0)
        return -1;
    if (on && !c->meter)
        c->metered_ns = c->metered_calls = 0;
    c->meter = on;
    return 0;
}

static PyObject *get_implied(Core *c, void *x) { return PyBool_FromLong(c->implied_on); }

static int set_implied(Core *c, PyObject *v, void *x)
{
    int on = truth(v, "implied_copies");
    if (on < 0)
        return -1;
    if (c->live) {               /* (released copies were launched under the other rule) */
        PyErr_SetString(PyExc_ValueError, "implied_copies can change only with no job live");
        return -1;
    }
    c->implied_on = on;
    return 0;
}

static int set_ops(Core *c, PyObject *v, void *x)
{
    int on = truth(v, "ops");
    if (on < 0)
        return -1;
    c->ops = on;
    return 0;
}

/* direct = False: launches and copies go through the device's Python methods from now
   on (someone replaced them on the device: fault injection, a meter); True: back into
   the engine, if the core was given one. Jobs admitted with direct copies keep them. */
static int set_direct(Core *c, PyObject *v, void *x)
{
    int on = truth(v, "direct");
    if (on < 0)
        return -1;
    Py_SETREF(c->engine, Py_NewRef(on ? c->engine_given : Py_None));
    bind_gates(c);
    return bind_device(c);       /* (the methods as the device has them now) */
}

static PyGetSetDef Core_getset[] = {
    {"jobs", (getter)get_jobs, NULL, "jobs admitted and not finished", NULL},
    {"queued", (getter)get_queued, NULL, "jobs with a ready kernel, announced to the policy", NULL},
    {"released", (getter)get_released, NULL, "kernels released so far", NULL},
    {"pending_arrivals", (getter)get_arrivals, NULL, "jobs admitted, not started", NULL},
    {"free_streams", (getter)get_free_streams, NULL, "pool mode: real streams free", NULL},
    {"progress", (getter)get_progress, NULL, "things done so far (a driver's idle test)", NULL},
    {"device_calls", (getter)get_device_calls, NULL,
     "driver calls its launches and copies stand for (1 a kernel, 3 a copy, 1 an implied "
     "copy and 2 more if its successor never runs)", NULL},
    {"ops", (getter)get_ops, (setter)set_ops,
     "report op events: (5, job, node, stream, launch id, t) released, "
     "(6, job, node, t_started, t) ended (t_started < 0: a copy)", NULL},
    {"implied_copies", (getter)get_implied, (setter)set_implied,
     "an input copy followed on its stream by a kernel or copy records no event: that op "
     "tells its completion (kernel_core.implied_copies)", NULL},
    {"meter", (getter)get_meter, (setter)set_meter,
     "time step() and admit() (True starts afresh): the core's own cost", NULL},
    {"metered", (getter)get_metered, NULL,
     "(seconds inside step() and admit() while metered, calls)", NULL},
    {"direct", (getter)get_direct, (setter)set_direct,
     "launches and copies go into the engine directly (else through the device)", NULL},
    {NULL},
};

static PyMethodDef Core_methods[] = {
    {"add_plan", (PyCFunction)Core_add_plan, METH_O, "add_plan(PlanSpec) -> index"},
    {"add_profile", (PyCFunction)Core_add_profile, METH_VARARGS,
     "add_profile(count, time, n_time, seen, jobs, window) -> index"},
    {"profile", (PyCFunction)Core_profile, METH_O,
     "profile(index) -> (count, time, n_time, seen, jobs, total_ns)"},
    {"admit", (PyCFunction)(void (*)(void))Core_admit_fast, METH_FASTCALL | METH_KEYWORDS,
     "admit(token, seq, plan, profile, client=0, level=0, pin=-1, args=None, copies=None, "
     "io=None)"},
    {"step", (PyCFunction)Core_step, METH_O, "step(now) -> [events], or None: nothing changed"},
    {"spin", (PyCFunction)(void (*)(void))Core_spin, METH_FASTCALL,
     "spin(until, probe, near): real time, passes in C until the control plane is due; "
     "returns as step()"},
    {"reserve", (PyCFunction)Core_reserve, METH_O, "reserve(stream): out of the pool"},
    {"real_time", (PyCFunction)Core_real_time, METH_VARARGS,
     "real_time(t0, speed): sync the engine to the wall clock before each submission"},
    {"use_driver", (PyCFunction)Core_use_driver, METH_VARARGS,
     "use_driver(library, streams, region_dptr, counters_address, counter_mask, launch_failed)"},
    {"cuda_kernels", (PyCFunction)Core_cuda_kernels, METH_VARARGS,
     "cuda_kernels(plan, [(fn, grid, block, smem, sizes, instrumented, name) | None])"},
    {"abort", (PyCFunction)(void (*)(void))Core_abort, METH_FASTCALL,
     "abort(handle, token) -> [events]: drop the job's unreleased ops"},
    {"job_of", (PyCFunction)Core_job_of, METH_O,
     "job_of(launch_id) -> the live job's token that released that kernel, or None"},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher._kcore.KernelCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The kernel core in C (paella.dispatcher.kernel_core is its reference).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paella.dispatcher._kcore",
    "The kernel core in C (paella.dispatcher.kernel_core).", -1, NULL,
};

/* The C API of module `mod` (its _C_API capsule named `name`): imported through
   sys.modules, so a build loaded in place of the installed one (the sanitizer test's)
   is the one used. */
static void *import_api(const char *mod, const char *name)
{
    PyObject *m = PyImport_ImportModule(mod);
    if (m == NULL)
        return NULL;
    PyObject *cap = PyObject_GetAttrString(m, "_C_API");
    Py_DECREF(m);
    if (cap == NULL)
        return NULL;
    void *api = PyCapsule_GetPointer(cap, name);
    Py_DECREF(cap);
    return api;
}

PyMODINIT_FUNC PyInit__kcore(void)
{
    TAPI = import_api("paella.dispatcher._tracker", PAELLA_TRACKER_CAPSULE);
    if (TAPI == NULL)
        return NULL;
    EAPI = import_api("paella.dispatcher.devices.sim._engine", PAELLA_ENGINE_CAPSULE);
    if (EAPI == NULL)
        return NULL;
    if (EMPTY == NULL && (EMPTY = PyTuple_New(0)) == NULL)
        return NULL;
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KernelCore", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
