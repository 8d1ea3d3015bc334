// Query tiles over packed variable-length sequences. A tile is up to `m` consecutive tokens of
// one sequence (tiles never cross a sequence boundary). Sequence s owns tile ids
// [s + cu[s] / m, s + cu[s] / m + ceil(len_s / m)), which never overlap the next sequence's
// (floor(a + len) >= floor(a) + floor(len)), so a grid of nseq + T / m + 1 tiles covers all;
// ids past a sequence's last tile are empty.
#pragma once

#include <cstdint>

namespace msa::cuda::kern {

struct QueryTile {
  int64_t seq_start;  // packed index of the sequence's first token
  int32_t seq;        // the sequence's index
  int32_t seq_len;
  int32_t first;      // position of the tile's first token inside its sequence
  int32_t count;      // tokens in the tile (0: empty tile id)
};

// v clamped to [lo, hi].
__host__ __device__ inline int64_t clamp_offset(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// cu_seqlens == nullptr: one sequence of T tokens.
__device__ inline QueryTile decode_tile(const int32_t* cu_seqlens, int32_t nseq, int64_t T,
                                        int32_t m, int64_t tile_id) {
  QueryTile t{0, 0, 0, 0, 0};
  int32_t s = 0;
  if (cu_seqlens != nullptr) {
    // The last sequence s with base(s) <= tile_id.
    int32_t lo = 0, hi = nseq - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) >> 1;
      const int64_t base = mid + cu_seqlens[mid] / m;
      if (base <= tile_id) lo = mid; else hi = mid - 1;
    }
    s = lo;
    t.seq = s;
    // Clamped to [0, T] and to a non-negative length: cu_seqlens lives on the device and is not
    // validated on the host, so a malformed one must not send any access out of bounds.
    const int64_t start = clamp_offset(cu_seqlens[s], 0, T);
    const int64_t end = clamp_offset(cu_seqlens[s + 1], start, T);
    t.seq_start = start;
    t.seq_len = static_cast<int32_t>(end - start);
  } else {
    t.seq_len = static_cast<int32_t>(T);
  }
  const int64_t j = tile_id - (s + t.seq_start / m);
  const int64_t first = j * m;
  if (j < 0 || first >= t.seq_len) return t;
  t.first = static_cast<int32_t>(first);
  t.count = static_cast<int32_t>(t.seq_len - first < m ? t.seq_len - first : m);
  return t;
}

// Position of new token t (packed) of a paged call inside its sequence (and the sequence, when
// `seq` is given). The new tokens are the last n_s of their sequence's seq_lens[s] positions.
// Values are clamped (lengths to [0, cap], cu_q to [0, Tq]): malformed ones never index out of
// bounds.
__device__ inline int32_t paged_position(const int32_t* cu_q, int32_t nseq, int32_t Tq,
                                         const int32_t* seq_lens, int32_t cap, int64_t t,
                                         int32_t* seq = nullptr) {
  int32_t lo = 0, hi = nseq - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (clamp_offset(cu_q[mid], 0, Tq) <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t start = clamp_offset(cu_q[lo], 0, Tq);
  const int64_t n = clamp_offset(cu_q[lo + 1], start, Tq) - start;
  const int32_t len = static_cast<int32_t>(clamp_offset(seq_lens[lo], 0, cap));
  const int64_t base = len - n > 0 ? len - n : 0;
  if (seq != nullptr) *seq = lo;
  return static_cast<int32_t>(base + (t - start));
}

inline int64_t num_tile_ids(int32_t nseq, int64_t T, int32_t m) { return nseq + T / m + 1; }

}  // namespace msa::cuda::kern
