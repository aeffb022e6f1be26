// paella_notif.cuh: device side of the notifQ contract (paella/protocol.py).
//
// The Paella compiler pass prepends this header to every generated CUDA module and
// wraps each kernel body as
//
//     paella_block_start(paella_notifq, paella_launch_id);
//     { ...original body... }
//     paella_block_end(paella_notifq, paella_launch_id);
//
// where `paella_notifq` points at the start of the notifQ region and
// `paella_launch_id` is the dispatcher's id for this launch (the two parameters the
// pass appends). Every constant below mirrors paella/protocol.py; a test parses this
// file and compares. Change both or neither.
//
// Posting rule (protocol.group_posts): the designated thread (0,0,0) of a block
// increments the launch's counter; the block whose counter value is a multiple of
// PAELLA_GROUP posts an entry for PAELLA_GROUP blocks, and the block whose counter
// value equals the grid size posts one for the remaining total % PAELLA_GROUP blocks.
#ifndef PAELLA_NOTIF_CUH_
#define PAELLA_NOTIF_CUH_

// ---- notification word (protocol.KIND_SHIFT ... protocol.LAUNCH_MASK) -------------
#define PAELLA_INVALID 0u
#define PAELLA_PLACEMENT 1u
#define PAELLA_COMPLETION 2u
#define PAELLA_KIND_SHIFT 56
#define PAELLA_SM_SHIFT 48
#define PAELLA_COUNT_SHIFT 40
#define PAELLA_LAUNCH_MASK 0xFFFFFFFFu
#define PAELLA_BYTE_MASK 0xFFu
#define PAELLA_MAX_GROUP 16

// ---- notifQ region layout (protocol.NOTIFQ_*) --------------------------------------
#define PAELLA_NOTIFQ_TAIL_OFFSET 0
#define PAELLA_NOTIFQ_SLOT_MASK_OFFSET 4
#define PAELLA_NOTIFQ_COUNTER_MASK_OFFSET 8
#define PAELLA_NOTIFQ_HEADER_BYTES 64

// Counter pair members: [started, ended] per launch.
#define PAELLA_COUNTER_STARTED 0
#define PAELLA_COUNTER_ENDED 1

// Blocks per notification; the compiler pass defines it before including this file
// (compile option `group`, 16 by default, 1 = one entry per block).
#ifndef PAELLA_GROUP
#define PAELLA_GROUP 16
#endif
#if PAELLA_GROUP < 1 || PAELLA_GROUP > PAELLA_MAX_GROUP
#error "PAELLA_GROUP must be in 1..PAELLA_MAX_GROUP (16)"
#endif

__device__ __forceinline__ unsigned int paella_smid() {
  unsigned int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  return smid;
}

__device__ __forceinline__ bool paella_is_leader() {
  return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
}

// Append one entry: slot = atomicAdd(tail, 1) & slot_mask, a system-wide fence, then one
// 64-bit volatile store (a reader sees INVALID or the whole entry). The fence comes
// BEFORE the store: whatever this block did before (its outputs, written by every thread
// before the exit barrier, and the launch's counter, updated just now) is visible to the
// host, and to work the dispatcher releases on another stream, by the time the entry is.
// (PTX fences are cumulative: the barrier makes the other threads' stores this thread's
// to order.) A fence after the store would order nothing the host relies on.
__device__ __forceinline__ void paella_post(unsigned char* q, unsigned int kind,
                                            unsigned int count, unsigned int launch_id) {
  unsigned int slot_mask = *(volatile unsigned int*)(q + PAELLA_NOTIFQ_SLOT_MASK_OFFSET);
  unsigned int slot =
      atomicAdd((unsigned int*)(q + PAELLA_NOTIFQ_TAIL_OFFSET), 1u) & slot_mask;
  unsigned long long word =
      ((unsigned long long)kind << PAELLA_KIND_SHIFT) |
      ((unsigned long long)(paella_smid() & PAELLA_BYTE_MASK) << PAELLA_SM_SHIFT) |
      ((unsigned long long)(count & PAELLA_BYTE_MASK) << PAELLA_COUNT_SHIFT) |
      (unsigned long long)(launch_id & PAELLA_LAUNCH_MASK);
  volatile unsigned long long* slots =
      (volatile unsigned long long*)(q + PAELLA_NOTIFQ_HEADER_BYTES);
  __threadfence_system();
  slots[slot] = word;
}

// Count this block in the launch's [started|ended] counter and post when the rule says.
__device__ __forceinline__ void paella_count(unsigned char* q, unsigned int launch_id,
                                             unsigned int which, unsigned int kind) {
  unsigned int slot_mask = *(volatile unsigned int*)(q + PAELLA_NOTIFQ_SLOT_MASK_OFFSET);
  unsigned int counter_mask =
      *(volatile unsigned int*)(q + PAELLA_NOTIFQ_COUNTER_MASK_OFFSET);
  unsigned int* counters =
      (unsigned int*)(q + PAELLA_NOTIFQ_HEADER_BYTES + 8ull * ((unsigned long long)slot_mask + 1ull));
  unsigned int* counter = counters + 2u * (launch_id & counter_mask) + which;
  unsigned int total = gridDim.x * gridDim.y * gridDim.z;
  unsigned int value = atomicAdd(counter, 1u) + 1u;
  unsigned int count = 0u;
  if (value % PAELLA_GROUP == 0u) {
    count = PAELLA_GROUP;
  } else if (value == total) {
    count = total % PAELLA_GROUP;
  }
  if (count != 0u) {
    paella_post(q, kind, count, launch_id);
  }
}

// Block entry: only the designated thread counts; no barrier is needed here.
__device__ __forceinline__ void paella_block_start(void* notifq, unsigned int launch_id) {
  if (paella_is_leader()) {
    paella_count((unsigned char*)notifq, launch_id, PAELLA_COUNTER_STARTED, PAELLA_PLACEMENT);
  }
}

// Block exit: the barrier is reached by EVERY thread of the block (the paper's
// Figure 6 puts it inside the thread-0 branch, which deadlocks or races); only after
// all threads are done does the designated thread count the completion.
__device__ __forceinline__ void paella_block_end(void* notifq, unsigned int launch_id) {
  __syncthreads();
  if (paella_is_leader()) {
    paella_count((unsigned char*)notifq, launch_id, PAELLA_COUNTER_ENDED, PAELLA_COMPLETION);
  }
}

#endif  // PAELLA_NOTIF_CUH_
