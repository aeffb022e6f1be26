// Test kernels for paella_notif.cuh: built by CMakeLists.txt for sm_75/sm_80/sm_90.
// They exercise the prologue/epilogue the compiler pass inserts, with a guarded
// body and an early exit routed to the epilogue the way the pass rewrites returns.
#ifndef PAELLA_GROUP
#define PAELLA_GROUP 16
#endif
#define PAELLA_EXIT() goto paella_epilogue
#define PAELLA_EPILOGUE() paella_epilogue: ;
#include "paella_notif.cuh"

extern "C" __global__ void paella_probe_guarded(float* out, int n, unsigned char* paella_notifq,
                                                unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { out[i] = 2.0f * i; }
  paella_block_end(paella_notifq, paella_launch_id);
}

extern "C" __global__ void paella_probe_early_exit(float* out, int n, unsigned char* paella_notifq,
                                                   unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  if (1) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) { PAELLA_EXIT(); }
    out[i] = 1.0f;
  }
  PAELLA_EPILOGUE();
  paella_block_end(paella_notifq, paella_launch_id);
}

// Several exit paths: two early exits and the fall-through all reach the one epilogue.
extern "C" __global__ void paella_probe_two_exits(float* out, const float* in, int n,
                                                  unsigned char* paella_notifq,
                                                  unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) { PAELLA_EXIT(); }
    if (in[i] < 0.0f) { out[i] = 0.0f; PAELLA_EXIT(); }
    out[i] = in[i] * in[i];
  }
  PAELLA_EPILOGUE();
  paella_block_end(paella_notifq, paella_launch_id);
}

// The paper's Figure 2 kernel: one 128-thread block that keeps its SM busy for a
// given number of cycles (about 300 us at 1.5 GHz for 450000 cycles).
extern "C" __global__ void paella_probe_figure2(unsigned long long cycles, unsigned char* paella_notifq,
                                                unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  unsigned long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
  paella_block_end(paella_notifq, paella_launch_id);
}
