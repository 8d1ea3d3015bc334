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
  // Key space: the key position of the tile's first token and the sequence's keys. A packed
  // sequence attends to itself (pos0 = first, key_len = seq_len); a paged call's new tokens are
  // the last ones of a longer cached sequence (set by the kernels that read a page table).
  int32_t pos0;
  int32_t key_len;
};

// v clamped to [lo, hi].
__host__ __device__ inline int64_t clamp_offset(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Where the keys lie (their rows in the key tensors), for the kernels that run over packed
// tokens. Three layouts:
//   packed (the default): the keys are the tokens, each sequence attending to itself;
//   paged (a serving prefill run by the training kernels): the key tensors are pages
//     [page, Bk, H, D] viewed as kv_rows = pages * Bk rows, block b of sequence s is page
//     page_table[s * pt_s0 + b], and a tile's tokens (packed by cu_seqlens) are the last new ones
//     of their sequence's seq_lens[s] cached keys (clamped to key_cap = max_pages * Bk);
//   apart (cu_seqlens_k, docs/contract.md §1): the keys are packed in kv_rows = Tk rows of their
//     own, sequence s's m_s keys at rows [cu_k[s], cu_k[s + 1]), and its n_s tokens are the last
//     n_s positions of them.
// Values read from the device (seq_lens, cu_k, page ids) are clamped, so malformed ones never send
// an access out of bounds.
struct PagedKeys {
  const int32_t* page_table = nullptr;
  int64_t pt_s0 = 0;
  const int32_t* seq_lens = nullptr;
  int32_t key_cap = 0;
  int32_t kv_rows = 0;
  const int32_t* cu_k = nullptr;  // apart: [nseq + 1] key offsets (page_table null)

  // The keys are not the tokens themselves (paged or apart): a tile's pos0 is the position of
  // its first token among its sequence's keys.
  __host__ __device__ bool keyed() const { return page_table != nullptr || cu_k != nullptr; }
  // Rows of the key tensors (their TMA shape): the pages', the keys apart, or T packed ones.
  __host__ __device__ int32_t rows(int32_t T) const { return keyed() ? kv_rows : T; }
  // Apart: the first key row and the key count of sequence s.
  __device__ int64_t apart_start(int32_t s) const { return clamp_offset(cu_k[s], 0, kv_rows); }
  __device__ int32_t apart_len(int32_t s) const {
    const int64_t start = apart_start(s);
    return static_cast<int32_t>(clamp_offset(cu_k[s + 1], start, kv_rows) - start);
  }
  // The keys of sequence s, paged or apart (keyed()).
  __device__ int32_t seq_keys(int32_t s) const {
    return page_table != nullptr ? static_cast<int32_t>(clamp_offset(seq_lens[s], 0, key_cap)) : apart_len(s);
  }
  // The tile's key space (pos0, key_len) for paged or apart keys.
  __device__ void place(QueryTile& t) const {
    if (!keyed() || t.count == 0) return;
    const int32_t len = seq_keys(t.seq);
    t.pos0 = (len > t.seq_len ? len - t.seq_len : 0) + t.first;
    t.key_len = len;
  }
  // The page ids of the tile's sequence (null: packed keys, block b is tile b of its rows from
  // key_start).
  __device__ const int32_t* pages(const QueryTile& t) const {
    return page_table != nullptr ? page_table + t.seq * pt_s0 : nullptr;
  }
  // The row of the first key of the tile's sequence where its keys are packed (apart: cu_k's,
  // else the tokens' own).
  __device__ int64_t key_start(const QueryTile& t) const {
    return cu_k != nullptr ? apart_start(t.seq) : t.seq_start;
  }
  // KV-side passes (the KV-block forward of a prefill): KV tile x is block b = x % max_pages of
  // sequence s = x / max_pages (max_pages = key_cap / bk), kv_tiles(nseq, bk) ids in all.
  __host__ __device__ int64_t kv_tiles(int32_t nseq, int32_t bk) const { return int64_t(nseq) * (key_cap / bk); }
  // KV tile x as a QueryTile of its sequence's new tokens (seq, seq_start, seq_len), whose keys
  // are first = b * bk .. first + count - 1 (count 0: past the cached keys, or no new token),
  // pos0 the position of the sequence's first new token and key_len its cached keys.
  __device__ QueryTile kv_tile(const int32_t* cu, int32_t nseq, int64_t T, int32_t bk, int64_t x) const;
  // Keys apart: KV tile x numbered as decode_tile numbers bk keys of the key offsets cu_k, as a
  // QueryTile of its sequence's tokens (seq, seq_start, seq_len; none: count stays the keys',
  // whose gradients are zeros), whose keys are first .. first + count - 1, pos0 the position of
  // the sequence's first token and key_len its keys.
  __device__ QueryTile apart_tile(const int32_t* cu, int32_t nseq, int64_t T, int32_t bk, int64_t x) const;
  // The row in the key tensors of the first key of KV tile `t` (kv_tile's), its page clamped.
  __device__ int64_t kv_row(const QueryTile& t, int32_t bk) const { return page_row(t.seq, t.first / bk, bk); }
  // The same for a KV tile of any layout (tile_of's): kv_row with a page table, else the packed
  // row of the tile's first key.
  __device__ int64_t first_row(const QueryTile& t, int32_t bk) const {
    return page_table != nullptr ? kv_row(t, bk) : key_start(t) + t.first;
  }
  // For a KV tile of any layout: the packed index of the token at the position of the tile's
  // first key (a token u sees key j of the tile where u - token_base >= j; it may lie outside
  // the sequence's tokens).
  __device__ int64_t token_base(const QueryTile& t) const {
    return keyed() ? t.seq_start + t.first - t.pos0 : t.seq_start + t.first;
  }
  // The first row of block b of sequence s: its page's, the page id clamped.
  __device__ int64_t page_row(int32_t s, int32_t b, int32_t bk) const {
    const int32_t p = page_table[s * pt_s0 + b], pages = kv_rows / bk;
    return int64_t(p < 0 ? 0 : (p >= pages ? pages - 1 : p)) * bk;
  }
  // KV tile x of any layout: kv_tile's with a page table, apart_tile's with cu_k, else
  // decode_tile's (bk keys of a packed sequence).
  __device__ QueryTile tile_of(const int32_t* cu, int32_t nseq, int64_t T, int32_t bk, int64_t x) const;
  // The KV tile id of block 0 of sequence `seq` (whose tokens start at packed row `seq_start`):
  // the KV-side passes' numbering, seq * max_pages with a page table, else decode_tile's over
  // the keys' rows.
  __device__ int64_t first_kv_tile(int32_t seq, int64_t seq_start, int32_t bk) const {
    if (page_table != nullptr) return int64_t(seq) * (key_cap / bk);
    return seq + (cu_k != nullptr ? apart_start(seq) : seq_start) / bk;
  }
};

// cu_seqlens == nullptr: one sequence of T tokens.
__device__ inline QueryTile decode_tile(const int32_t* cu_seqlens, int32_t nseq, int64_t T,
                                        int32_t m, int64_t tile_id) {
  QueryTile t{0, 0, 0, 0, 0, 0, 0};
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
  t.pos0 = t.first;
  t.key_len = t.seq_len;
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

__device__ inline QueryTile PagedKeys::kv_tile(const int32_t* cu, int32_t nseq, int64_t T, int32_t bk,
                                               int64_t x) const {
  QueryTile t{0, 0, 0, 0, 0, 0, 0};
  const int32_t max_pages = key_cap / bk;
  const int64_t s = x / max_pages;
  if (s >= nseq) return t;
  t.seq = static_cast<int32_t>(s);
  const int64_t start = cu != nullptr ? clamp_offset(cu[s], 0, T) : 0;
  t.seq_start = start;
  t.seq_len = static_cast<int32_t>((cu != nullptr ? clamp_offset(cu[s + 1], start, T) : T) - start);
  const int32_t len = static_cast<int32_t>(clamp_offset(seq_lens[s], 0, key_cap));
  t.first = static_cast<int32_t>(x - s * max_pages) * bk;
  if (t.seq_len == 0 || t.first >= len) return t;
  t.count = len - t.first < bk ? len - t.first : bk;
  t.pos0 = len > t.seq_len ? len - t.seq_len : 0;
  t.key_len = len;
  return t;
}

__device__ inline QueryTile PagedKeys::apart_tile(const int32_t* cu, int32_t nseq, int64_t T, int32_t bk,
                                                  int64_t x) const {
  QueryTile t = decode_tile(cu_k, nseq, kv_rows, bk, x);  // the keys: seq, first, count
  if (t.count == 0) return t;
  const int32_t len = t.seq_len;
  const int64_t start = cu != nullptr ? clamp_offset(cu[t.seq], 0, T) : 0;
  t.seq_start = start;
  t.seq_len = static_cast<int32_t>((cu != nullptr ? clamp_offset(cu[t.seq + 1], start, T) : T) - start);
  t.pos0 = len > t.seq_len ? len - t.seq_len : 0;
  t.key_len = len;
  return t;
}

__device__ inline QueryTile PagedKeys::tile_of(const int32_t* cu, int32_t nseq, int64_t T, int32_t bk,
                                               int64_t x) const {
  if (page_table != nullptr) return kv_tile(cu, nseq, T, bk, x);
  return cu_k != nullptr ? apart_tile(cu, nseq, T, bk, x) : decode_tile(cu, nseq, T, bk, x);
}

inline int64_t num_tile_ids(int32_t nseq, int64_t T, int32_t m) { return nseq + T / m + 1; }

}  // namespace msa::cuda::kern
