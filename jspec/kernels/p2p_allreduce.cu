// One-shot all-reduce between the GPUs of one process over peer-to-peer memory (NVLink or PCIe),
// for tensor parallelism's small per-layer sums (jspec/kernels/allreduce.py builds and loads this).
//
// Why: a decode step of an 8B model under model=2 runs 65 collectives of 8-128 KB, and NCCL takes
// about 23 us for each of them, a third of the step. Here each device copies its operand into a
// buffer of its own that the other devices can read, raises a flag in every peer's flag array,
// waits for the peers' flags, then sums every device's buffer in rank order (the same order on
// every device, so the results are bitwise equal everywhere). One kernel, one block, on XLA's
// compute stream.
//
// Ordering: every device runs the same sequence of calls, so a per-device call counter (kept in
// device memory, so that a captured CUDA graph replays correctly) numbers each call the same
// everywhere. Call e writes slot e % 2 of the buffer: a device can reach call e + 2, and overwrite
// slot e % 2, only after every peer has raised its flag for call e + 1, which a peer does only after
// its call e has finished reading. A peer that does not arrive within TIMEOUT_NS traps the kernel
// (the process fails with a CUDA error) instead of hanging the GPU.
//
// No NVLink multicast and no NCCL: plain peer access (cudaDeviceEnablePeerAccess) only.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxGroups = 8;
constexpr int64_t kSlotBytes = 1 << 20;  // the largest operand, per call (the caller checks)
constexpr int kThreads = 512;
constexpr unsigned long long kTimeoutNs = 10ULL * 1000 * 1000 * 1000;

struct Rank {
  int group = -1, rank = -1, nranks = 0;
  void* data[kMaxRanks] = {};        // every rank's exchange buffer (two slots), this group's order
  unsigned* flags[kMaxRanks] = {};   // every rank's flag array [kMaxRanks]
  unsigned* counter = nullptr;       // this device's call counter
};

std::mutex table_mutex;
Rank table[64];  // by CUDA device ordinal
int max_ordinal = -1;

__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float load_peer(const float* p) { return __ldcv(p); }
__device__ __forceinline__ float load_peer(const __nv_bfloat16* p) {
  unsigned short bits = __ldcv(reinterpret_cast<const unsigned short*>(p));
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

struct Peers {
  void* data[kMaxRanks];
  unsigned* flags[kMaxRanks];
};

template <typename T>
__global__ void one_shot_all_reduce(const T* in, T* out, int64_t n, int rank, int nranks, Peers peers,
                                    unsigned* counter) {
  const unsigned call = *counter + 1;
  const int64_t slot = (call & 1) * kSlotBytes;
  T* mine = reinterpret_cast<T*>(static_cast<char*>(peers.data[rank]) + slot);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mine[i] = in[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < nranks) {  // raise my flag in every rank's array, then wait for theirs in mine
    store_release(peers.flags[threadIdx.x] + rank, call);
    const unsigned long long start = now_ns();
    const unsigned* theirs = peers.flags[rank] + threadIdx.x;
    while (static_cast<int>(load_acquire(theirs) - call) < 0) {
      if (now_ns() - start > kTimeoutNs) __trap();  // a peer never came: fail, do not hang
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < nranks; ++r) {
      acc += load_peer(reinterpret_cast<const T*>(static_cast<const char*>(peers.data[r]) + slot) + i);
    }
    store_out(out + i, acc);
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = call;
}

ffi::Error AllReduce(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  Rank r;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    if (ordinal < 0 || ordinal > max_ordinal || table[ordinal].rank < 0) {
      return ffi::Error::InvalidArgument("jspec p2p all-reduce: device not initialised (jspec_p2p_init)");
    }
    r = table[ordinal];
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t bytes = static_cast<int64_t>(x.size_bytes());
  if (bytes > kSlotBytes) return ffi::Error::InvalidArgument("jspec p2p all-reduce: operand above 1 MiB");
  Peers peers;
  for (int i = 0; i < kMaxRanks; ++i) {
    peers.data[i] = r.data[i];
    peers.flags[i] = r.flags[i];
  }
  if (x.element_type() == ffi::DataType::BF16) {
    one_shot_all_reduce<<<1, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x.untyped_data()),
                                                    static_cast<__nv_bfloat16*>(y->untyped_data()), n, r.rank,
                                                    r.nranks, peers, r.counter);
  } else if (x.element_type() == ffi::DataType::F32) {
    one_shot_all_reduce<<<1, kThreads, 0, stream>>>(static_cast<const float*>(x.untyped_data()),
                                                    static_cast<float*>(y->untyped_data()), n, r.rank, r.nranks,
                                                    peers, r.counter);
  } else {
    return ffi::Error::InvalidArgument("jspec p2p all-reduce: bfloat16 or float32 only");
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecP2pAllReduce, AllReduce,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

namespace {

// Allocates, per device of each group, the two-slot exchange buffer and the flag array (with the
// call counter after it), enables peer access within the group, and fills the table.
int init_groups(const int* ordinals, int ngroups, int nranks) {
  const size_t flag_bytes = kMaxRanks * sizeof(unsigned) + 64;
  for (int g = 0; g < ngroups; ++g) {
    Rank group;
    group.group = g;
    group.nranks = nranks;
    for (int k = 0; k < nranks; ++k) {
      const int dev = ordinals[g * nranks + k];
      if (dev < 0 || dev >= 64) return -1;
      cudaError_t err = cudaSetDevice(dev);
      if (err == cudaSuccess) err = cudaMalloc(&group.data[k], 2 * kSlotBytes);
      if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&group.flags[k]), flag_bytes);
      if (err == cudaSuccess) err = cudaMemset(group.flags[k], 0, flag_bytes);
      if (err == cudaSuccess) err = cudaDeviceSynchronize();
      if (err != cudaSuccess) return static_cast<int>(err);
      for (int other = 0; other < nranks; ++other) {
        const int peer = ordinals[g * nranks + other];
        if (peer == dev) continue;
        int can = 0;
        if (cudaDeviceCanAccessPeer(&can, dev, peer) != cudaSuccess || !can) {
          return static_cast<int>(cudaErrorPeerAccessUnsupported);
        }
        err = cudaDeviceEnablePeerAccess(peer, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();  // clear it: already enabled (by XLA, for its own cliques) is fine
          err = cudaSuccess;
        }
        if (err != cudaSuccess) return static_cast<int>(err);
      }
    }
    for (int k = 0; k < nranks; ++k) {
      const int dev = ordinals[g * nranks + k];
      Rank entry = group;
      entry.rank = k;
      entry.counter = group.flags[k] + kMaxRanks;
      table[dev] = entry;
      if (dev > max_ordinal) max_ordinal = dev;
    }
  }
  return 0;
}

}  // namespace

// ordinals: ngroups lists of nranks CUDA device ordinals, each in the order of the mesh's "model"
// axis. Returns 0, -1 for bad arguments, or a CUDA error code (the caller reports it). Call once
// per process and mesh, before the first all-reduce.
extern "C" int jspec_p2p_init(const int* ordinals, int ngroups, int nranks) {
  if (ngroups < 1 || ngroups > kMaxGroups || nranks < 2 || nranks > kMaxRanks) return -1;
  std::lock_guard<std::mutex> lock(table_mutex);
  int previous = 0;
  cudaGetDevice(&previous);
  const int status = init_groups(ordinals, ngroups, nranks);
  cudaSetDevice(previous);
  return status;
}
