"""CUDA source of the ``cuda_p2p`` allreduce kernels, compiled at run time with NVRTC (cupy).

Owns the device side only: buffer/flag layout constants shared with ``cuda_p2p`` and the
one-shot / two-shot kernels. Header-free on purpose (bf16/fp16 conversions by hand or PTX), so
NVRTC needs no CUDA include path.

Every rank's IPC allocation is ``[signal area | data buffer]``. The signal area holds, per
phase (start, middle, end) and per block, one uint32 arrival word per source rank, then one
call counter per block, then the give-up word. Block b of every rank meets block b of every
other rank at each phase: thread t < world stores the call number into rank t's word for
(phase, b, me) with a system-scope release, then spins with system-scope acquire loads on its
own word for (phase, b, t). The call number lives in device memory, so a CUDA graph replays
correctly.

The spin is bounded: past ``timeout_ns`` of the GPU's global timer (nanoseconds, independent
of clock boosts) the thread gives up, records why (``cuda_p2p_flag`` encoding) in its give-up
word and in a host-mapped word, and the block returns; any later kernel on that rank sees its
give-up word and returns at once. A dead rank or P2P that is advertised but broken therefore
costs one timeout, not a hung GPU, and the host turns the flag into an error.
"""

from __future__ import annotations

from comm_backends.cuda_p2p_flag import FAILED_BIT

MAX_RANKS = 8
MAX_BLOCKS = 32
THREADS = 512
PHASES = 3
SIGNAL_BYTES = 4096  # >= (PHASES * MAX_BLOCKS * MAX_RANKS + MAX_BLOCKS + 1) * 4, page aligned
ERROR_WORD = PHASES * MAX_BLOCKS * MAX_RANKS + MAX_BLOCKS  # uint32 index of the give-up word
KERNELS = tuple(f"{algo}<{kind}>" for algo in ("one_shot", "two_shot") for kind in ("F32", "BF16", "F16"))
# Spins between reads of the global timer (and of the give-up word): a timer read is cheap, but
# there is no need to take it on every poll of a flag that usually flips within microseconds.
SPINS_PER_CHECK = 256

assert (ERROR_WORD + 1) * 4 <= SIGNAL_BYTES

_BODY = r"""
#define COUNTERS (3 * MAX_BLOCKS * MAX_RANKS)
#define ERROR_WORD (COUNTERS + MAX_BLOCKS)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// ---- element kinds: storage type and fp32 conversions ------------------------------------
struct F32 {
  typedef float S;
  static __device__ __forceinline__ float to_f(S x) { return x; }
  static __device__ __forceinline__ S from_f(float x) { return x; }
};
struct BF16 {
  typedef u16 S;
  static __device__ __forceinline__ float to_f(S x) { return __uint_as_float(((u32)x) << 16); }
  static __device__ __forceinline__ S from_f(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (S)((u >> 16) | 0x40u);  // keep NaN a NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (S)(u >> 16);
  }
};
struct F16 {
  typedef u16 S;
  static __device__ __forceinline__ float to_f(S x) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
  }
  static __device__ __forceinline__ S from_f(float x) {
    S h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h;
  }
};

template <typename E> struct Pack {
  enum { N = 16 / sizeof(typename E::S) };
  union { uint4 v; typename E::S e[N]; };
};

// ---- cross-GPU flags -----------------------------------------------------------------------
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

struct Table {  // device array: data pointers of ranks 0..MAX_RANKS-1, signal pointers, and
  u64 data[MAX_RANKS];
  u64 sig[MAX_RANKS];
  u64 host_error;  // the host-mapped give-up word of this rank
};

__device__ __forceinline__ u64 global_ns() {
  u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}

__device__ __forceinline__ u32 gave_up(const Table* t, int rank) {
  return *((volatile const u32*)t->sig[rank] + ERROR_WORD);
}

__device__ void give_up(const Table* t, int rank, int peer, int phase) {
  const u32 code = FAILED_BIT | ((u32)blockIdx.x & 0xffu) << 16 | ((u32)phase & 0xffu) << 8 |
                   ((u32)peer & 0xffu);
  atomicCAS((u32*)t->sig[rank] + ERROR_WORD, 0u, code);  // the first reason wins
  *(volatile u32*)t->host_error = code;
  __threadfence_system();
}

// Wait for every rank's block at `phase`. False: stop (this rank gave up, now or before); the
// whole block returns then, so no thread is left behind at a later __syncthreads.
__device__ __forceinline__ bool meet(const Table* t, int rank, int world, int phase, u32 call,
                                     u64 timeout_ns) {
  __shared__ int stop[3];  // one per phase: a thread still reading phase p's never races a write
  if (threadIdx.x == 0) stop[phase] = gave_up(t, rank) != 0;
  __syncthreads();  // every thread of this block is done with the previous phase
  if (!stop[phase] && threadIdx.x < world) {
    const int base = (phase * MAX_BLOCKS + blockIdx.x) * MAX_RANKS;
    u32* theirs = (u32*)t->sig[threadIdx.x] + base + rank;
    const u32* mine = (const u32*)t->sig[rank] + base + threadIdx.x;
    __threadfence_system();  // the block's data writes are visible system-wide before the flag
    st_release_sys(theirs, call);
    u64 start = 0;
    for (u32 spins = 1; ld_acquire_sys(mine) != call; ++spins) {
      if (spins % SPINS_PER_CHECK) continue;
      const u64 now = global_ns();
      if (start == 0) start = now;
      if (gave_up(t, rank)) {
        stop[phase] = 1;
        break;
      }
      if (now - start > timeout_ns) {
        give_up(t, rank, threadIdx.x, phase);
        stop[phase] = 1;
        break;
      }
    }
  }
  __syncthreads();
  return !stop[phase];
}

__device__ __forceinline__ u32 next_call(const Table* t, int rank) {
  return ((const u32*)t->sig[rank])[COUNTERS + blockIdx.x] + 1;
}
__device__ __forceinline__ void finish_call(const Table* t, int rank, u32 call) {
  if (threadIdx.x == 0) ((u32*)t->sig[rank])[COUNTERS + blockIdx.x] = call;
}

// Sum pack p over ranks 0..world-1 in that order (same order everywhere: bit-identical).
template <typename E>
__device__ __forceinline__ uint4 reduce_pack(const Table* t, int world, u64 p) {
  float acc[Pack<E>::N];
  #pragma unroll
  for (int i = 0; i < Pack<E>::N; ++i) acc[i] = 0.f;
  for (int r = 0; r < world; ++r) {
    Pack<E> in;
    in.v = ((const uint4*)t->data[r])[p];
    #pragma unroll
    for (int i = 0; i < Pack<E>::N; ++i) acc[i] += E::to_f(in.e[i]);
  }
  Pack<E> out;
  #pragma unroll
  for (int i = 0; i < Pack<E>::N; ++i) out.e[i] = E::from_f(acc[i]);
  return out.v;
}

// Store pack p of the result, only its first `valid` lanes when it is the ragged last one.
template <typename E>
__device__ __forceinline__ void store_pack(typename E::S* out, u64 p, uint4 v, u64 n) {
  const u64 first = p * Pack<E>::N;
  if (first + Pack<E>::N <= n) {
    ((uint4*)out)[p] = v;
    return;
  }
  Pack<E> tail;
  tail.v = v;
  for (u64 i = first; i < n; ++i) out[i] = tail.e[i - first];
}

// ---- kernels -------------------------------------------------------------------------------
// Inputs are already staged in every rank's data buffer; `out` is 16-byte aligned.
template <typename E>
__global__ void __launch_bounds__(1024) one_shot(const Table* t, u64 out_addr, u64 n, int rank, int world,
                                                 u64 timeout_ns) {
  typename E::S* out = (typename E::S*)out_addr;
  const u32 call = next_call(t, rank);
  if (!meet(t, rank, world, 0, call, timeout_ns)) return;
  const u64 packs = (n + Pack<E>::N - 1) / Pack<E>::N;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 p = (u64)blockIdx.x * blockDim.x + threadIdx.x; p < packs; p += stride)
    store_pack<E>(out, p, reduce_pack<E>(t, world, p), n);
  if (!meet(t, rank, world, 2, call, timeout_ns)) return;  // nobody restages while a peer reads
  finish_call(t, rank, call);
}

// Rank r owns packs [r*seg, (r+1)*seg): it reduces them into its own buffer (nobody else reads
// that range before the middle meeting), then everyone copies each owner's range. Both loops
// walk a range with the same block/thread mapping, so block b only reads what block b of the
// owner wrote, which is exactly what the per-block meeting orders.
template <typename E>
__global__ void __launch_bounds__(1024) two_shot(const Table* t, u64 out_addr, u64 n, int rank, int world,
                                                 u64 timeout_ns) {
  typename E::S* out = (typename E::S*)out_addr;
  const u32 call = next_call(t, rank);
  if (!meet(t, rank, world, 0, call, timeout_ns)) return;
  const u64 packs = (n + Pack<E>::N - 1) / Pack<E>::N;
  const u64 seg = (packs + world - 1) / world;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  for (u64 i = first; i < seg; i += stride) {
    const u64 p = rank * seg + i;
    if (p < packs) ((uint4*)t->data[rank])[p] = reduce_pack<E>(t, world, p);
  }
  if (!meet(t, rank, world, 1, call, timeout_ns)) return;
  for (int k = 0; k < world; ++k) {
    const uint4* src = (const uint4*)t->data[k];
    for (u64 i = first; i < seg; i += stride) {
      const u64 p = k * seg + i;
      if (p < packs) store_pack<E>(out, p, src[p], n);
    }
  }
  if (!meet(t, rank, world, 2, call, timeout_ns)) return;
  finish_call(t, rank, call);
}
"""

SOURCE = (f"#define MAX_RANKS {MAX_RANKS}\n#define MAX_BLOCKS {MAX_BLOCKS}\n"
          f"#define FAILED_BIT {FAILED_BIT:#x}u\n#define SPINS_PER_CHECK {SPINS_PER_CHECK}\n" + _BODY)
