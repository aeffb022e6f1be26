// Reference oracle for tests/test_occupancy.py: NVIDIA's CUDA Occupancy Calculator
// (cuda_occupancy.h, host-only) driven from stdin.
//
// Build:  g++ -O1 -std=c++17 -I/usr/local/cuda/include occ_ref.cpp -o occ_ref
//
// Input, one configuration per line (whitespace separated integers):
//   major minor maxThreadsPerBlock maxThreadsPerMultiprocessor regsPerBlock
//   regsPerMultiprocessor warpSize sharedMemPerBlock sharedMemPerMultiprocessor numSms
//   sharedMemPerBlockOptin reservedSharedMemPerBlock  threads regs smem  [numBlockBarriers]
// ``smem`` is the block's total (static + dynamic) shared memory in bytes. Up to the
// default per-block limit it is passed as static shared memory with the default limit
// config; above it, as dynamic shared memory with FUNC_SHMEM_LIMIT_OPTIN and
// maxDynamicSharedSizeBytes = smem, as a kernel that called
// cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, smem) would.
//
// Output, one line per input line:
//   status activeBlocksPerMultiprocessor limitingFactors blockLimitRegs
//   blockLimitSharedMem blockLimitWarps blockLimitBlocks allocatedRegistersPerBlock
//   allocatedSharedMemPerBlock
// (status is the cudaOccError; the other fields are meaningful only when it is 0).
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <iostream>

#include <cuda_occupancy.h>

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        std::istringstream in(line);
        long long v[16] = {0};
        int n = 0;
        while (n < 16 && (in >> v[n])) ++n;
        if (n < 15) {
            std::printf("bad-input\n");
            std::fflush(stdout);
            continue;
        }
        cudaOccDeviceProp p;   // C++ default constructor: all zero
        p.computeMajor = (int)v[0];
        p.computeMinor = (int)v[1];
        p.maxThreadsPerBlock = (int)v[2];
        p.maxThreadsPerMultiprocessor = (int)v[3];
        p.regsPerBlock = (int)v[4];
        p.regsPerMultiprocessor = (int)v[5];
        p.warpSize = (int)v[6];
        p.sharedMemPerBlock = (size_t)v[7];
        p.sharedMemPerMultiprocessor = (size_t)v[8];
        p.numSms = (int)v[9];
        p.sharedMemPerBlockOptin = (size_t)v[10];
        p.reservedSharedMemPerBlock = (size_t)v[11];
        const int threads = (int)v[12];
        const int regs = (int)v[13];
        const size_t smem = (size_t)v[14];

        cudaOccFuncAttributes a;   // defaults: GC off, DEFAULT limit, 0 barriers
        a.maxThreadsPerBlock = p.maxThreadsPerBlock;
        a.numRegs = regs;
        a.partitionedGCConfig = PARTITIONED_GC_OFF;
        if (n > 15) a.numBlockBarriers = (int)v[15];
        size_t dynamicSmem = 0;
        if (smem > p.sharedMemPerBlock) {
            a.sharedSizeBytes = 0;
            a.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN;
            a.maxDynamicSharedSizeBytes = smem;
            dynamicSmem = smem;
        } else {
            a.sharedSizeBytes = smem;
            a.shmemLimitConfig = FUNC_SHMEM_LIMIT_DEFAULT;
        }
        cudaOccDeviceState s;      // default cache config and carveout

        cudaOccResult r;
        std::memset(&r, 0, sizeof r);
        cudaOccError st = cudaOccMaxActiveBlocksPerMultiprocessor(&r, &p, &a, &s, threads, dynamicSmem);
        std::printf("%d %d %u %d %d %d %d %d %zu\n", (int)st, r.activeBlocksPerMultiprocessor,
                    r.limitingFactors, r.blockLimitRegs, r.blockLimitSharedMem, r.blockLimitWarps,
                    r.blockLimitBlocks, r.allocatedRegistersPerBlock, r.allocatedSharedMemPerBlock);
        std::fflush(stdout);
    }
    return 0;
}
