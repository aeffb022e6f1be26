/*
 * The C-to-C interfaces between the dispatcher's compiled modules, exported as capsules
 * (the way numpy exports its C API): the kernel core (_kcore.c) calls the occupancy
 * tracker (_tracker.c) and the simulated GPU's engine (devices/sim/_engine.c) without
 * a Python call, a boxed integer or an attribute lookup per kernel.
 *
 *   paella.dispatcher._tracker._C_API              -> PaellaTrackerAPI
 *   paella.dispatcher.devices.sim._engine._C_API   -> PaellaEngineAPI
 *
 * The objects passed are the modules' own (a Tracker, an _engine.Gpu); each function
 * checks nothing that its Python twin checks once per object (check() does that).
 */
#ifndef PAELLA_CAPI_H
#define PAELLA_CAPI_H
#include <Python.h>
#include <stdint.h>

/* One launch's demand (the tracker's Demand without the object header). */
typedef struct {
    long long blocks, warps, regs, smem, entries;   /* warps/regs/smem: per block */
} PaellaDemand;

/* Called by drain for each launch whose last block completed, in completion order:
   its counter-pair slot, the token given to release (a borrowed reference, released by
   the tracker right after) and when its first block was seen placed. */
typedef void (*paella_done_fn)(void *ctx, int slot, PyObject *tok, double t_first);

typedef struct {
    /* 0 if `t` is a ready Tracker, else -1 with an exception set. */
    int (*check)(PyObject *t);
    /* The +B rule; `pred` (may be NULL): the launch queued ahead on the same stream. */
    int (*admits)(PyObject *t, const PaellaDemand *d, const PaellaDemand *pred);
    int (*flow_ok)(PyObject *t, long long entries);
    /* Would all (whole=1) or one (whole=0) of its blocks fit in what is free now? */
    int (*fits)(PyObject *t, const PaellaDemand *d, int whole);
    /* The launch id, or -1 with an exception set; the tracker keeps a reference to tok. */
    long long (*release)(PyObject *t, const PaellaDemand *d, PyObject *tok);
    int (*unrelease)(PyObject *t, long long lid);
    /* Entries consumed, or -1 with an exception set (a malformed entry: the launches
       before it are reported first). */
    long long (*drain)(PyObject *t, double now, paella_done_fn done, void *ctx);
    int (*pairs)(PyObject *t);
    /* The lookahead's twins of admits and release (apart, so that the common path keeps
       its cost): `pred_lid` / `behind` is the launch id of the kernel queued ahead on
       the same stream. A kernel behind a deferred one is admitted as if that one
       counted; a released kernel's demand is deferred until the one ahead ends. */
    int (*admits_behind)(PyObject *t, const PaellaDemand *d, const PaellaDemand *pred,
                         long long pred_lid);
    long long (*release_behind)(PyObject *t, const PaellaDemand *d, PyObject *tok,
                                long long behind);
} PaellaTrackerAPI;

typedef struct {
    /* 0 if `g` is an _engine.Gpu, else -1 with an exception set. */
    int (*check)(PyObject *g);
    /* Submit a kernel with no completion callback (launch(..., on_complete=None));
       0, or -1 with an exception set. duration < 0: the cost model decides. */
    int (*launch)(PyObject *g, int shape, long long blocks, double flops, double nbytes,
                  double duration, int stream, uint32_t launch_id, int instrumented,
                  int group);
    /* Submit a copy of `nbytes` (kind 1: H2D, 2: D2H) on `stream`: at its completion
       the bytes move from src to dst (memcpy), then fn(ctx, tag) runs (inside the
       engine's event processing: it must not call back into the engine). The caller
       keeps both buffers alive until then. 0, or -1 with an exception set. */
    int (*copy)(PyObject *g, int kind, int stream, long long nbytes, void *dst,
                const void *src, void (*fn)(void *, uint64_t), void *ctx, uint64_t tag);
    /* Real time: fire what is due by the wall clock ((CLOCK_MONOTONIC - t0) * speed), as
       Gpu.poll_wall does, before a submission. 0, or -1 with an exception set. */
    int (*sync_wall)(PyObject *g, double t0, double speed);
    /* The time of the next event (INFINITY if none), or NAN with an exception set. */
    double (*next_time)(PyObject *g);
    /* 1 if the host has something to collect outside the notifQ (Gpu.reached lists a
       notifying gate), else 0: a loop spinning in C returns to let the device's host
       side see it. */
    int (*host_pending)(PyObject *g);
    /* Per stream, the gates in it (Gpu.stream_gated): an array the engine owns, of *n
       entries, valid as long as the engine. */
    const int *(*stream_gates)(PyObject *g, int *n);
} PaellaEngineAPI;

#define PAELLA_TRACKER_CAPSULE "paella.dispatcher._tracker._C_API"
#define PAELLA_ENGINE_CAPSULE "paella.dispatcher.devices.sim._engine._C_API"

#endif
