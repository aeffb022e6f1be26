/*
 * A stand-in for the GPU driver library (libcuda.so), built by the tests: the C kernel
 * core loads it (CudaDevice.driver_library) and calls its cuLaunchKernel as it would the
 * real driver's. Every call is recorded (function, grid, block, dynamic shared memory,
 * stream) and then handed to a hook the test sets (the Python stand-in driver, which
 * checks the parameters and runs the kernel), whose CUresult is returned.
 */
#include <stdint.h>

#define MAX_CALLS 65536

typedef int (*hook_fn)(uintptr_t, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, uintptr_t, void **, void **);

typedef struct {
    uint64_t fn, stream;
    uint32_t grid[3], block[3], smem, pad;
} Call;

static hook_fn hook;
static Call calls[MAX_CALLS];
static int ncalls;

void stub_set_hook(hook_fn h) { hook = h; }
int stub_calls(void) { return ncalls; }
const Call *stub_call(int i) { return i >= 0 && i < ncalls ? &calls[i] : 0; }
int stub_reset(void) { ncalls = 0; return 0; }

int cuLaunchKernel(uintptr_t f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                   unsigned by, unsigned bz, unsigned smem, uintptr_t stream, void **params,
                   void **extra)
{
    if (ncalls < MAX_CALLS) {
        Call *c = &calls[ncalls++];
        c->fn = f, c->stream = stream;
        c->grid[0] = gx, c->grid[1] = gy, c->grid[2] = gz;
        c->block[0] = bx, c->block[1] = by, c->block[2] = bz;
        c->smem = smem;
    }
    return hook != 0 ? hook(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra) : 0;
}
