// maskplug-cupy: apply grammar mask rows to compacted logits (maskplug DESIGN section 4.4).
//
// Mask row i with (r, p) = (request[i], position[i]) writes logits row cu[r] + p
// iff 0 <= r < num_requests, p >= 0 and p < cu[r + 1] - cu[r]. Columns below
// vocab_size whose bit is 0 become -inf, columns in [vocab_size, limit) become
// -inf (limit is the logits width with tail="mask", vocab_size with "keep"),
// nothing else is written.
//
// Written for NVRTC without any header: only built-in types (uint4 and the
// thread/block indices are built in) and CUDA's own integer types.
//
// Why it looks like this:
//  * Store-only. Logits are never read: a disallowed column gets the bit pattern
//    of -inf, an allowed one is not touched. The traffic is the mask words plus
//    the stores. It also makes duplicate mask rows (several mapped to one logits
//    row) safe without atomics: every block only ever writes -inf, so any
//    interleaving leaves the AND of the masks. A read-modify-write of a 16-byte
//    pack could put back a value another block had just masked.
//  * One thread per 16-byte pack (4 fp32 or 8 fp16/bf16 columns), consecutive
//    threads on consecutive packs, so a warp's stores cover 512 contiguous bytes.
//    A pack whose columns are all disallowed is one 16-byte store; all allowed is
//    skipped without a store; a mixed pack stores -inf element by element (the
//    stores of a warp still land in the same sectors, and L2 merges them).
//  * Element width, not dtype. The kernels see fp32 as 32-bit and fp16/bf16 as
//    16-bit patterns; the caller passes the -inf pattern, so two kernels cover
//    three dtypes.
//  * Launch shape: one block per (mask row, chunk of a row), flattened on
//    blockIdx.x (2^31 - 1 blocks allowed; y and z stop at 65,535). The host picks
//    the chunk so that a single decode row spreads over every SM and thousands of
//    rows keep blocks long enough to amortise the row lookup (four dependent
//    loads, resolved on the device: the host never learns which rows are live).

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

template <typename T, int PACK>
__device__ __forceinline__ void mask_rows(T* __restrict__ logits, i64 row_stride, const u32* __restrict__ bitmask,
                                          int words, const int* __restrict__ request,
                                          const int* __restrict__ position, const int* __restrict__ cu,
                                          int num_requests, int vocab_size, int limit, int chunks_per_row,
                                          int packs_per_chunk, int aligned, T ninf, uint4 ninf4) {
  const int i = blockIdx.x / chunks_per_row;
  const int chunk = blockIdx.x - i * chunks_per_row;
  const int r = request[i];
  if (r < 0 || r >= num_requests) return;  // unused row (or out of range): never read cu there
  const int p = position[i];
  const int c0 = cu[r];
  if (p < 0 || p >= cu[r + 1] - c0) return;  // trimmed by the verify budget

  T* __restrict__ row = logits + (i64)(c0 + p) * row_stride;
  const u32* __restrict__ bits = bitmask + (i64)i * words;
  const int num_packs = (limit + PACK - 1) / PACK;
  const int end = imin((chunk + 1) * packs_per_chunk, num_packs);
  const u32 full = (1u << PACK) - 1u;

#pragma unroll 4
  for (int k = chunk * packs_per_chunk + (int)threadIdx.x; k < end; k += (int)blockDim.x) {
    const int col = k * PACK;
    u32 drop;  // bit j set: column col + j becomes -inf
    if (col + PACK <= vocab_size) {
      // PACK divides 32 and col is a multiple of PACK, so the pack's bits sit in one word.
      drop = ~(bits[col >> 5] >> (col & 31)) & full;
    } else {
      drop = 0;
      for (int j = 0; j < PACK; ++j) {
        const int c = col + j;
        const bool allowed = c < vocab_size && ((bits[c >> 5] >> (c & 31)) & 1u);
        if (c < limit && !allowed) drop |= 1u << j;
      }
    }
    if (drop == 0) continue;
    if (drop == full && aligned) {
      *reinterpret_cast<uint4*>(row + col) = ninf4;
    } else {
#pragma unroll
      for (int j = 0; j < PACK; ++j) {
        if ((drop >> j) & 1u) row[col + j] = ninf;
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(256)
    maskplug_mask_b32(u32* __restrict__ logits, i64 row_stride, const u32* __restrict__ bitmask, int words,
                      const int* __restrict__ request, const int* __restrict__ position, const int* __restrict__ cu,
                      int num_requests, int vocab_size, int limit, int chunks_per_row, int packs_per_chunk,
                      int aligned, u32 ninf) {
  const uint4 ninf4 = make_uint4(ninf, ninf, ninf, ninf);
  mask_rows<u32, 4>(logits, row_stride, bitmask, words, request, position, cu, num_requests, vocab_size, limit,
                    chunks_per_row, packs_per_chunk, aligned, ninf, ninf4);
}

extern "C" __global__ void __launch_bounds__(256)
    maskplug_mask_b16(u16* __restrict__ logits, i64 row_stride, const u32* __restrict__ bitmask, int words,
                      const int* __restrict__ request, const int* __restrict__ position, const int* __restrict__ cu,
                      int num_requests, int vocab_size, int limit, int chunks_per_row, int packs_per_chunk,
                      int aligned, u32 ninf) {
  const u32 two = (ninf & 0xFFFFu) | (ninf << 16);
  const uint4 ninf4 = make_uint4(two, two, two, two);
  mask_rows<u16, 8>(logits, row_stride, bitmask, words, request, position, cu, num_requests, vocab_size, limit,
                    chunks_per_row, packs_per_chunk, aligned, (u16)ninf, ninf4);
}
