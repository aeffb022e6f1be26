// Instrumented and plain test kernels for benchmarks/gpu_check.py (compiled at run time
// with nvcc, once per PAELLA_GROUP). Instrumented kernels end with the two parameters
// the compiler pass appends: (void* notifq region, unsigned int launch id).
#include "paella_notif.cuh"

extern "C" __global__ void paella_check_empty(void* paella_notifq, unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  paella_block_end(paella_notifq, paella_launch_id);
}

extern "C" __global__ void paella_check_empty_plain() {}

// x[i] += 1 for i < n: a functional check that arguments arrive in order.
extern "C" __global__ void paella_check_add1(float* x, int n, void* paella_notifq,
                                             unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
  paella_block_end(paella_notifq, paella_launch_id);
}
