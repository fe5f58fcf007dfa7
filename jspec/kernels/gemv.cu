// Bandwidth-bound products of few rows (y = x @ W, x [M <= 8, K], W bfloat16) on CUDA cores, for
// decode steps at batch 1-8 (jspec/kernels/gemv.py builds and loads this; the Pallas kernel in
// matvec.py, or XLA's dot, serves everything else and every other platform).
//
// Why a CUDA kernel beside the Pallas one: at one row a decode step is one pass over the weights,
// and the Pallas/Triton kernel reached 55-65% of the HBM bandwidth on the 8-67 MB products of a 1B
// model (matvec.py; its padded tensor-core tiles and software pipeline are built for more rows).
// Here each thread streams 16-byte vectors of W with many loads in flight and multiplies on the
// CUDA cores; nothing is padded.
//
// Two layouts:
//  * W [K, N] (or one layer of a stacked [L, K, N], read in place at a layer index held in device
//    memory): a block owns BN output columns (8 a thread, so a warp row reads BN * 2 contiguous
//    bytes) and a K range; its TY thread rows stride through that range, then sum in shared
//    memory. Split-K (S blocks on the same columns) runs as a thread-block cluster of S blocks
//    (sm_90+): the S partial sums are added through distributed shared memory in block order, so
//    there is no workspace, no atomics and no second kernel, and results are deterministic.
//  * W [N, K] (a tied embedding as the LM head, rows contiguous along K): a warp owns two output
//    columns and its lanes stride along K; a shuffle reduction sums them.
//
// Every output element is summed in the same order whatever M is (each row's accumulation and
// reduction tree depend on K, N and the block choice only), so a row's result does not depend on
// how many rows share the call: the verify step and the decode step agree bit for bit.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;    // W vectors in flight per thread and step
constexpr int kMaxRows = 8;   // M
constexpr int kMaxSplit = 8;  // the portable cluster size

__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));  // read once: do not keep it in L1/L2
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// W [K, N]: grid (ceil(N / BN), S); cluster (1, S) when S > 1.
template <int MT, int BN, typename OutT>
__global__ void __launch_bounds__(kThreads) gemv_kn(const int32_t* layer, const __nv_bfloat16* __restrict__ x,
                                                    const __nv_bfloat16* __restrict__ w, OutT* __restrict__ y,
                                                    int M, int K, int N, int k_split) {
  constexpr int TX = BN / 8, TY = kThreads / TX;
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  const int col = blockIdx.x * BN + tx * 8;
  const int S = gridDim.y, s = blockIdx.y;
  const int k0 = s * k_split, k1 = min(K, k0 + k_split);
  const __nv_bfloat16* wl = w + (layer ? static_cast<int64_t>(*layer) * K * N : 0);

  float acc[MT][8];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[m][j] = 0.f;

  if (col < N) {
    int k = k0 + ty;
    for (; k + (kUnroll - 1) * TY < k1; k += kUnroll * TY) {
      uint4 wv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) wv[u] = load_stream(wl + static_cast<int64_t>(k + u * TY) * N + col);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float wf[8];
        unpack8(wv[u], wf);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m < M) {
            const float xv = __bfloat162float(x[m * K + k + u * TY]);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[m][j] = fmaf(xv, wf[j], acc[m][j]);
          }
        }
      }
    }
    for (; k < k1; k += TY) {
      float wf[8];
      unpack8(load_stream(wl + static_cast<int64_t>(k) * N + col), wf);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < M) {
          const float xv = __bfloat162float(x[m * K + k]);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[m][j] = fmaf(xv, wf[j], acc[m][j]);
        }
      }
    }
  }

  // the TY thread rows' sums, row by row of x: sums[m][c] for this block's BN columns
  __shared__ float rows_part[TY][BN];
  __shared__ float sums[MT][BN];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= M) break;
#pragma unroll
    for (int j = 0; j < 8; ++j) rows_part[ty][tx * 8 + j] = acc[m][j];
    __syncthreads();
    for (int c = threadIdx.x; c < BN; c += kThreads) {
      float total = 0.f;
#pragma unroll 8
      for (int r = 0; r < TY; ++r) total += rows_part[r][c];
      sums[m][c] = total;
    }
    __syncthreads();
  }

  const int col0 = blockIdx.x * BN;
  if (S == 1) {
    for (int i = threadIdx.x; i < M * BN; i += kThreads) {
      const int m = i / BN, c = i % BN;
      if (col0 + c < N) y[static_cast<int64_t>(m) * N + col0 + c] = from_float<OutT>(sums[m][c]);
    }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // split K: block s of the cluster sums columns [s * BN / S, +BN / S) over the S blocks, in order
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int slice = BN / S;
  for (int i = threadIdx.x; i < M * slice; i += kThreads) {
    const int m = i / slice, c = s * slice + i % slice;
    float total = 0.f;
    for (int r = 0; r < S; ++r) total += cluster.map_shared_rank(&sums[0][0], r)[m * BN + c];
    if (col0 + c < N) y[static_cast<int64_t>(m) * N + col0 + c] = from_float<OutT>(total);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

// W [N, K]: grid ceil(N / (2 * warps)); warp w of block b owns output columns 2 * (b * warps + w) + {0, 1}.
template <int MT, typename OutT>
__global__ void __launch_bounds__(kThreads) gemv_nk(const int32_t* layer, const __nv_bfloat16* __restrict__ x,
                                                    const __nv_bfloat16* __restrict__ w, OutT* __restrict__ y,
                                                    int M, int K, int N) {
  constexpr int kRowsPerWarp = 2, kWarps = kThreads / 32, kU = 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n0 = (blockIdx.x * kWarps + warp) * kRowsPerWarp;
  const __nv_bfloat16* wl = w + (layer ? static_cast<int64_t>(*layer) * K * N : 0);
  const int vectors = K / 8;
  float acc[kRowsPerWarp][MT];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;

  for (int v0 = lane; v0 < vectors; v0 += 32 * kU) {
    uint4 wv[kRowsPerWarp][kU];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = v0 + u * 32;
        wv[r][u] = (n0 + r < N && v < vectors) ? load_stream(wl + static_cast<int64_t>(n0 + r) * K + v * 8)
                                               : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * 32;
      if (v >= vectors) break;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= M) break;
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * K + v * 8), xf);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          float wf[8];
          unpack8(wv[r][u], wf);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r][m] = fmaf(xf[j], wf[j], acc[r][m]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (m < M && n0 + r < N) y[static_cast<int64_t>(m) * N + n0 + r] = from_float<OutT>(acc[r][m]);
  }
}

template <int MT, int BN, typename OutT>
cudaError_t launch_kn(cudaStream_t stream, const int32_t* layer, const __nv_bfloat16* x, const __nv_bfloat16* w,
                      OutT* y, int M, int K, int N, int split) {
  const int k_split = (K + split - 1) / split;
  const dim3 grid((N + BN - 1) / BN, split);
  if (split == 1) {
    gemv_kn<MT, BN, OutT><<<grid, kThreads, 0, stream>>>(layer, x, w, y, M, K, N, k_split);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = split;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, gemv_kn<MT, BN, OutT>, layer, x, w, y, M, K, N, k_split);
}

template <int MT, typename OutT>
cudaError_t launch_rows(cudaStream_t stream, bool transposed, int block_n, const int32_t* layer,
                        const __nv_bfloat16* x, const __nv_bfloat16* w, OutT* y, int M, int K, int N, int split) {
  if (transposed) {
    const int columns_per_block = 2 * (kThreads / 32);
    gemv_nk<MT, OutT><<<(N + columns_per_block - 1) / columns_per_block, kThreads, 0, stream>>>(layer, x, w, y, M, K, N);
    return cudaGetLastError();
  }
  switch (block_n) {
    case 64: return launch_kn<MT, 64, OutT>(stream, layer, x, w, y, M, K, N, split);
    case 128: return launch_kn<MT, 128, OutT>(stream, layer, x, w, y, M, K, N, split);
    case 256: return launch_kn<MT, 256, OutT>(stream, layer, x, w, y, M, K, N, split);
    default: return cudaErrorInvalidValue;
  }
}

template <typename OutT>
cudaError_t launch(cudaStream_t stream, bool transposed, int block_n, const int32_t* layer, const __nv_bfloat16* x,
                   const __nv_bfloat16* w, OutT* y, int M, int K, int N, int split) {
  if (M <= 1) return launch_rows<1, OutT>(stream, transposed, block_n, layer, x, w, y, M, K, N, split);
  if (M <= 2) return launch_rows<2, OutT>(stream, transposed, block_n, layer, x, w, y, M, K, N, split);
  if (M <= 4) return launch_rows<4, OutT>(stream, transposed, block_n, layer, x, w, y, M, K, N, split);
  return launch_rows<8, OutT>(stream, transposed, block_n, layer, x, w, y, M, K, N, split);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// x [M, K] bfloat16; w [K, N], [L, K, N] (stacked) or [N, K] (transposed); layer int32 [1]; y [M, N].
ffi::Error Gemv(cudaStream_t stream, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::BF16> x,
                ffi::Buffer<ffi::BF16> w, ffi::Result<ffi::AnyBuffer> y, bool transposed, bool stacked,
                int64_t block_n, int64_t split) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != (stacked ? 3u : 2u))
    return ffi::Error::InvalidArgument("jspec gemv: x must be [M, K] and W [K, N], [L, K, N] or [N, K]");
  const int64_t M = xd[0], K = xd[1];
  const int64_t N = transposed ? wd[wd.size() - 2] : wd[wd.size() - 1];
  if ((transposed ? wd[wd.size() - 1] : wd[wd.size() - 2]) != K)
    return ffi::Error::InvalidArgument("jspec gemv: x's K does not match W");
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument("jspec gemv: 1 to 8 rows");
  if (split < 1 || split > kMaxSplit || (block_n / split) * split != block_n)
    return ffi::Error::InvalidArgument("jspec gemv: split must be 1-8 and divide block_n");
  if ((transposed ? K : N) % 8 != 0 || !aligned16(w.untyped_data()) || !aligned16(x.untyped_data()))
    return ffi::Error::InvalidArgument("jspec gemv: W's contiguous dimension must be a multiple of 8, buffers 16-byte aligned");
  const int32_t* layer_ptr = stacked ? layer.typed_data() : nullptr;
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const __nv_bfloat16*>(w.untyped_data());
  cudaError_t err;
  switch (y->element_type()) {
    case ffi::DataType::BF16:
      err = launch(stream, transposed, static_cast<int>(block_n), layer_ptr, xp, wp,
                   reinterpret_cast<__nv_bfloat16*>(y->untyped_data()), M, K, N, static_cast<int>(split));
      break;
    case ffi::DataType::F32:
      err = launch(stream, transposed, static_cast<int>(block_n), layer_ptr, xp, wp,
                   reinterpret_cast<float*>(y->untyped_data()), M, K, N, static_cast<int>(split));
      break;
    default:
      return ffi::Error::InvalidArgument("jspec gemv: the result must be bfloat16 or float32");
  }
  if (err != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transposed")
                                  .Attr<bool>("stacked")
                                  .Attr<int64_t>("block_n")
                                  .Attr<int64_t>("split"));
