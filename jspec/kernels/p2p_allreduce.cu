// One-shot all-reduce between the GPUs of one process over peer-to-peer memory (NVLink or PCIe),
// for tensor parallelism's small per-layer sums (jspec/kernels/allreduce.py builds and loads this).
//
// Why: a decode step of an 8B model under model=2 runs 65 collectives of 8-128 KB, and NCCL takes
// about 23 us for each of them, a third of the step. Here each device copies its operand into a
// buffer of its own that the other devices can read, raises a flag in every peer's flag array,
// waits for the peers' flags, then sums every device's buffer in rank order (the same order on
// every device, so the results are bitwise equal everywhere). One kernel on XLA's compute stream.
//
// Work split: the operand is cut into 16-byte chunks; block b of every device copies and sums the
// same chunks, so block b only waits for the peers' blocks b. Each block keeps its own flags and
// its own call counter. Every call launches the same kBlocks blocks whatever its size, so a chunk
// always belongs to the same block and every block's counter moves at every call (the ordering
// below holds per block).
//
// Ordering: every device runs the same sequence of calls, so a per-block call counter (in device
// memory, so that a captured CUDA graph replays correctly) numbers each call the same everywhere.
// Call e writes slot e % 2 of the buffer: a block reaches call e + 2, and overwrites slot e % 2,
// only after every peer's same block raised its flag for call e + 1, which it does only after its
// call e (an earlier kernel on the same stream) has finished reading. A peer that does not arrive
// within kTimeoutNs traps the kernel (the process fails with a CUDA error) instead of hanging.
//
// No NVLink multicast and no NCCL: plain peer access (cudaDeviceEnablePeerAccess) only.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxGroups = 8;
constexpr int kMaxBlocks = 16;  // the grid of every call (see "Work split")
constexpr int kThreads = 512;
constexpr int64_t kSlotBytes = 1 << 20;  // the largest operand, per call (the caller checks)
constexpr unsigned long long kTimeoutNs = 10ULL * 1000 * 1000 * 1000;
constexpr size_t kFlagWords = kMaxBlocks * kMaxRanks + kMaxBlocks;  // flags [block][rank], then counters [block]

struct Rank {
  int rank = -1, nranks = 0;
  void* data[kMaxRanks] = {};       // every rank's exchange buffer (two slots), in rank order
  unsigned* flags[kMaxRanks] = {};  // every rank's flag words (kFlagWords)
};

std::mutex table_mutex;
constexpr int kMaxOrdinal = 64;
Rank table[kMaxOrdinal];  // by CUDA device ordinal

struct Peers {
  const char* data[kMaxRanks];
  unsigned* flags[kMaxRanks];
};

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
  const unsigned short bits = __ldcv(reinterpret_cast<const unsigned short*>(p));
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// A 16-byte chunk as floats and back, by register bit operations (taking a local array's address
// would put it in local memory): 4 floats, or 8 bfloat16 (two to a 32-bit word, low half first).
__device__ __forceinline__ void add_words(float (&acc)[8], uint4 v, float) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] += __uint_as_float(w[j]);
}
__device__ __forceinline__ void add_words(float (&acc)[8], uint4 v, __nv_bfloat16) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] += __uint_as_float(w[j] << 16);
    acc[2 * j + 1] += __uint_as_float(w[j] & 0xffff0000u);
  }
}
__device__ __forceinline__ unsigned bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ uint4 pack_words(const float (&acc)[8], float) {
  return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]), __float_as_uint(acc[3]));
}
__device__ __forceinline__ uint4 pack_words(const float (&acc)[8], __nv_bfloat16) {
  return make_uint4(bf16_bits(acc[0]) | bf16_bits(acc[1]) << 16, bf16_bits(acc[2]) | bf16_bits(acc[3]) << 16,
                    bf16_bits(acc[4]) | bf16_bits(acc[5]) << 16, bf16_bits(acc[6]) | bf16_bits(acc[7]) << 16);
}

template <typename T, int NR>
__global__ void __launch_bounds__(kThreads) one_shot_all_reduce(const T* __restrict__ in, T* __restrict__ out,
                                                                int64_t n, int rank, Peers peers) {
  constexpr int kPer = 16 / sizeof(T);
  // this device's buffer and flags
  const char* my_data = peers.data[0];
  unsigned* my_flags = peers.flags[0];
#pragma unroll
  for (int r = 1; r < NR; ++r) {
    if (rank == r) {
      my_data = peers.data[r];
      my_flags = peers.flags[r];
    }
  }
  unsigned* counter = my_flags + kMaxBlocks * kMaxRanks + blockIdx.x;
  const unsigned call = *counter + 1;
  const int64_t slot = (call & 1) * kSlotBytes;
  const int64_t chunks = n / kPer;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // 1. my share into my buffer: whole 16-byte chunks, then the tail (block 0)
  uint4* mine = reinterpret_cast<uint4*>(const_cast<char*>(my_data) + slot);
  const uint4* src = reinterpret_cast<const uint4*>(in);
  for (int64_t i = first; i < chunks; i += stride) mine[i] = src[i];
  if (blockIdx.x == 0) {
    T* mine_tail = reinterpret_cast<T*>(mine + chunks);
    for (int64_t i = chunks * kPer + threadIdx.x; i < n; i += blockDim.x) mine_tail[i - chunks * kPer] = in[i];
  }
  __threadfence_system();
  __syncthreads();

  // 2. thread r < NR raises my flag in rank r's array (this block's row) and waits for rank r's in mine
  if (threadIdx.x < NR) {
    unsigned* theirs_array = peers.flags[0];
#pragma unroll
    for (int r = 1; r < NR; ++r) {
      if (threadIdx.x == r) theirs_array = peers.flags[r];
    }
    store_release(theirs_array + blockIdx.x * kMaxRanks + rank, call);
    const unsigned* theirs = my_flags + blockIdx.x * kMaxRanks + threadIdx.x;
    const unsigned long long start = now_ns();
    while (static_cast<int>(load_acquire(theirs) - call) < 0) {
      if (now_ns() - start > kTimeoutNs) __trap();  // a peer never came: fail, do not hang
    }
  }
  __syncthreads();

  // 3. every rank's share, summed in rank order: all NR loads of a chunk in flight together
  uint4* dst = reinterpret_cast<uint4*>(out);
  for (int64_t i = first; i < chunks; i += stride) {
    uint4 parts[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) parts[r] = __ldcv(reinterpret_cast<const uint4*>(peers.data[r] + slot) + i);
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < NR; ++r) add_words(acc, parts[r], T());
    dst[i] = pack_words(acc, T());
  }
  if (blockIdx.x == 0) {
    for (int64_t i = chunks * kPer + threadIdx.x; i < n; i += blockDim.x) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        acc += load_peer(reinterpret_cast<const T*>(peers.data[r] + slot + chunks * 16) + (i - chunks * kPer));
      }
      out[i] = from_float<T>(acc);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = call;
}

template <typename T, int NR>
void launch(const void* in, void* out, int64_t n, int rank, const Peers& peers, cudaStream_t stream) {
  one_shot_all_reduce<T, NR><<<kMaxBlocks, kThreads, 0, stream>>>(static_cast<const T*>(in), static_cast<T*>(out), n,
                                                                  rank, peers);
}

template <typename T>
bool launch_ranks(int nranks, const void* in, void* out, int64_t n, int rank, const Peers& peers, cudaStream_t stream) {
  switch (nranks) {
    case 2: launch<T, 2>(in, out, n, rank, peers, stream); return true;
    case 4: launch<T, 4>(in, out, n, rank, peers, stream); return true;
    case 8: launch<T, 8>(in, out, n, rank, peers, stream); return true;
    default: return false;
  }
}

ffi::Error AllReduce(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  int ordinal = -1;  // the device whose context XLA made current for this call
  if (cudaGetDevice(&ordinal) != cudaSuccess || ordinal < 0 || ordinal >= kMaxOrdinal) {
    return ffi::Error::Internal("jspec p2p all-reduce: no current CUDA device");
  }
  Rank r;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    r = table[ordinal];
  }
  if (r.rank < 0) return ffi::Error::InvalidArgument("jspec p2p all-reduce: device not set up (jspec_p2p_init)");
  if (static_cast<int64_t>(x.size_bytes()) > kSlotBytes) {
    return ffi::Error::InvalidArgument("jspec p2p all-reduce: operand above 1 MiB");
  }
  Peers peers;
  for (int i = 0; i < kMaxRanks; ++i) {
    peers.data[i] = static_cast<const char*>(r.data[i]);
    peers.flags[i] = r.flags[i];
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  bool launched = false;
  if (x.element_type() == ffi::DataType::BF16) {
    launched = launch_ranks<__nv_bfloat16>(r.nranks, x.untyped_data(), y->untyped_data(), n, r.rank, peers, stream);
  } else if (x.element_type() == ffi::DataType::F32) {
    launched = launch_ranks<float>(r.nranks, x.untyped_data(), y->untyped_data(), n, r.rank, peers, stream);
  } else {
    return ffi::Error::InvalidArgument("jspec p2p all-reduce: bfloat16 or float32 only");
  }
  if (!launched) return ffi::Error::InvalidArgument("jspec p2p all-reduce: 2, 4 or 8 devices a group");
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Loads every variant of the kernel on the current device now: with lazy module loading (CUDA's
// default) a first launch inside a run could wait behind other work on the device while a peer spins.
cudaError_t load_kernels() {
  cudaFuncAttributes attributes;
  const void* kernels[] = {
      reinterpret_cast<const void*>(one_shot_all_reduce<__nv_bfloat16, 2>),
      reinterpret_cast<const void*>(one_shot_all_reduce<__nv_bfloat16, 4>),
      reinterpret_cast<const void*>(one_shot_all_reduce<__nv_bfloat16, 8>),
      reinterpret_cast<const void*>(one_shot_all_reduce<float, 2>),
      reinterpret_cast<const void*>(one_shot_all_reduce<float, 4>),
      reinterpret_cast<const void*>(one_shot_all_reduce<float, 8>)};
  for (const void* kernel : kernels) {
    const cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Allocates, per device of each group, the two-slot exchange buffer and the flag words (flags and
// per-block call counters, zeroed), enables peer access within the group, loads the kernels, and
// fills `out`.
int init_groups(const int* ordinals, int ngroups, int nranks, Rank* out) {
  for (int g = 0; g < ngroups; ++g) {
    Rank group;
    group.nranks = nranks;
    for (int k = 0; k < nranks; ++k) {
      const int dev = ordinals[g * nranks + k];
      cudaError_t err = cudaSetDevice(dev);
      if (err == cudaSuccess) err = cudaMalloc(&group.data[k], 2 * kSlotBytes);
      if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&group.flags[k]), kFlagWords * sizeof(unsigned));
      if (err == cudaSuccess) err = cudaMemset(group.flags[k], 0, kFlagWords * sizeof(unsigned));
      if (err == cudaSuccess) err = load_kernels();
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
      Rank entry = group;
      entry.rank = k;
      out[ordinals[g * nranks + k]] = entry;
    }
  }
  return 0;
}

bool initialised = false;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecP2pAllReduce, AllReduce,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// ordinals: ngroups lists of nranks CUDA device ordinals (each device at most once), each in the
// order of the mesh's "model" axis. Once per process: the buffers and counters serve one grouping
// (the caller refuses a second one). Returns 0, -1 for bad arguments or a second call, or a CUDA
// error code (the caller reports it).
extern "C" int jspec_p2p_init(const int* ordinals, int ngroups, int nranks) {
  if (ngroups < 1 || ngroups > kMaxGroups || (nranks != 2 && nranks != 4 && nranks != 8)) return -1;
  bool seen[kMaxOrdinal] = {};
  for (int i = 0; i < ngroups * nranks; ++i) {
    if (ordinals[i] < 0 || ordinals[i] >= kMaxOrdinal || seen[ordinals[i]]) return -1;
    seen[ordinals[i]] = true;
  }
  std::lock_guard<std::mutex> lock(table_mutex);
  if (initialised) return -1;
  int previous = 0;
  cudaGetDevice(&previous);
  static Rank staged[kMaxOrdinal];
  const int status = init_groups(ordinals, ngroups, nranks, staged);
  cudaSetDevice(previous);
  if (status != 0) return status;  // nothing entered the table (what was allocated stays: a failed setup ends the run)
  for (int i = 0; i < kMaxOrdinal; ++i) {
    if (staged[i].rank >= 0) table[i] = staged[i];
  }
  initialised = true;
  return 0;
}
