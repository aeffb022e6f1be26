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
