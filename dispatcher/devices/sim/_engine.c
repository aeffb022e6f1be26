/*
 * The simulated GPU's engine: event loop, hardware queues, block scheduler, SM resources,
 * the timing model, copy engines and the device side of the notifQ, in C.
 *
 * paella.dispatcher.devices.sim.hardware documents the rules; cost.py documents the
 * timing model and its sources. This file implements both, and nothing else: Python
 * keeps device memory, the functional callbacks and the device interface.
 *
 * Rules (hardware.py states them with their reasons):
 *  - stream s feeds hardware queue s mod N; queues are FIFO; an op starts only when every
 *    earlier op of its stream has completed; a kernel stays its queue's head until all its
 *    blocks are placed;
 *  - a kernel that reaches the head of its queue with its stream ready may place blocks
 *    launch_latency later; the block scheduler visits placeable heads in launch order and
 *    places blocks breadth-first over the SMs (round-robin from where it stopped) while an
 *    SM has room for a whole block (the Occupancy Calculator's rules, exactly those of
 *    paella.occupancy.SMResources);
 *  - a block's duration is set from the state at the end of the virtual instant it was
 *    placed in (so blocks placed at one instant see each other; cost.py): its share of its SM's issue rate given the warps resident there, its
 *    memory traffic at the per-warp latency-bound rate, slowed when the demand of every
 *    running block exceeds the device's bandwidth, plus one memory latency;
 *  - blocks of one kernel placed on one SM in one pass form a group; groups of one kernel
 *    placed in one pass that end at the same instant end in one event;
 *  - stream priorities (Gpu.set_priority, CUDA's cudaStreamCreateWithPriority: lower is
 *    more urgent, 0 the default): the block scheduler visits placeable heads by their
 *    stream's priority first, then in launch order. Blocks already running are not
 *    preempted; a more urgent kernel takes the resources as blocks end;
 *  - a gate (Gpu.gate) is a marker that completes only once the host has opened it
 *    (Gpu.open): until then, at the head, it holds its stream and its queue as a kernel
 *    still running would. It takes no SM and posts nothing. No CUDA operation: the
 *    simulator holds a kernel with it until the kernel's answer exists (device.py).
 *
 * Determinism: events are ordered by (time, sequence number); nothing depends on
 * addresses or hashing, so a run is a pure function of its inputs and seed.
 *
 * Callbacks: an op's Python callbacks (copy action, then on_complete) run after the
 * engine's state is consistent, at the virtual instant the op completed, before the next
 * event is processed (the "deferred" list, flushed after every event and submission).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "../../capi.h"

enum { K_KERNEL = 0, K_H2D = 1, K_D2H = 2, K_MARKER = 3, K_GATE = 4, K_FREE = -1 };
enum { EV_GROUPS = 0, EV_COPY = 1, EV_READY = 2, EV_ARRIVAL = 3, EV_SM = 4 };
enum { B_COMPUTE = 0, B_MEMORY = 1, B_LATENCY = 2 };
#define MAX_PARTS 4
#define MAX_SMS 256
#define NIL (-1)

typedef struct {
    double t;
    uint64_t seq;
    int32_t type, a, b;
    uint64_t ver;                  /* EV_SM: the SM's version when scheduled */
} Event;

typedef struct {
    int32_t kind, stream;
    uint64_t seq;
    int32_t qnext, snext, enext;   /* next in hardware queue, stream, copy engine; free list */
    uint8_t done, issued, blocked, instrumented;
    uint8_t opened;                /* gates: the host has opened it */
    uint8_t notify;                /* gates: report reaching its stream's head (Gpu.reached) */
    double t_submit, t_issue, t_first, t_done;
    PyObject *cb, *action;
    /* kernels */
    int32_t shape, group;
    uint32_t launch_id;
    int64_t total, unplaced, started, ended;
    double fb, mb;                 /* FLOPs and DRAM bytes per block */
    double duration;               /* < 0: modelled; else the synthetic isolated time */
    double block_time;             /* synthetic: duration / waves */
    double warp_area, bound_time[3];
    uint64_t smset[MAX_SMS / 64];
    /* copies */
    int64_t nbytes;
    /* a copy submitted through the C API: its bytes land at its completion, then fn runs */
    void *land_dst;
    const void *land_src;
    void (*fn)(void *, uint64_t);
    void *fn_ctx;
    uint64_t fn_tag;
} Op;

typedef struct {
    int32_t op, sm, n, next;
    uint8_t split[MAX_PARTS];
    double demand;                 /* DRAM bytes/s of one block at its current rate */
    double tc, tm0, dur;
    /* modelled groups: fluid progress, re-timed when their SM's residency changes */
    int32_t sm_prev, sm_next;      /* the SM's list of modelled groups */
    int32_t bound;
    double tc_unit;                /* compute seconds per resident warp (max(W, W_c) of them) */
    double p, t_last, T, jit;      /* progress done, when, the group's time at the current rate */
    double end;                    /* when it ends at the current rate */
} Group;

typedef struct {
    PyObject_HEAD
    /* SMs */
    int n_sm, parts, max_blocks, max_warps;
    long long smem_per_sm, part_regs;
    int *fblocks, *fwarps, *mwarps;
    long long *fsmem, *fregs;
    uint8_t *is_dirty;
    int *dirty, ndirty, rr;
    /* block shapes */
    int nshapes, capshapes;
    int *sh_warps, *sh_rpw, *sh_per_sm;
    long long *sh_smem;
    /* ops, groups */
    Op *ops;
    int capops, free_op;
    Group *grps;
    int capgrps, free_grp;
    /* queues, streams, engines, placeable heads */
    int nq, n_streams;
    int *qhead, *qtail, *shead, *stail, *scount, *sprio;
    int *sgates;                   /* per stream: gates submitted and not completed */
    int ehead[3], etail[3];
    int *active, nactive;
    /* event heap */
    Event *heap;
    int nheap, capheap;
    uint64_t evseq, opseq, vseq;
    long long ngates;              /* gates submitted and not completed */
    /* this pass's placements, waiting for their durations */
    int *pend, npend, cappend;
    /* SMs whose modelled residency changed this instant; each SM's modelled groups */
    int *touched, ntouched, *sm_head;
    uint8_t *is_touched;
    uint64_t *sm_ver;              /* each SM's one pending end event: its earliest group's end */
    double *sm_end;
    /* ops whose callbacks are due */
    int *defer, dhead, dtail, capdefer, flushing;
    /* timing model */
    double now, psm, wc, bw, lmem, line, launch_lat, pcie_lat, pcie_bw;
    double demand;
    long long mresident;
    /* jitter */
    double jitter;
    uint64_t rng[4];
    /* notifQ */
    Py_buffer ring;
    int has_ring;
    uint64_t *rbuf, rmask, tail;
    uint64_t place_bits, done_bits;
    int count_shift, sm_shift;
    PyObject *overrun_exc;
    /* statistics */
    long long resident, placements, events;
    uint64_t observed;             /* notifQ writes and completed ops: what a host can see */
    double area, last_t;
    PyObject *record;              /* list, or NULL: per-kernel records for profiling */
    PyObject *trace;               /* callable, or NULL: trace(kind, begin, end) per kernel/copy */
    PyObject *reached;             /* list, or NULL: handles of notifying gates at their head */
    /* the self-log (Gpu.logging): each completed kernel's and copy's (start, end, kind) in
       device time, and each stretch of the simulator's own work (start, end) in
       CLOCK_MONOTONIC seconds, kept in C: no Python call per entry */
    int logging;
    double *lg_ops, *lg_sim;
    Py_ssize_t lg_nops, lg_capops, lg_nsim, lg_capsim;
    /* bulk arrivals (benchmarks, naive drivers) */
    double *b_t;
    int32_t *b_stream;
    uint32_t *b_lid;
    Py_ssize_t b_i, b_n;
    int b_shape, b_instr, b_group;
    long long b_blocks;
    double b_flops, b_bytes, b_duration;
} Gpu;

/* -- small helpers ------------------------------------------------------------------ */
static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Append k doubles to a self-log buffer; -1 with MemoryError set. */
static int lg_append(double **buf, Py_ssize_t *n, Py_ssize_t *cap, const double *v, int k)
{
    if (*n + k > *cap) {
        Py_ssize_t c = *cap ? *cap * 2 : 4096;
        while (c < *n + k)
            c *= 2;
        double *b = PyMem_Realloc(*buf, (size_t)c * sizeof(double));
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *n, v, (size_t)k * sizeof(double));
    *n += k;
    return 0;
}

/* The simulator worked from t0 (CLOCK_MONOTONIC) until now: into the self-log. */
static int lg_sim(Gpu *g, double t0)
{
    double v[2] = {t0, mono_now()};
    return lg_append(&g->lg_sim, &g->lg_nsim, &g->lg_capsim, v, 2);
}
static int grow(void **p, int *cap, int need, size_t size)
{
    if (need <= *cap)
        return 0;
    int n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *q = PyMem_Realloc(*p, (size_t)n * size);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    *cap = n;
    return 0;
}

/* xoshiro256** seeded by splitmix64: the jitter's generator. */
static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(Gpu *g)
{
    uint64_t *s = g->rng;
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = rotl(s[3], 45);
    return r;
}

static double uniform01(Gpu *g) { return ((next_u64(g) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

/* exp(sigma * N(0, 1)): Box-Muller, one normal per call (no cached spare, so a draw never
   depends on an earlier call's parity). */
static double lognormal(Gpu *g)
{
    double u = uniform01(g), v = uniform01(g);
    return exp(g->jitter * sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* -- event heap ------------------------------------------------------------------------- */
static inline int ev_less(const Event *a, const Event *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static int push_event_v(Gpu *g, double t, int type, int a, int b, uint64_t ver)
{
    if (grow((void **)&g->heap, &g->capheap, g->nheap + 1, sizeof(Event)) < 0)
        return -1;
    Event e = {t, g->evseq++, type, a, b, ver};
    int i = g->nheap++;
    while (i > 0) {
        int p = (i - 1) >> 1;
        if (!ev_less(&e, &g->heap[p]))
            break;
        g->heap[i] = g->heap[p];
        i = p;
    }
    g->heap[i] = e;
    return 0;
}

static inline int push_event(Gpu *g, double t, int type, int a, int b)
{
    return push_event_v(g, t, type, a, b, 0);
}

static Event pop_event(Gpu *g)
{
    Event top = g->heap[0], last = g->heap[--g->nheap];
    int n = g->nheap, i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && ev_less(&g->heap[c + 1], &g->heap[c]))
            c++;
        if (!ev_less(&g->heap[c], &last))
            break;
        g->heap[i] = g->heap[c];
        i = c;
    }
    if (n)
        g->heap[i] = last;
    return top;
}

/* Drop stale SM events (the SM was re-timed since) from the top of the heap. */
static inline void clean_top(Gpu *g)
{
    while (g->nheap && g->heap[0].type == EV_SM && g->sm_ver[g->heap[0].a] != g->heap[0].ver)
        pop_event(g);
}

/* -- pools ------------------------------------------------------------------------------ */
static int op_alloc(Gpu *g)
{
    if (g->free_op == NIL) {
        int old = g->capops;
        if (grow((void **)&g->ops, &g->capops, old + 1, sizeof(Op)) < 0)
            return NIL;
        for (int i = g->capops - 1; i >= old; i--) {
            g->ops[i].kind = K_FREE;
            g->ops[i].cb = g->ops[i].action = NULL;
            g->ops[i].land_dst = NULL;
            g->ops[i].land_src = NULL;
            g->ops[i].fn = NULL;
            g->ops[i].qnext = g->free_op;
            g->free_op = i;
        }
    }
    int i = g->free_op;
    Op *o = &g->ops[i];
    g->free_op = o->qnext;
    memset(o, 0, sizeof(Op));
    o->qnext = o->snext = o->enext = NIL;
    o->t_first = -1.0;
    o->duration = -1.0;
    return i;
}

static void op_free(Gpu *g, int i)
{
    Op *o = &g->ops[i];
    o->kind = K_FREE;
    o->cb = o->action = NULL;
    o->land_dst = NULL;
    o->land_src = NULL;
    o->fn = NULL;
    o->qnext = g->free_op;
    g->free_op = i;
}

static int grp_alloc(Gpu *g)
{
    if (g->free_grp == NIL) {
        int old = g->capgrps;
        if (grow((void **)&g->grps, &g->capgrps, old + 1, sizeof(Group)) < 0)
            return NIL;
        for (int i = g->capgrps - 1; i >= old; i--) {
            g->grps[i].next = g->free_grp;
            g->free_grp = i;
        }
    }
    int i = g->free_grp;
    g->free_grp = g->grps[i].next;
    return i;
}

/* -- SM resources: the Occupancy Calculator's rules (paella.occupancy.SMResources) ------- */
static inline int sm_fit(Gpu *g, int s, int sh)
{
    int w = g->sh_warps[sh], rpw = g->sh_rpw[sh];
    long long smem = g->sh_smem[sh];
    int n = g->fblocks[s], x = g->fwarps[s] / w;
    if (x < n)
        n = x;
    if (smem) {
        long long y = g->fsmem[s] / smem;
        if (y < n)
            n = (int)y;
    }
    if (rpw && n) {
        long long rw = 0, *r = g->fregs + (long long)s * g->parts;
        for (int p = 0; p < g->parts; p++)
            rw += r[p] / rpw;
        if (rw / w < n)
            n = (int)(rw / w);
    }
    return n;
}

static void sm_take(Gpu *g, int s, int sh, int n, uint8_t *split)
{
    int w = g->sh_warps[sh], rpw = g->sh_rpw[sh];
    memset(split, 0, MAX_PARTS);
    if (rpw) {
        long long need = (long long)n * w, *r = g->fregs + (long long)s * g->parts;
        for (int p = 0; p < g->parts && need; p++) {
            long long k = r[p] / rpw;
            if (k > need)
                k = need;
            split[p] = (uint8_t)k;
            r[p] -= k * rpw;
            need -= k;
        }
    }
    g->fblocks[s] -= n;
    g->fwarps[s] -= n * w;
    g->fsmem[s] -= n * g->sh_smem[sh];
}

static void sm_give(Gpu *g, int s, int sh, int n, const uint8_t *split)
{
    int rpw = g->sh_rpw[sh];
    g->fblocks[s] += n;
    g->fwarps[s] += n * g->sh_warps[sh];
    g->fsmem[s] += n * g->sh_smem[sh];
    if (rpw) {
        long long *r = g->fregs + (long long)s * g->parts;
        for (int p = 0; p < g->parts; p++)
            r[p] += (long long)split[p] * rpw;
    }
}

static inline int sm_no_room(Gpu *g, int s) { return !g->fblocks[s] || !g->fwarps[s]; }

static inline void mark_dirty(Gpu *g, int s)
{
    if (!g->is_dirty[s]) {
        g->is_dirty[s] = 1;
        g->dirty[g->ndirty++] = s;
    }
}

static inline void touch(Gpu *g, int s)
{
    if (!g->is_touched[s]) {
        g->is_touched[s] = 1;
        g->touched[g->ntouched++] = s;
    }
}

/* -- notifQ ----------------------------------------------------------------------------- */
static int overrun(Gpu *g, uint64_t slot)
{
    PyErr_Format(g->overrun_exc,
                 "notifQ overrun at slot %llu (entry %llu): the reader has not consumed it; the "
                 "dispatcher must bound outstanding blocks to fewer than %llu ring slots' worth of "
                 "notifications", (unsigned long long)slot, (unsigned long long)g->tail,
                 (unsigned long long)(g->rmask + 1));
    return -1;
}

/* The entries the device header writes for blocks c0+1.. of k placed (or ended) as the
   groups from first on: the block whose counter reaches a multiple of the group size posts
   the group's count, the kernel's last block posts what remains (protocol.group_posts). */
static int post(Gpu *g, uint64_t kind_bits, Op *k, int first, int64_t c0)
{
    g->observed++;
    int64_t G = k->group, total = k->total;
    uint64_t full = kind_bits | k->launch_id | ((uint64_t)G << g->count_shift);
    int64_t nxt = (c0 / G + 1) * G;
    uint64_t tail = g->tail, mask = g->rmask, *buf = g->rbuf;
    int s = 0;
    for (int i = first; i != NIL; i = g->grps[i].next) {
        s = g->grps[i].sm;
        c0 += g->grps[i].n;
        if (nxt <= c0) {
            uint64_t word = full | ((uint64_t)s << g->sm_shift);
            while (nxt <= c0) {
                uint64_t slot = tail & mask;
                if (buf[slot]) {
                    g->tail = tail;
                    return overrun(g, slot);
                }
                buf[slot] = word;
                tail++;
                nxt += G;
            }
        }
    }
    if (c0 == total && total % G) {
        uint64_t slot = tail & mask;
        if (buf[slot]) {
            g->tail = tail;
            return overrun(g, slot);
        }
        buf[slot] = kind_bits | k->launch_id | ((uint64_t)(total % G) << g->count_shift)
                    | ((uint64_t)s << g->sm_shift);
        tail++;
    }
    g->tail = tail;
    return 0;
}

/* -- queues and streams ----------------------------------------------------------------- */
static int defer_op(Gpu *g, int i)
{
    if (grow((void **)&g->defer, &g->capdefer, g->dtail + 1, sizeof(int)) < 0)
        return -1;
    g->defer[g->dtail++] = i;
    return 0;
}

static int advance(Gpu *g, int qi);

static int record_kernel(Gpu *g, Op *k)
{
    int nsm = 0;
    for (int w = 0; w < MAX_SMS / 64; w++)
        nsm += __builtin_popcountll(k->smset[w]);
    PyObject *rec = Py_BuildValue("(kddddiLdddd)", (unsigned long)k->launch_id, k->t_submit,
                                  k->t_issue, k->t_first, k->t_done, nsm, (long long)k->total,
                                  k->warp_area, k->bound_time[B_COMPUTE], k->bound_time[B_MEMORY],
                                  k->bound_time[B_LATENCY]);
    if (rec == NULL)
        return -1;
    int r = PyList_Append(g->record, rec);
    Py_DECREF(rec);
    return r;
}

static PyObject *gate_handle(uint64_t seq, int slot);
static int gate_reached(Gpu *g, int i);

static int complete(Gpu *g, int i)
{
    Op *o = &g->ops[i];
    g->observed++;
    o->done = 1;
    o->t_done = g->now;
    int st = o->stream;
    if (g->shead[st] != i) {
        PyErr_SetString(PyExc_AssertionError, "stream order violated in the simulator");
        return -1;
    }
    g->shead[st] = o->snext;
    if (g->shead[st] == NIL)
        g->stail[st] = NIL;
    else if (g->ops[g->shead[st]].notify && !g->ops[g->shead[st]].opened
             && gate_reached(g, g->shead[st]) < 0)
        return -1;
    g->scount[st]--;
    if (o->kind == K_GATE) {
        g->ngates--;
        g->sgates[st]--;
    }
    if (o->kind == K_KERNEL && g->record && record_kernel(g, o) < 0)
        return -1;
    if (defer_op(g, i) < 0)
        return -1;
    return advance(g, st % g->nq);
}

/* Placeable heads in the order the block scheduler visits them: stream priority, then
   launch order. */
static inline int active_before(Gpu *g, const Op *a, const Op *b)
{
    int pa = g->sprio[a->stream], pb = g->sprio[b->stream];
    return pa != pb ? pa < pb : a->seq < b->seq;
}

static void insert_active(Gpu *g, int i)
{
    int n = g->nactive;
    const Op *o = &g->ops[i];
    while (n > 0 && active_before(g, o, &g->ops[g->active[n - 1]])) {
        g->active[n] = g->active[n - 1];
        n--;
    }
    g->active[n] = i;
    g->nactive++;
}

static void remove_active(Gpu *g, int i)
{
    int n = g->nactive, j = 0;
    while (j < n && g->active[j] != i)
        j++;
    memmove(g->active + j, g->active + j + 1, (size_t)(n - j - 1) * sizeof(int));
    g->nactive--;
}

static int start_copy(Gpu *g, int i)
{
    Op *o = &g->ops[i];
    o->t_first = g->now;
    return push_event(g, g->now + g->pcie_lat + (double)o->nbytes / g->pcie_bw, EV_COPY, i, 0);
}

/* A notifying gate became the head of its stream: everything before it on its stream has
   completed (whatever its hardware queue holds ahead of it). Its handle goes on g->reached
   for the host (Gpu.reached). */
static int gate_reached(Gpu *g, int i)
{
    Op *o = &g->ops[i];
    o->notify = 0;
    if (g->reached == NULL && (g->reached = PyList_New(0)) == NULL)
        return -1;
    PyObject *h = gate_handle(o->seq, i);
    if (h == NULL)
        return -1;
    int rc = PyList_Append(g->reached, h);
    Py_DECREF(h);
    return rc;
}

/* Start what the head of queue qi allows: copies go to their engine, markers and opened
   gates complete, a kernel becomes issued (placeable launch_latency later). Stops at an op
   whose stream is busy with an earlier op, and at a closed gate (Gpu.open resumes here). */
static int advance(Gpu *g, int qi)
{
    while (g->qhead[qi] != NIL) {
        int i = g->qhead[qi];
        Op *o = &g->ops[i];
        if (g->shead[o->stream] != i)
            return 0;
        if (o->kind == K_KERNEL) {
            if (!o->issued) {
                o->issued = 1;
                o->t_issue = g->now;
                if (g->launch_lat > 0)
                    return push_event(g, g->now + g->launch_lat, EV_READY, i, 0);
                insert_active(g, i);
            }
            return 0;
        }
        if (o->kind == K_GATE && !o->opened)
            return 0;                        /* the head until opened, as a running kernel */
        g->qhead[qi] = o->qnext;
        if (g->qhead[qi] == NIL)
            g->qtail[qi] = NIL;
        if (o->kind == K_MARKER || o->kind == K_GATE) {
            if (complete(g, i) < 0)
                return -1;
        }
        else {
            int e = o->kind;
            o->enext = NIL;
            if (g->etail[e] == NIL) {
                g->ehead[e] = g->etail[e] = i;
                if (start_copy(g, i) < 0)
                    return -1;
            }
            else {
                g->ops[g->etail[e]].enext = i;
                g->etail[e] = i;
            }
        }
    }
    return 0;
}

/* -- the block scheduler ------------------------------------------------------------------ */
static int pend_group(Gpu *g, int gi)
{
    if (grow((void **)&g->pend, &g->cappend, g->npend + 1, sizeof(int)) < 0)
        return -1;
    g->pend[g->npend++] = gi;
    return 0;
}

/* Breadth-first share of need blocks over caps (every SM gets a block before any gets a
   second), as the hardware spreads a grid. */
static void water_fill(int *cs, int *cc, int ncap, int need)
{
    int level = 0, placed = 0;
    for (;;) {
        int nxt = 0;
        for (int j = 0; j < ncap; j++)
            nxt += cc[j] < level + 1 ? cc[j] : level + 1;
        if (nxt > need)
            break;
        level++;
        placed = nxt;
        if (nxt == 0)
            break;
    }
    int extra = need - placed;
    for (int j = 0; j < ncap; j++) {
        int n = cc[j] < level ? cc[j] : level;
        if (extra && cc[j] > level) {
            n++;
            extra--;
        }
        cc[j] = n;
    }
    (void)cs;
}

/* Place what fits of kernel ki, breadth-first from the round-robin position; a kernel that
   found every SM full last time looks only where room appeared since (the dirty SMs, in the
   order they gained room). */
static int place(Gpu *g, int ki)
{
    Op *k = &g->ops[ki];
    int64_t need = k->unplaced;
    int sh = k->shape, n_sm = g->n_sm;
    int cs[MAX_SMS], cc[MAX_SMS], ncap = 0;
    long long got = 0;
    int was_blocked = k->blocked;
    int ncand = was_blocked ? g->ndirty : n_sm;
    for (int j = 0; j < ncand; j++) {
        int s = was_blocked ? g->dirty[j] : (g->rr + j) % n_sm;
        int c = sm_fit(g, s, sh);
        if (c) {
            cs[ncap] = s;
            cc[ncap++] = c;
            got += c;
            if (ncap >= need)
                break;                       /* one block per SM already covers the rest */
        }
    }
    if (!ncap) {
        k->blocked = 1;
        return 0;
    }
    if (ncap >= need) {
        for (int j = 0; j < ncap; j++)
            cc[j] = 1;
    }
    else if (got > need)
        water_fill(cs, cc, ncap, (int)need);
    /* Take the resources and record the groups (durations come after the pass). */
    int first = NIL, prev = NIL;
    int64_t placed = 0;
    int modelled = k->duration < 0, w = g->sh_warps[sh];
    int last_s = 0;
    for (int j = 0; j < ncap; j++) {
        if (!cc[j])
            continue;
        int s = cs[j], n = cc[j];
        int gi = grp_alloc(g);
        if (gi == NIL)
            return -1;
        k = &g->ops[ki];
        Group *gr = &g->grps[gi];
        gr->op = ki;
        gr->sm = s;
        gr->n = n;
        gr->next = NIL;
        sm_take(g, s, sh, n, gr->split);
        if (modelled) {
            g->mwarps[s] += n * w;
            touch(g, s);
        }
        if (g->record)
            k->smset[s >> 6] |= 1ULL << (s & 63);
        if (prev == NIL)
            first = gi;
        else
            g->grps[prev].next = gi;
        prev = gi;
        placed += n;
        last_s = s;
        if (pend_group(g, gi) < 0)
            return -1;
    }
    k = &g->ops[ki];
    int64_t c0 = k->started, end = c0 + placed;
    k->started = end;
    if (k->instrumented && (end - end % k->group > c0 || end == k->total))
        if (post(g, g->place_bits, k, first, c0) < 0)
            return -1;
    if (k->t_first < 0)
        k->t_first = g->now;
    k->unplaced = need - placed;
    g->placements += placed;
    g->area += (double)g->resident * (g->now - g->last_t);
    g->last_t = g->now;
    g->resident += placed;
    if (modelled)
        g->mresident += placed;
    g->rr = (last_s + 1) % n_sm;
    if (was_blocked) {
        /* Drop SMs that can hold no block at all any more, so the kernels waiting after
           this one do not scan them. */
        int keep = 0;
        for (int j = 0; j < g->ndirty; j++) {
            int s = g->dirty[j];
            if (sm_no_room(g, s))
                g->is_dirty[s] = 0;
            else
                g->dirty[keep++] = s;
        }
        g->ndirty = keep;
    }
    k->blocked = need > placed;
    return 0;
}

/* Account a modelled group's progress up to now at its current rate. */
static void advance_group(Gpu *g, Group *gr, Op *k)
{
    if (gr->T > 0) {
        double seg = g->now - gr->t_last;
        gr->p += seg / gr->T;
        if (g->record) {
            k->bound_time[gr->bound] += seg * gr->n;
            k->warp_area += seg * gr->n * g->sh_warps[k->shape];
        }
    }
    gr->t_last = g->now;
}

/* Settle the instant that ends (cost.py states the model):
   - new synthetic groups get their fixed duration; a kernel's groups placed together that
     end at the same instant share one event;
   - new modelled groups join their SM's list;
   - every modelled group on an SM whose residency changed this instant (a placement or a
     group's end) is re-timed: its progress so far is kept, its rate becomes the one its
     SM's warps and the device's memory demand give now, and its end event moves. */
static int finalize(Gpu *g)
{
    int np = g->npend;
    for (int j = 0; j < np; j++) {
        int gi = g->pend[j];
        Group *gr = &g->grps[gi];
        Op *k = &g->ops[gr->op];
        if (k->duration >= 0) {
            gr->dur = k->block_time;
            if (g->jitter > 0)
                gr->dur *= lognormal(g);
            continue;
        }
        double w = g->sh_warps[k->shape];
        gr->tc_unit = k->fb / (w * g->psm);
        gr->tm0 = k->mb * g->lmem / (w * g->line);
        gr->p = 0.0;
        gr->t_last = g->now;
        gr->T = 0.0;
        gr->demand = 0.0;
        gr->bound = B_LATENCY;
        gr->jit = g->jitter > 0 ? lognormal(g) : 1.0;
        int sm = gr->sm;
        gr->sm_prev = NIL;
        gr->sm_next = g->sm_head[sm];
        if (g->sm_head[sm] != NIL)
            g->grps[g->sm_head[sm]].sm_prev = gi;
        g->sm_head[sm] = gi;
    }
    int j = 0;
    while (j < np) {
        int gi = g->pend[j], ki = g->grps[gi].op;
        if (g->ops[ki].duration < 0) {
            j++;
            continue;
        }
        int last = gi, m = j + 1;
        double end = g->now + g->grps[gi].dur;
        while (m < np) {
            Group *h = &g->grps[g->pend[m]];
            if (h->op != ki || g->now + h->dur != end)
                break;
            g->grps[last].next = g->pend[m];
            last = g->pend[m];
            m++;
        }
        g->grps[last].next = NIL;
        if (push_event(g, end, EV_GROUPS, ki, gi) < 0)
            return -1;
        j = m;
    }
    g->npend = 0;
    /* Pass 1: progress at the old rates; compute times at the SMs' warps now, and each
       group's memory demand at that rate. */
    int nt = g->ntouched;
    for (int t = 0; t < nt; t++) {
        int sm = g->touched[t];
        double W = g->mwarps[sm] < g->wc ? g->wc : g->mwarps[sm];
        for (int gi = g->sm_head[sm]; gi != NIL; gi = g->grps[gi].sm_next) {
            Group *gr = &g->grps[gi];
            Op *k = &g->ops[gr->op];
            advance_group(g, gr, k);
            gr->tc = gr->tc_unit * W;
            double t0 = gr->tc > gr->tm0 ? gr->tc : gr->tm0;
            double d = t0 > 0 ? k->mb / t0 : 0.0;
            g->demand += (d - gr->demand) * gr->n;
            gr->demand = d;
        }
    }
    /* Pass 2: the device's bandwidth shared by every running block; new ends, and each
       touched SM's one event at its earliest group's end. */
    double scale = g->demand > g->bw ? g->demand / g->bw : 1.0;
    for (int t = 0; t < nt; t++) {
        int sm = g->touched[t];
        double first = INFINITY;
        for (int gi = g->sm_head[sm]; gi != NIL; gi = g->grps[gi].sm_next) {
            Group *gr = &g->grps[gi];
            double tm = gr->tm0 * scale, core = gr->tc > tm ? gr->tc : tm;
            double T = (g->lmem + core) * gr->jit;
            if (g->lmem >= core)
                gr->bound = B_LATENCY;
            else if (gr->tc >= tm)
                gr->bound = g->mwarps[sm] >= g->wc ? B_COMPUTE : B_LATENCY;
            else
                gr->bound = scale > 1.0 ? B_MEMORY : B_LATENCY;
            if (T != gr->T) {                    /* a new rate: a new end */
                gr->T = T;
                double rest = 1.0 - gr->p;
                gr->end = g->now + (rest > 0 ? rest : 0.0) * T;
            }
            if (gr->end < first)
                first = gr->end;
        }
        if (first != g->sm_end[sm]) {
            g->sm_end[sm] = first;
            g->sm_ver[sm] = ++g->vseq;
            if (first != INFINITY && push_event_v(g, first, EV_SM, sm, 0, g->sm_ver[sm]) < 0)
                return -1;
        }
        g->is_touched[sm] = 0;
    }
    g->ntouched = 0;
    return 0;
}

/* Place blocks of the placeable heads, in launch order, while they fit. A kernel whose last
   block is placed leaves its queue; the op behind it may then start, so passes repeat until
   one changes nothing. The groups' durations are set by settle(), once the instant is over. */
static int dispatch(Gpu *g)
{
    int progressed = 1;
    int snap[1024];
    while (progressed && g->nactive) {
        progressed = 0;
        int n = g->nactive;
        if (n > 1024)
            n = 1024;
        memcpy(snap, g->active, (size_t)n * sizeof(int));
        for (int j = 0; j < n; j++) {
            int ki = snap[j];
            Op *k = &g->ops[ki];
            if (k->blocked && !g->ndirty)
                continue;
            if (place(g, ki) < 0)
                return -1;
            k = &g->ops[ki];
            if (!k->unplaced) {
                remove_active(g, ki);
                int qi = k->stream % g->nq;
                g->qhead[qi] = k->qnext;
                if (g->qhead[qi] == NIL)
                    g->qtail[qi] = NIL;
                if (advance(g, qi) < 0)
                    return -1;
                progressed = 1;
            }
        }
    }
    for (int j = 0; j < g->ndirty; j++)
        g->is_dirty[g->dirty[j]] = 0;
    g->ndirty = 0;
    return 0;
}

/* Settle this instant's placements before time moves on: every block placed at the same
   virtual instant, by any event or submission, sees the others when its duration is set.
   Returns 1 if it finalized (the timing model's work: the self-log counts it), 0 if
   there was nothing to settle, -1 on error. */
static inline int settle(Gpu *g)
{
    clean_top(g);
    if ((g->npend || g->ntouched) && (!g->nheap || g->heap[0].t > g->now)) {
        if (finalize(g) < 0)
            return -1;
        clean_top(g);
        return 1;
    }
    return 0;
}

/* -- events ------------------------------------------------------------------------------ */
/* Synthetic groups placed together end together (one event). */
static int groups_done(Gpu *g, int ki, int first)
{
    Op *k = &g->ops[ki];
    int sh = k->shape;
    int64_t ended = 0;
    for (int i = first; i != NIL; i = g->grps[i].next) {
        Group *gr = &g->grps[i];
        sm_give(g, gr->sm, sh, gr->n, gr->split);
        mark_dirty(g, gr->sm);
        ended += gr->n;
    }
    int64_t c0 = k->ended, end = c0 + ended;
    k->ended = end;
    int err = 0;
    if (k->instrumented && (end - end % k->group > c0 || end == k->total))
        err = post(g, g->done_bits, k, first, c0);
    for (int i = first; i != NIL;) {
        int nx = g->grps[i].next;
        g->grps[i].next = g->free_grp;
        g->free_grp = i;
        i = nx;
    }
    if (err < 0)
        return -1;
    g->events++;
    g->area += (double)g->resident * (g->now - g->last_t);
    g->last_t = g->now;
    g->resident -= ended;
    if (k->ended == k->total && complete(g, ki) < 0)
        return -1;
    return dispatch(g);
}

/* A modelled group's end: its SM's other groups are re-timed when the instant settles
   (its SM's event moves then). */
static int group_done(Gpu *g, int ki, int gi)
{
    Op *k = &g->ops[ki];
    Group *gr = &g->grps[gi];
    advance_group(g, gr, k);
    int sm = gr->sm, n = gr->n, sh = k->shape;
    if (gr->sm_prev != NIL)
        g->grps[gr->sm_prev].sm_next = gr->sm_next;
    else
        g->sm_head[sm] = gr->sm_next;
    if (gr->sm_next != NIL)
        g->grps[gr->sm_next].sm_prev = gr->sm_prev;
    sm_give(g, sm, sh, n, gr->split);
    mark_dirty(g, sm);
    g->mwarps[sm] -= n * g->sh_warps[sh];
    g->demand -= gr->demand * n;
    touch(g, sm);
    gr->next = NIL;
    int64_t c0 = k->ended, end = c0 + n;
    k->ended = end;
    int err = 0;
    if (k->instrumented && (end - end % k->group > c0 || end == k->total))
        err = post(g, g->done_bits, k, gi, c0);
    gr->next = g->free_grp;
    g->free_grp = gi;
    if (err < 0)
        return -1;
    g->events++;
    g->area += (double)g->resident * (g->now - g->last_t);
    g->last_t = g->now;
    g->resident -= n;
    g->mresident -= n;
    if (!g->mresident)
        g->demand = 0.0;                     /* no drift: an empty device demands nothing */
    if (k->ended == k->total && complete(g, ki) < 0)
        return -1;
    return dispatch(g);
}

static int copy_done(Gpu *g, int i)
{
    g->events++;
    Op *o = &g->ops[i];
    int e = o->kind;
    g->ehead[e] = o->enext;
    if (g->ehead[e] == NIL)
        g->etail[e] = NIL;
    else if (start_copy(g, g->ehead[e]) < 0)
        return -1;
    if (complete(g, i) < 0)
        return -1;
    return dispatch(g);
}

static int submit(Gpu *g, int i);
static int new_kernel(Gpu *g, int sh, long long blocks, double flops, double nbytes, double duration,
                      int stream, uint32_t lid, int instr, int group, PyObject *cb);

static int arrival(Gpu *g)
{
    double t = g->b_t[g->b_i];
    while (g->b_i < g->b_n && g->b_t[g->b_i] == t) {
        Py_ssize_t r = g->b_i++;
        if (new_kernel(g, g->b_shape, g->b_blocks, g->b_flops, g->b_bytes, g->b_duration,
                       g->b_stream[r], g->b_lid[r], g->b_instr, g->b_group, NULL) < 0)
            return -1;
    }
    if (g->b_i < g->b_n)
        return push_event(g, g->b_t[g->b_i], EV_ARRIVAL, 0, 0);
    return 0;
}

/* Run the callbacks of completed ops, in completion order. A callback may submit more
   work; nested submissions leave their callbacks to this loop. */
static int flush(Gpu *g)
{
    if (g->flushing)
        return 0;
    g->flushing = 1;
    while (g->dhead < g->dtail) {
        int i = g->defer[g->dhead++];
        Op *o = &g->ops[i];
        PyObject *action = o->action, *cb = o->cb;
        void *land_dst = o->land_dst;
        const void *land_src = o->land_src;
        size_t land_n = (size_t)o->nbytes;
        void (*fn)(void *, uint64_t) = o->fn;
        void *fn_ctx = o->fn_ctx;
        uint64_t fn_tag = o->fn_tag;
        int kind = o->kind;
        double begin = o->t_first, end = o->t_done, issued = o->t_issue;
        op_free(g, i);
        int bad = 0;
        if (g->logging && kind != K_MARKER && kind != K_GATE) {
            /* a kernel from its issue (its launch latency is the device's time) */
            double v[3] = {kind == K_KERNEL ? issued : begin, end, (double)kind};
            if (lg_append(&g->lg_ops, &g->lg_nops, &g->lg_capops, v, 3) < 0)
                bad = 1;
        }
        if (g->trace && kind != K_MARKER && kind != K_GATE) {
            PyObject *r = PyObject_CallFunction(g->trace, "idd", kind, begin, end);
            if (r == NULL)
                bad = 1;
            Py_XDECREF(r);
        }
        if (action) {
            if (!bad) {
                PyObject *r = PyObject_CallNoArgs(action);
                if (r == NULL)
                    bad = 1;
                Py_XDECREF(r);
            }
            Py_DECREF(action);
        }
        if (cb) {
            if (!bad) {
                PyObject *r = PyObject_CallNoArgs(cb);
                if (r == NULL)
                    bad = 1;
                Py_XDECREF(r);
            }
            Py_DECREF(cb);
        }
        if (land_dst != NULL)                /* the C API's copies: as `action` above */
            memcpy(land_dst, land_src, land_n);
        if (fn != NULL)
            fn(fn_ctx, fn_tag);
        if (bad) {
            g->flushing = 0;
            return -1;
        }
    }
    g->dhead = g->dtail = 0;
    g->flushing = 0;
    return 0;
}

/* The SM's earliest groups end: every modelled group on it whose end is now. */
static int sm_done(Gpu *g, int sm)
{
    g->sm_end[sm] = INFINITY;                /* settle() gives the SM its next event */
    touch(g, sm);
    int gi = g->sm_head[sm];
    while (gi != NIL) {
        int nx = g->grps[gi].sm_next;
        if (g->grps[gi].end == g->now && group_done(g, g->grps[gi].op, gi) < 0)
            return -1;
        gi = nx;
    }
    return 0;
}

static int fire(Gpu *g)
{
    Event e = pop_event(g);
    if (e.type == EV_SM && g->sm_ver[e.a] != e.ver)
        return 0;                            /* re-timed since: a later event stands */
    g->now = e.t;
    int r;
    switch (e.type) {
    case EV_SM:
        r = sm_done(g, e.a);
        break;
    case EV_GROUPS:
        r = groups_done(g, e.a, e.b);
        break;
    case EV_COPY:
        r = copy_done(g, e.a);
        break;
    case EV_READY:
        insert_active(g, e.a);
        r = dispatch(g);
        break;
    default:
        r = arrival(g);
        if (r == 0)
            r = dispatch(g);
        break;
    }
    if (r < 0)
        return -1;
    return flush(g);
}

/* -- submission ------------------------------------------------------------------------- */
static int submit(Gpu *g, int i)
{
    Op *o = &g->ops[i];
    o->seq = ++g->opseq;
    o->t_submit = g->now;
    int st = o->stream, qi = st % g->nq;
    if (g->stail[st] == NIL)
        g->shead[st] = i;
    else
        g->ops[g->stail[st]].snext = i;
    g->stail[st] = i;
    g->scount[st]++;
    if (g->qtail[qi] == NIL) {
        g->qhead[qi] = g->qtail[qi] = i;
        if (advance(g, qi) < 0)
            return -1;
        return dispatch(g);
    }
    g->ops[g->qtail[qi]].qnext = i;
    g->qtail[qi] = i;
    return 0;
}

static int new_kernel(Gpu *g, int sh, long long blocks, double flops, double nbytes, double duration,
                      int stream, uint32_t lid, int instr, int group, PyObject *cb)
{
    int i = op_alloc(g);
    if (i == NIL)
        return -1;
    Op *k = &g->ops[i];
    k->kind = K_KERNEL;
    k->stream = stream;
    k->shape = sh;
    k->total = k->unplaced = blocks;
    k->fb = flops / (double)blocks;
    k->mb = nbytes / (double)blocks;
    k->duration = duration;
    if (duration >= 0) {
        long long per_wave = (long long)g->sh_per_sm[sh] * g->n_sm;
        long long waves = (blocks + per_wave - 1) / per_wave;
        k->block_time = duration / (double)waves;
    }
    k->launch_id = lid;
    k->instrumented = (uint8_t)instr;
    k->group = group;
    Py_XINCREF(cb);
    k->cb = cb;
    return submit(g, i);
}

/* -- Python interface ------------------------------------------------------------------- */
static int check_stream(Gpu *g, int stream)
{
    if (stream < 0 || stream >= g->n_streams) {
        PyErr_Format(PyExc_ValueError, "stream %d is not one of the engine's %d streams", stream,
                     g->n_streams);
        return -1;
    }
    return 0;
}

static PyObject *Gpu_launch(Gpu *g, PyObject *const *args, Py_ssize_t nargs)
{
    /* launch(shape, blocks, flops, bytes, duration|None, stream, launch_id, instrumented,
              group, on_complete|None) */
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "launch takes 10 arguments");
        return NULL;
    }
    int sh = (int)PyLong_AsLong(args[0]);
    long long blocks = PyLong_AsLongLong(args[1]);
    double flops = PyFloat_AsDouble(args[2]), nbytes = PyFloat_AsDouble(args[3]);
    double duration = args[4] == Py_None ? -1.0 : PyFloat_AsDouble(args[4]);
    int stream = (int)PyLong_AsLong(args[5]);
    unsigned long lid = PyLong_AsUnsignedLong(args[6]);
    int instr = PyObject_IsTrue(args[7]);
    int group = (int)PyLong_AsLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (sh < 0 || sh >= g->nshapes || blocks < 1 || group < 1 || check_stream(g, stream) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "launch: bad shape, block count or group");
        return NULL;
    }
    if (g->sh_per_sm[sh] < 1) {
        PyErr_SetString(PyExc_ValueError, "launch: not even one block of this shape fits on an SM");
        return NULL;
    }
    PyObject *cb = args[9] == Py_None ? NULL : args[9];
    double t0 = g->logging ? mono_now() : 0.0;
    if (new_kernel(g, sh, blocks, flops, nbytes, duration, stream, (uint32_t)lid, instr, group, cb) < 0
        || flush(g) < 0 || (g->logging && lg_sim(g, t0) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Gpu_copy(Gpu *g, PyObject *args)
{
    int kind, stream;
    long long nbytes;
    PyObject *action, *cb;
    if (!PyArg_ParseTuple(args, "iiLOO", &kind, &stream, &nbytes, &action, &cb))
        return NULL;
    if ((kind != K_H2D && kind != K_D2H) || nbytes < 0 || check_stream(g, stream) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "copy: bad kind or size");
        return NULL;
    }
    int i = op_alloc(g);
    if (i == NIL)
        return NULL;
    Op *o = &g->ops[i];
    o->kind = kind;
    o->stream = stream;
    o->nbytes = nbytes;
    if (action != Py_None) {
        Py_INCREF(action);
        o->action = action;
    }
    if (cb != Py_None) {
        Py_INCREF(cb);
        o->cb = cb;
    }
    double t0 = g->logging ? mono_now() : 0.0;
    if (submit(g, i) < 0 || flush(g) < 0 || (g->logging && lg_sim(g, t0) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Gpu_marker(Gpu *g, PyObject *args)
{
    int stream;
    PyObject *cb;
    if (!PyArg_ParseTuple(args, "iO", &stream, &cb) || check_stream(g, stream) < 0)
        return NULL;
    int i = op_alloc(g);
    if (i == NIL)
        return NULL;
    Op *o = &g->ops[i];
    o->kind = K_MARKER;
    o->stream = stream;
    if (cb != Py_None) {
        Py_INCREF(cb);
        o->cb = cb;
    }
    if (submit(g, i) < 0 || flush(g) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A gate's handle, (seq << 32) | slot as a Python int: the slot finds the op, and its
   sequence number, unique for the engine's life (ops are numbered at submission, never
   renumbered), tells the gate from a later op in the same slot, so a stale handle cannot
   open another op. Slots stay below 2**31 (capops is an int); the number may outgrow 32
   bits, hence Python arithmetic rather than a uint64_t. */
static PyObject *gate_handle(uint64_t seq, int slot)
{
    PyObject *hi = PyLong_FromUnsignedLongLong(seq), *lo = PyLong_FromLong(slot);
    PyObject *shift = PyLong_FromLong(32), *h = NULL;
    if (hi && lo && shift) {
        PyObject *t = PyNumber_Lshift(hi, shift);
        if (t) {
            h = PyNumber_Or(t, lo);
            Py_DECREF(t);
        }
    }
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(shift);
    return h;
}

/* gate_handle's inverse. A handle no engine could give (negative, a number beyond 64 bits)
   comes back as seq 0, which no op has; not an int: TypeError. */
static int gate_parse(PyObject *arg, uint64_t *seq, long *slot)
{
    PyObject *h = PyNumber_Index(arg);
    if (h == NULL)
        return -1;
    PyObject *base = PyLong_FromUnsignedLongLong(1ULL << 32);
    PyObject *qr = base ? PyNumber_Divmod(h, base) : NULL;   /* remainder in [0, 2**32) */
    Py_DECREF(h);
    Py_XDECREF(base);
    if (qr == NULL)
        return -1;
    *seq = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(qr, 0));
    *slot = PyLong_AsLong(PyTuple_GET_ITEM(qr, 1));
    Py_DECREF(qr);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        *seq = 0;
    }
    return 0;
}

static PyObject *Gpu_gate(Gpu *g, PyObject *args)
{
    int stream, notify = 0;
    if (!PyArg_ParseTuple(args, "i|p", &stream, &notify) || check_stream(g, stream) < 0)
        return NULL;
    int i = op_alloc(g);
    if (i == NIL)
        return NULL;
    Op *o = &g->ops[i];
    o->kind = K_GATE;
    o->stream = stream;
    o->notify = (uint8_t)notify;
    g->ngates++;
    g->sgates[stream]++;
    if (submit(g, i) < 0)
        return NULL;
    if (g->ops[i].notify && g->shead[stream] == i && gate_reached(g, i) < 0)
        return NULL;                         /* (its stream was idle: at its head at once) */
    /* the handle before flush: a callback run there may submit (and move the ops array) */
    uint64_t seq = g->ops[i].seq;
    if (flush(g) < 0)
        return NULL;
    return gate_handle(seq, i);
}

static PyObject *Gpu_open(Gpu *g, PyObject *arg)
{
    uint64_t seq;
    long slot;
    if (gate_parse(arg, &seq, &slot) < 0)
        return NULL;
    Op *o = slot < g->capops ? &g->ops[slot] : NULL;
    /* Never a handle of this engine: no op has that number yet, or the slot holds that very
       op and it is no gate, or the slot holds an older op, which has held it since before
       the handle's op was numbered (a slot changes hands only when its op is freed). */
    if (seq == 0 || seq > g->opseq || o == NULL
        || (o->kind != K_FREE && (o->seq < seq || (o->seq == seq && o->kind != K_GATE)))) {
        PyErr_SetString(PyExc_ValueError, "open: not the handle of a gate of this engine");
        return NULL;
    }
    if (o->kind != K_GATE || o->seq != seq || o->done)
        Py_RETURN_FALSE;                     /* completed; its slot may be free or reused */
    o->opened = 1;
    int st = o->stream, qi = st % g->nq;
    if (g->qhead[qi] == (int)slot && g->shead[st] == (int)slot) {
        /* Blocking now: it completes at this instant and what waited behind it starts, as
           when a marker reaches the head; callbacks run as after a submission. Not yet at
           the head: advance completes it on arrival, as a marker. */
        if (advance(g, qi) < 0 || dispatch(g) < 0 || flush(g) < 0)
            return NULL;
    }
    Py_RETURN_TRUE;
}

static PyObject *Gpu_bulk(Gpu *g, PyObject *args)
{
    /* bulk(times, streams, launch_ids, shape, blocks, flops, bytes, duration|None,
            instrumented, group): launch one kernel per row at times[row] (non-decreasing). */
    Py_buffer bt, bs, bl;
    int sh, instr, group;
    long long blocks;
    double flops, nbytes;
    PyObject *dur;
    if (g->b_i < g->b_n) {
        PyErr_SetString(PyExc_RuntimeError, "bulk: a previous bulk submission is still running");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*y*y*iLddOpi", &bt, &bs, &bl, &sh, &blocks, &flops, &nbytes, &dur,
                          &instr, &group))
        return NULL;
    Py_ssize_t n = bt.len / (Py_ssize_t)sizeof(double);
    PyObject *res = NULL;
    if (bs.len != n * (Py_ssize_t)sizeof(int32_t) || bl.len != n * (Py_ssize_t)sizeof(uint32_t)
        || sh < 0 || sh >= g->nshapes || blocks < 1 || group < 1) {
        PyErr_SetString(PyExc_ValueError, "bulk: float64 times, int32 streams, uint32 ids of one "
                                          "length, a known shape, blocks >= 1, group >= 1");
        goto done;
    }
    PyMem_Free(g->b_t);
    PyMem_Free(g->b_stream);
    PyMem_Free(g->b_lid);
    g->b_t = PyMem_Malloc(n * sizeof(double) + 1);
    g->b_stream = PyMem_Malloc(n * sizeof(int32_t) + 1);
    g->b_lid = PyMem_Malloc(n * sizeof(uint32_t) + 1);
    if (!g->b_t || !g->b_stream || !g->b_lid) {
        PyErr_NoMemory();
        g->b_n = g->b_i = 0;
        goto done;
    }
    memcpy(g->b_t, bt.buf, n * sizeof(double));
    memcpy(g->b_stream, bs.buf, n * sizeof(int32_t));
    memcpy(g->b_lid, bl.buf, n * sizeof(uint32_t));
    for (Py_ssize_t r = 0; r < n; r++) {
        if ((r && g->b_t[r] < g->b_t[r - 1]) || g->b_t[r] < g->now || g->b_stream[r] < 0
            || g->b_stream[r] >= g->n_streams) {
            PyErr_SetString(PyExc_ValueError, "bulk: times must be non-decreasing and not in the "
                                              "past, streams in range");
            g->b_n = g->b_i = 0;
            goto done;
        }
    }
    g->b_i = 0;
    g->b_n = n;
    g->b_shape = sh;
    g->b_blocks = blocks;
    g->b_flops = flops;
    g->b_bytes = nbytes;
    g->b_duration = dur == Py_None ? -1.0 : PyFloat_AsDouble(dur);
    g->b_instr = instr;
    g->b_group = group;
    if (n && push_event(g, g->b_t[0], EV_ARRIVAL, 0, 0) < 0)
        goto done;
    res = Py_None;
    Py_INCREF(res);
done:
    PyBuffer_Release(&bt);
    PyBuffer_Release(&bs);
    PyBuffer_Release(&bl);
    return res;
}

static PyObject *Gpu_shape(Gpu *g, PyObject *args)
{
    int warps, rpw;
    long long smem;
    if (!PyArg_ParseTuple(args, "iiL", &warps, &rpw, &smem))
        return NULL;
    if (warps < 1 || rpw < 0 || smem < 0) {
        PyErr_SetString(PyExc_ValueError, "shape: warps >= 1, registers and shared memory >= 0");
        return NULL;
    }
    int i = g->nshapes;
    int cap = g->capshapes;
    if (grow((void **)&g->sh_warps, &cap, i + 1, sizeof(int)) < 0)
        return NULL;
    cap = g->capshapes;
    if (grow((void **)&g->sh_rpw, &cap, i + 1, sizeof(int)) < 0)
        return NULL;
    cap = g->capshapes;
    if (grow((void **)&g->sh_per_sm, &cap, i + 1, sizeof(int)) < 0)
        return NULL;
    cap = g->capshapes;
    if (grow((void **)&g->sh_smem, &cap, i + 1, sizeof(long long)) < 0)
        return NULL;
    g->capshapes = cap;
    g->sh_warps[i] = warps;
    g->sh_rpw[i] = rpw;
    g->sh_smem[i] = smem;
    /* Blocks per SM on an empty SM: min over the four limits (occupancy.limits_per_resource). */
    int n = g->max_blocks, x = g->max_warps / warps;
    if (x < n)
        n = x;
    if (smem && g->smem_per_sm / smem < n)
        n = (int)(g->smem_per_sm / smem);
    if (rpw) {
        long long rw = (g->part_regs / rpw) * g->parts;
        if (rw / warps < n)
            n = (int)(rw / warps);
    }
    g->sh_per_sm[i] = n;
    g->nshapes++;
    return PyLong_FromLong(i);
}

static int sm_args(Gpu *g, int sm, int sh)
{
    if (sm < 0 || sm >= g->n_sm || sh < 0 || sh >= g->nshapes) {
        PyErr_SetString(PyExc_ValueError, "no such SM or shape");
        return -1;
    }
    return 0;
}

static PyObject *Gpu_fit(Gpu *g, PyObject *args)
{
    int sm, sh;
    if (!PyArg_ParseTuple(args, "ii", &sm, &sh) || sm_args(g, sm, sh) < 0)
        return NULL;
    return PyLong_FromLong(sm_fit(g, sm, sh));
}

static PyObject *Gpu_take(Gpu *g, PyObject *args)
{
    int sm, sh, n;
    if (!PyArg_ParseTuple(args, "iii", &sm, &sh, &n) || sm_args(g, sm, sh) < 0)
        return NULL;
    if (n < 0 || sm_fit(g, sm, sh) < n) {
        PyErr_SetString(PyExc_AssertionError, "take() called for blocks that do not fit; call fit() first");
        return NULL;
    }
    uint8_t split[MAX_PARTS];
    sm_take(g, sm, sh, n, split);
    PyObject *t = PyTuple_New(g->parts);
    if (t == NULL)
        return NULL;
    for (int p = 0; p < g->parts; p++)
        PyTuple_SET_ITEM(t, p, PyLong_FromLong(split[p]));
    return t;
}

static PyObject *Gpu_give(Gpu *g, PyObject *args)
{
    int sm, sh, n;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iiiO", &sm, &sh, &n, &seq) || sm_args(g, sm, sh) < 0)
        return NULL;
    uint8_t split[MAX_PARTS] = {0};
    PyObject *fast = PySequence_Fast(seq, "split must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t p = 0; p < m && p < MAX_PARTS; p++)
        split[p] = (uint8_t)PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, p));
    Py_DECREF(fast);
    if (PyErr_Occurred())
        return NULL;
    sm_give(g, sm, sh, n, split);
    Py_RETURN_NONE;
}

static PyObject *int_list(const int *a, Py_ssize_t n)
{
    PyObject *l = PyList_New(n);
    for (Py_ssize_t i = 0; l && i < n; i++)
        PyList_SET_ITEM(l, i, PyLong_FromLong(a[i]));
    return l;
}

static PyObject *ll_list(const long long *a, Py_ssize_t n)
{
    PyObject *l = PyList_New(n);
    for (Py_ssize_t i = 0; l && i < n; i++)
        PyList_SET_ITEM(l, i, PyLong_FromLongLong(a[i]));
    return l;
}

static PyObject *Gpu_state(Gpu *g, PyObject *Py_UNUSED(x))
{
    /* (free blocks, free warps, free shared memory, free registers per sub-partition) */
    return Py_BuildValue("(NNNN)", int_list(g->fblocks, g->n_sm), int_list(g->fwarps, g->n_sm),
                         ll_list(g->fsmem, g->n_sm), ll_list(g->fregs, (Py_ssize_t)g->n_sm * g->parts));
}

static PyObject *Gpu_peek(Gpu *g, PyObject *Py_UNUSED(x))
{
    if ((g->npend || g->ntouched) && finalize(g) < 0)   /* new ends may come first */
        return NULL;
    clean_top(g);
    return PyFloat_FromDouble(g->nheap ? g->heap[0].t : INFINITY);
}

static PyObject *Gpu_step(Gpu *g, PyObject *Py_UNUSED(x))
{
    if (settle(g) < 0)
        return NULL;
    if (!g->nheap) {
        PyErr_SetString(PyExc_IndexError, "step: no event is scheduled");
        return NULL;
    }
    if (fire(g) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Gpu_run_until(Gpu *g, PyObject *arg)
{
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    if (t < g->now) {
        char msg[120];
        snprintf(msg, sizeof msg, "time cannot go backwards (%.17g < now %.17g)", t, g->now);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    uint64_t before = g->observed;
    for (;;) {
        if (settle(g) < 0)
            return NULL;
        if (!g->nheap || g->heap[0].t > t)
            break;
        if (fire(g) < 0)
            return NULL;
    }
    g->now = t;
    return PyBool_FromLong(g->observed != before);
}

static PyObject *Gpu_run_until_observed(Gpu *g, PyObject *arg)
{
    /* Fire events up to time t, but stop after the first instant in which a host could
       observe something (a notifQ entry written, an op completed), once every event of
       that instant has fired. Returns True if it stopped there; False, with the clock at
       t, if nothing observable happened by t. */
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    if (t < g->now) {
        PyErr_SetString(PyExc_ValueError, "time cannot go backwards");
        return NULL;
    }
    uint64_t before = g->observed;
    for (;;) {
        if (settle(g) < 0)
            return NULL;
        if (!g->nheap || g->heap[0].t > t)
            break;
        if (fire(g) < 0)
            return NULL;
        if (g->observed != before) {
            /* finish the instant, as run_until(now) would */
            for (;;) {
                clean_top(g);
                if (!g->nheap || g->heap[0].t > g->now)
                    break;
                if (fire(g) < 0)
                    return NULL;
            }
            Py_RETURN_TRUE;
        }
    }
    if (t != INFINITY)
        g->now = t;
    Py_RETURN_FALSE;
}

static int api_sync_wall(PyObject *o, double t0, double speed);

static PyObject *Gpu_poll_wall(Gpu *g, PyObject *const *args, Py_ssize_t nargs)
{
    /* poll_wall(t0, speed): real time: fire every event due by the wall clock
       ((CLOCK_MONOTONIC - t0) * speed, the clock time.perf_counter reads on Linux). One C
       call per poll of the dispatcher loop: the loop polls far more often than anything
       is due, so the call's own cost is most of what the simulator costs in real time. */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "poll_wall(t0, speed)");
        return NULL;
    }
    double t0 = PyFloat_AsDouble(args[0]), speed = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred() || api_sync_wall((PyObject *)g, t0, speed) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Gpu_run(Gpu *g, PyObject *Py_UNUSED(x))
{
    for (;;) {
        if (settle(g) < 0)
            return NULL;
        if (!g->nheap)
            break;
        if (fire(g) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Gpu_busy(Gpu *g, PyObject *Py_UNUSED(x))
{
    for (int s = 0; s < g->n_streams; s++)
        if (g->scount[s])
            Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *Gpu_set_priority(Gpu *g, PyObject *args)
{
    int stream, prio;
    if (!PyArg_ParseTuple(args, "ii", &stream, &prio) || check_stream(g, stream) < 0)
        return NULL;
    if (prio < -64 || prio > 64) {
        PyErr_Format(PyExc_ValueError, "stream priority %d is outside -64..64", prio);
        return NULL;
    }
    g->sprio[stream] = prio;
    Py_RETURN_NONE;
}

/* A stream argument: its index, or -1 with an exception set. */
static int stream_arg(Gpu *g, PyObject *arg)
{
    long s = PyLong_AsLong(arg);
    if (s == -1 && PyErr_Occurred())
        return -1;
    if (s < 0 || s >= g->n_streams) {        /* (compared as a long: no wrap to a valid int) */
        PyErr_Format(PyExc_ValueError, "stream %ld is not one of the engine's %d streams", s,
                     g->n_streams);
        return -1;
    }
    return (int)s;
}

/* Whether a gate is in `stream` (an answer the host is waiting for holds what is behind
   it): the kernel cores give new jobs another stream meanwhile (issue 37). */
static PyObject *Gpu_stream_gated(Gpu *g, PyObject *arg)
{
    int s = stream_arg(g, arg);
    return s < 0 ? NULL : PyBool_FromLong(g->sgates[s] > 0);
}

static PyObject *Gpu_stream_idle(Gpu *g, PyObject *arg)
{
    int s = stream_arg(g, arg);
    return s < 0 ? NULL : PyBool_FromLong(g->scount[s] == 0);
}

static PyObject *Gpu_mean_resident(Gpu *g, PyObject *args)
{
    /* Time-averaged resident blocks since an (area, time) snapshot, up to now. */
    double since_area = 0.0, since_t = 0.0;
    if (!PyArg_ParseTuple(args, "|dd", &since_area, &since_t))
        return NULL;
    double area = g->area + (double)g->resident * (g->now - g->last_t);
    if (g->now > since_t)
        return PyFloat_FromDouble((area - since_area) / (g->now - since_t));
    return PyFloat_FromDouble((double)g->resident);
}

static PyObject *Gpu_area_snapshot(Gpu *g, PyObject *Py_UNUSED(x))
{
    return Py_BuildValue("(dd)", g->area + (double)g->resident * (g->now - g->last_t), g->now);
}

static PyObject *Gpu_get_now(Gpu *g, void *c) { return PyFloat_FromDouble(g->now); }

static PyObject *Gpu_get_record(Gpu *g, void *c)
{
    PyObject *r = g->record ? g->record : Py_None;
    Py_INCREF(r);
    return r;
}

static PyObject *Gpu_get_trace(Gpu *g, void *c)
{
    PyObject *r = g->trace ? g->trace : Py_None;
    Py_INCREF(r);
    return r;
}

static int Gpu_set_trace(Gpu *g, PyObject *v, void *c)
{
    if (v != NULL && v != Py_None && !PyCallable_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "trace must be callable or None");
        return -1;
    }
    Py_CLEAR(g->trace);
    if (v != NULL && v != Py_None) {
        Py_INCREF(v);
        g->trace = v;
    }
    return 0;
}

static int Gpu_set_record(Gpu *g, PyObject *v, void *c)
{
    if (v != NULL && v != Py_None && !PyList_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "record must be a list or None");
        return -1;
    }
    Py_CLEAR(g->record);
    if (v != NULL && v != Py_None) {
        Py_INCREF(v);
        g->record = v;
    }
    return 0;
}

#define LL_GETTER(field)                                                                        \
    static PyObject *Gpu_get_##field(Gpu *g, void *c) { return PyLong_FromLongLong(g->field); }
LL_GETTER(resident)
LL_GETTER(placements)
LL_GETTER(events)

static PyObject *Gpu_get_tail(Gpu *g, void *c) { return PyLong_FromUnsignedLongLong(g->tail); }
static PyObject *Gpu_get_demand(Gpu *g, void *c) { return PyFloat_FromDouble(g->demand); }
static PyObject *Gpu_get_nheap(Gpu *g, void *c) { return PyLong_FromLong(g->nheap); }
static PyObject *Gpu_get_gates(Gpu *g, void *c) { return PyLong_FromLongLong(g->ngates); }

/* The handles of the notifying gates that reached their stream's head since the last call
   (and are still closed then), oldest first. */
static PyObject *Gpu_reached(Gpu *g, PyObject *unused)
{
    PyObject *r = g->reached;
    g->reached = NULL;
    return r != NULL ? r : PyList_New(0);
}

static PyObject *Gpu_get_logging(Gpu *g, void *c)
{
    return PyBool_FromLong(g->logging);
}

static int Gpu_set_logging(Gpu *g, PyObject *v, void *c)
{
    int on = v == NULL ? 0 : PyObject_IsTrue(v);
    if (on < 0)
        return -1;
    g->logging = on;
    return 0;
}

static PyObject *Gpu_log_work(Gpu *g, PyObject *arg)
{
    /* log_work(t0): the simulated device worked, in Python, from t0 (CLOCK_MONOTONIC,
       time.perf_counter on Linux) until now: into the self-log (while logging). */
    double t0 = PyFloat_AsDouble(arg);
    if (t0 == -1.0 && PyErr_Occurred())
        return NULL;
    if (g->logging && lg_sim(g, t0) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Gpu_log_take(Gpu *g, PyObject *Py_UNUSED(x))
{
    PyObject *r = Py_BuildValue("(y#y#)", (const char *)g->lg_ops,
                                g->lg_nops * (Py_ssize_t)sizeof(double),
                                (const char *)g->lg_sim, g->lg_nsim * (Py_ssize_t)sizeof(double));
    if (r != NULL)
        g->lg_nops = g->lg_nsim = 0;
    return r;
}

static PyGetSetDef Gpu_getset[] = {
    {"logging", (getter)Gpu_get_logging, (setter)Gpu_set_logging,
     "the self-log is on (Gpu.log_take): what an experiment uses to tell the simulator's own "
     "work and the device's busy time from the dispatcher's, with no Python call per entry", NULL},
    {"now", (getter)Gpu_get_now, NULL, "virtual time, seconds", NULL},
    {"resident", (getter)Gpu_get_resident, NULL, "resident blocks", NULL},
    {"placements", (getter)Gpu_get_placements, NULL, "blocks placed so far", NULL},
    {"events", (getter)Gpu_get_events, NULL, "block-group completions and copies so far", NULL},
    {"tail", (getter)Gpu_get_tail, NULL, "notifQ entries written so far", NULL},
    {"demand", (getter)Gpu_get_demand, NULL, "DRAM bytes/s the running blocks demand", NULL},
    {"pending_events", (getter)Gpu_get_nheap, NULL, "events scheduled", NULL},
    {"gates", (getter)Gpu_get_gates, NULL, "gates submitted and not yet completed", NULL},
    {"record", (getter)Gpu_get_record, (setter)Gpu_set_record,
     "None, or a list that receives one tuple per completed kernel (profiling)", NULL},
    {"trace", (getter)Gpu_get_trace, (setter)Gpu_set_trace,
     "None, or trace(kind, begin, end), called for every kernel and copy as it completes, "
     "before its own callbacks (device times)", NULL},
    {NULL}};

static PyMethodDef Gpu_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))Gpu_launch, METH_FASTCALL, "submit a kernel"},
    {"copy", (PyCFunction)Gpu_copy, METH_VARARGS, "submit a copy (kind, stream, nbytes, action, cb)"},
    {"marker", (PyCFunction)Gpu_marker, METH_VARARGS, "submit an event marker (stream, cb)"},
    {"gate", (PyCFunction)Gpu_gate, METH_VARARGS,
     "submit a closed gate (stream, notify=False): holds the ops behind it until opened; "
     "returns its handle; notify: Gpu.reached() lists it once it is its stream's head"},
    {"open", (PyCFunction)Gpu_open, METH_O,
     "open a gate by handle: True if it was live, False if it had already completed"},
    {"log_work", (PyCFunction)Gpu_log_work, METH_O,
     "log_work(t0): the device's own work in Python (its functional model) from t0 "
     "(CLOCK_MONOTONIC) until now, into the self-log while logging"},
    {"log_take", (PyCFunction)Gpu_log_take, METH_NOARGS,
     "the self-log since the last call, as (ops, sim) bytes of float64: (start, end, kind) "
     "per completed kernel and copy, device time; (start, end) per stretch of the "
     "simulator's own work, CLOCK_MONOTONIC; see Gpu.logging"},
    {"reached", (PyCFunction)Gpu_reached, METH_NOARGS,
     "handles of the gates submitted with notify=True that reached their stream's head "
     "since the last call"},
    {"bulk", (PyCFunction)Gpu_bulk, METH_VARARGS, "schedule one launch per row at given times"},
    {"shape", (PyCFunction)Gpu_shape, METH_VARARGS, "register a block footprint; returns its id"},
    {"fit", (PyCFunction)Gpu_fit, METH_VARARGS, "blocks of a shape that fit on an SM now"},
    {"take", (PyCFunction)Gpu_take, METH_VARARGS, "allocate blocks on an SM (tests, tools)"},
    {"give", (PyCFunction)Gpu_give, METH_VARARGS, "free blocks on an SM (tests, tools)"},
    {"state", (PyCFunction)Gpu_state, METH_NOARGS, "free resources of every SM"},
    {"peek", (PyCFunction)Gpu_peek, METH_NOARGS, "time of the next event, or inf"},
    {"step", (PyCFunction)Gpu_step, METH_NOARGS, "fire one event"},
    {"run_until", (PyCFunction)Gpu_run_until, METH_O,
     "fire events due by t, then set now to t; True if a host could observe any of them"},
    {"run", (PyCFunction)Gpu_run, METH_NOARGS, "fire events until none is left"},
    {"poll_wall", (PyCFunction)(void (*)(void))Gpu_poll_wall, METH_FASTCALL,
     "real time: fire the events due by (monotonic clock - t0) * speed"},
    {"run_until_observed", (PyCFunction)Gpu_run_until_observed, METH_O,
     "fire events up to t, stopping after the first one a host could observe"},
    {"busy", (PyCFunction)Gpu_busy, METH_NOARGS, "any stream has work"},
    {"stream_idle", (PyCFunction)Gpu_stream_idle, METH_O, "the stream has no work"},
    {"stream_gated", (PyCFunction)Gpu_stream_gated, METH_O,
     "a gate is in the stream (the host holds what is behind it)"},
    {"set_priority", (PyCFunction)Gpu_set_priority, METH_VARARGS,
     "set_priority(stream, priority): lower is more urgent (CUDA's convention), 0 the default"},
    {"mean_resident", (PyCFunction)Gpu_mean_resident, METH_VARARGS, "time-averaged resident blocks"},
    {"area_snapshot", (PyCFunction)Gpu_area_snapshot, METH_NOARGS, "(resident-block area, now)"},
    {NULL}};

static int Gpu_init(Gpu *g, PyObject *args, PyObject *kw)
{
    static char *names[] = {"n_sm", "parts", "max_blocks", "max_warps", "smem_per_sm", "part_regs",
                            "n_queues", "n_streams", "notifq", "place_bits", "done_bits",
                            "count_shift", "sm_shift", "overrun", "sm_flops", "warps_to_hide",
                            "mem_bw", "mem_latency", "warp_bytes_in_flight", "launch_latency",
                            "pcie_latency", "pcie_bw", "seed", "jitter", NULL};
    int n_sm, parts, max_blocks, max_warps, nq, n_streams, count_shift, sm_shift;
    long long smem_per_sm, part_regs;
    unsigned long long place_bits, done_bits, seed;
    PyObject *ring, *exc;
    double psm, wc, bw, lmem, line, llat, plat, pbw, jitter;
    if (g->fblocks) {
        PyErr_SetString(PyExc_RuntimeError, "Gpu.__init__ called twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiLLiiOKKiiOddddddddKd", names, &n_sm, &parts,
                                     &max_blocks, &max_warps, &smem_per_sm, &part_regs, &nq,
                                     &n_streams, &ring, &place_bits, &done_bits, &count_shift,
                                     &sm_shift, &exc, &psm, &wc, &bw, &lmem, &line, &llat, &plat,
                                     &pbw, &seed, &jitter))
        return -1;
    if (n_sm < 1 || n_sm > MAX_SMS || parts < 1 || parts > MAX_PARTS || nq < 1 || nq > 1024
        || n_streams < 1
        || psm <= 0 || wc <= 0 || bw <= 0 || lmem < 0 || line <= 0 || llat < 0 || plat < 0
        || pbw <= 0 || jitter < 0) {
        PyErr_SetString(PyExc_ValueError, "Gpu: parameter out of range");
        return -1;
    }
    if (PyObject_GetBuffer(ring, &g->ring, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    g->has_ring = 1;
    Py_ssize_t slots = g->ring.len / 8;
    if (g->ring.len % 8 || slots < 1 || (slots & (slots - 1))) {
        PyErr_SetString(PyExc_ValueError, "notifQ: a power-of-two number of uint64 slots");
        return -1;
    }
    g->rbuf = (uint64_t *)g->ring.buf;
    g->rmask = (uint64_t)slots - 1;
    g->n_sm = n_sm;
    g->parts = parts;
    g->max_blocks = max_blocks;
    g->max_warps = max_warps;
    g->smem_per_sm = smem_per_sm;
    g->part_regs = part_regs;
    g->nq = nq;
    g->n_streams = n_streams;
    g->place_bits = place_bits;
    g->done_bits = done_bits;
    g->count_shift = count_shift;
    g->sm_shift = sm_shift;
    Py_INCREF(exc);
    g->overrun_exc = exc;
    g->psm = psm;
    g->wc = wc;
    g->bw = bw;
    g->lmem = lmem;
    g->line = line;
    g->launch_lat = llat;
    g->pcie_lat = plat;
    g->pcie_bw = pbw;
    g->jitter = jitter;
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        g->rng[i] = splitmix(&x);
    g->fblocks = PyMem_Calloc(n_sm, sizeof(int));
    g->fwarps = PyMem_Calloc(n_sm, sizeof(int));
    g->mwarps = PyMem_Calloc(n_sm, sizeof(int));
    g->fsmem = PyMem_Calloc(n_sm, sizeof(long long));
    g->fregs = PyMem_Calloc((size_t)n_sm * parts, sizeof(long long));
    g->is_dirty = PyMem_Calloc(n_sm, 1);
    g->dirty = PyMem_Calloc(n_sm, sizeof(int));
    g->qhead = PyMem_Malloc(nq * sizeof(int));
    g->qtail = PyMem_Malloc(nq * sizeof(int));
    g->active = PyMem_Malloc((nq + 1) * sizeof(int));
    g->shead = PyMem_Malloc(n_streams * sizeof(int));
    g->stail = PyMem_Malloc(n_streams * sizeof(int));
    g->scount = PyMem_Calloc(n_streams, sizeof(int));
    g->sgates = PyMem_Calloc(n_streams, sizeof(int));
    g->sprio = PyMem_Calloc(n_streams, sizeof(int));
    g->touched = PyMem_Calloc(n_sm, sizeof(int));
    g->is_touched = PyMem_Calloc(n_sm, 1);
    g->sm_head = PyMem_Malloc(n_sm * sizeof(int));
    g->sm_ver = PyMem_Calloc(n_sm, sizeof(uint64_t));
    g->sm_end = PyMem_Malloc(n_sm * sizeof(double));
    if (!g->fblocks || !g->fwarps || !g->mwarps || !g->fsmem || !g->fregs || !g->is_dirty
        || !g->dirty || !g->qhead || !g->qtail || !g->active || !g->shead || !g->stail
        || !g->scount || !g->sgates || !g->sprio || !g->touched || !g->is_touched || !g->sm_head || !g->sm_ver || !g->sm_end) {
        PyErr_NoMemory();
        return -1;
    }
    for (int s = 0; s < n_sm; s++) {
        g->sm_head[s] = NIL;
        g->sm_end[s] = INFINITY;
        g->fblocks[s] = max_blocks;
        g->fwarps[s] = max_warps;
        g->fsmem[s] = smem_per_sm;
        for (int p = 0; p < parts; p++)
            g->fregs[(long long)s * parts + p] = part_regs;
    }
    for (int q = 0; q < nq; q++)
        g->qhead[q] = g->qtail[q] = NIL;
    for (int s = 0; s < n_streams; s++)
        g->shead[s] = g->stail[s] = NIL;
    for (int e = 0; e < 3; e++)
        g->ehead[e] = g->etail[e] = NIL;
    g->free_op = g->free_grp = NIL;
    return 0;
}

static int Gpu_traverse(Gpu *g, visitproc visit, void *arg)
{
    for (int i = 0; i < g->capops; i++) {
        if (g->ops[i].kind != K_FREE) {
            Py_VISIT(g->ops[i].cb);
            Py_VISIT(g->ops[i].action);
        }
    }
    Py_VISIT(g->record);
    Py_VISIT(g->trace);
    Py_VISIT(g->reached);
    Py_VISIT(g->overrun_exc);
    return 0;
}

static int Gpu_clear(Gpu *g)
{
    for (int i = 0; i < g->capops; i++) {
        if (g->ops[i].kind != K_FREE) {
            Py_CLEAR(g->ops[i].cb);
            Py_CLEAR(g->ops[i].action);
        }
    }
    /* Deferred ops not yet flushed hold their callbacks too (op_free has not run). */
    Py_CLEAR(g->record);
    Py_CLEAR(g->trace);
    Py_CLEAR(g->reached);
    Py_CLEAR(g->overrun_exc);
    return 0;
}

static void Gpu_dealloc(Gpu *g)
{
    PyObject_GC_UnTrack(g);
    Gpu_clear(g);
    if (g->has_ring)
        PyBuffer_Release(&g->ring);
    void *arrays[] = {g->fblocks, g->fwarps, g->mwarps, g->fsmem, g->fregs, g->is_dirty, g->dirty,
                      g->sh_warps, g->sh_rpw, g->sh_per_sm, g->sh_smem, g->ops, g->grps, g->qhead,
                      g->qtail, g->shead, g->stail, g->scount, g->sgates, g->sprio, g->active, g->heap, g->pend,
                      g->defer, g->b_t, g->b_stream, g->b_lid, g->touched, g->is_touched,
                      g->sm_head, g->sm_ver, g->sm_end, g->lg_ops, g->lg_sim};
    for (size_t i = 0; i < sizeof(arrays) / sizeof(arrays[0]); i++)
        PyMem_Free(arrays[i]);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyTypeObject GpuType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher.devices.sim._engine.Gpu",
    .tp_basicsize = sizeof(Gpu),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The simulated GPU's engine (see hardware.py and cost.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gpu_init,
    .tp_dealloc = (destructor)Gpu_dealloc,
    .tp_traverse = (traverseproc)Gpu_traverse,
    .tp_clear = (inquiry)Gpu_clear,
    .tp_methods = Gpu_methods,
    .tp_getset = Gpu_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paella.dispatcher.devices.sim._engine",
    "The simulated GPU's engine in C (hardware.py documents the rules, cost.py the timing).",
    -1, NULL};

/* -- the C API (capi.h): the kernel core's launch, no Python call ------------------------ */
static int api_check(PyObject *o)
{
    if (!PyObject_TypeCheck(o, &GpuType)) {
        PyErr_Format(PyExc_TypeError, "expected an _engine.Gpu, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    return 0;
}

static int api_launch(PyObject *o, int sh, long long blocks, double flops, double nbytes,
                      double duration, int stream, uint32_t lid, int instr, int group)
{
    Gpu *g = (Gpu *)o;
    if (sh < 0 || sh >= g->nshapes || blocks < 1 || group < 1 || check_stream(g, stream) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "launch: bad shape, block count or group");
        return -1;
    }
    if (g->sh_per_sm[sh] < 1) {
        PyErr_SetString(PyExc_ValueError, "launch: not even one block of this shape fits on an SM");
        return -1;
    }
    double t0 = g->logging ? mono_now() : 0.0;
    if (new_kernel(g, sh, blocks, flops, nbytes, duration, stream, lid, instr, group, NULL) < 0
        || flush(g) < 0 || (g->logging && lg_sim(g, t0) < 0))
        return -1;
    return 0;
}

static int api_copy(PyObject *o, int kind, int stream, long long nbytes, void *dst,
                    const void *src, void (*fn)(void *, uint64_t), void *ctx, uint64_t tag)
{
    Gpu *g = (Gpu *)o;
    if ((kind != K_H2D && kind != K_D2H) || nbytes < 0 || check_stream(g, stream) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "copy: bad kind or size");
        return -1;
    }
    int i = op_alloc(g);
    if (i == NIL)
        return -1;
    Op *op = &g->ops[i];
    op->kind = kind;
    op->stream = stream;
    op->nbytes = nbytes;
    op->land_dst = nbytes ? dst : NULL;
    op->land_src = src;
    op->fn = fn;
    op->fn_ctx = ctx;
    op->fn_tag = tag;
    double t0 = g->logging ? mono_now() : 0.0;
    if (submit(g, i) < 0 || flush(g) < 0 || (g->logging && lg_sim(g, t0) < 0))
        return -1;
    return 0;
}

/* Real time: fire every event due by the wall clock (Gpu.poll_wall's body), so that a
   submission made now is timed from now. */
static int api_sync_wall(PyObject *o, double t0, double speed)
{
    Gpu *g = (Gpu *)o;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double entry = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    double t = (entry - t0) * speed;
    if (t < g->now)
        t = g->now;
    int worked = 0;
    for (;;) {
        int s = settle(g);
        if (s < 0)
            return -1;
        worked |= s;
        if (!g->nheap || g->heap[0].t > t)
            break;
        if (fire(g) < 0)
            return -1;
        worked = 1;
    }
    g->now = t;
    /* (nothing fired or settled: the host's poll, not the simulator's work) */
    if (worked && g->logging && lg_sim(g, entry) < 0)
        return -1;
    return 0;
}

static double api_next_time(PyObject *o)
{
    Gpu *g = (Gpu *)o;
    if (g->npend || g->ntouched) {                      /* as Gpu.peek */
        double t0 = g->logging ? mono_now() : 0.0;
        if (finalize(g) < 0 || (g->logging && lg_sim(g, t0) < 0))
            return NAN;
    }
    clean_top(g);
    return g->nheap ? g->heap[0].t : INFINITY;
}

static int api_host_pending(PyObject *o)
{
    return ((Gpu *)o)->reached != NULL;
}

static const int *api_stream_gates(PyObject *o, int *n)
{
    Gpu *g = (Gpu *)o;
    *n = g->n_streams;
    return g->sgates;
}

static PaellaEngineAPI engine_api = {api_check, api_launch, api_copy,
                                     api_sync_wall, api_next_time, api_host_pending,
                                     api_stream_gates};

PyMODINIT_FUNC PyInit__engine(void)
{
    if (PyType_Ready(&GpuType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *api = PyCapsule_New(&engine_api, PAELLA_ENGINE_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(m, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GpuType);
    if (PyModule_AddObject(m, "Gpu", (PyObject *)&GpuType) < 0) {
        Py_DECREF(&GpuType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
