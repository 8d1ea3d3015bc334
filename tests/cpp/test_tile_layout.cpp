// The numbering of tiles and key rows the Hopper kernels share (src/cuda/device/tile.cuh), checked
// on the host: its functions are plain integer code, compiled here as host functions. For random
// packed, paged and apart (cu_seqlens_k) layouts, including empty sequences, sequences without
// tokens and key offsets off block edges:
//   query tiles (decode_tile, PagedKeys::place) cover every token once, inside its sequence, at
//     its key position (the last n_s of the sequence's m_s keys);
//   KV tiles (PagedKeys::tile_of) cover every key row of every sequence once, in blocks of Bk
//     keys of one sequence, with that sequence's tokens; first_kv_tile(s) + b names block b of s
//     (the numbering the reverse index, the split's counting and the selection's re-ranking use);
//   the mask a KV-side kernel applies (token u sees key j of a tile where u - token_base >= j)
//   is the causal rule on positions; the query tiles' producer reads block b of a sequence at
//   key_start + b Bk;
//   with malformed offsets (checks off) every key row named lies inside the key tensors.
// The CUDA kernels built on them are compared with the CPU backend in test_cuda.cpp.
#if !defined(__CUDACC__)
#define __host__
#define __device__
#include "../../src/cuda/device/tile.cuh"
#undef __device__
#undef __host__
#else
#include "../../src/cuda/device/tile.cuh"
#endif

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using msa::cuda::kern::num_tile_ids;
using msa::cuda::kern::PagedKeys;
using msa::cuda::kern::QueryTile;

std::vector<int32_t> offsets(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(1, 0);
  for (int32_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

// A layout: per sequence n_s tokens and m_s >= n_s keys (m_s = n_s: the tokens are the keys).
struct Layout {
  std::vector<int32_t> n, m;
  std::vector<int32_t> cu, cu_k;
  int32_t T = 0, Tk = 0, nseq = 0;
  Layout(std::vector<int32_t> n_, std::vector<int32_t> m_) : n(std::move(n_)), m(std::move(m_)) {
    cu = offsets(n);
    cu_k = offsets(m);
    T = cu.back();
    Tk = cu_k.back();
    nseq = static_cast<int32_t>(n.size());
  }
  int32_t seq_of_token(int64_t t) const {
    return static_cast<int32_t>(std::upper_bound(cu.begin(), cu.end(), static_cast<int32_t>(t)) - cu.begin()) - 1;
  }
  // Token t's key position: after the m_s - n_s keys before its sequence's first token.
  int64_t position(int64_t t) const {
    const int32_t s = seq_of_token(t);
    return m[s] - n[s] + (t - cu[s]);
  }
};

Layout random_layout(std::mt19937& rng, bool apart) {
  std::uniform_int_distribution<int32_t> seqs(1, 7), len(0, 700), extra(0, 900), pick(0, 9);
  const int32_t nseq = seqs(rng);
  std::vector<int32_t> n(nseq), m(nseq);
  for (int32_t s = 0; s < nseq; ++s) {
    const int32_t kind = pick(rng);
    n[s] = kind == 0 ? 0 : (kind == 1 ? 1 : len(rng));  // empty, one token, or many
    m[s] = n[s] + (apart ? (kind == 2 ? 0 : extra(rng)) : 0);  // apart: keys without tokens too
  }
  return Layout(n, m);
}

std::string describe(const Layout& l) {
  std::string d = "n/m:";
  for (int32_t s = 0; s < l.nseq; ++s) d += " " + std::to_string(l.n[s]) + "/" + std::to_string(l.m[s]);
  return d;
}

// Query tiles of m tokens: every token once, in its sequence, at its key position; the producer's
// first key row of the sequence (key_start) and the key space (key_len, rows).
void check_query_tiles(const Layout& l, const PagedKeys& keys, int32_t m_tok, bool apart) {
  std::vector<int> seen(l.T, 0);
  const int64_t ids = num_tile_ids(l.nseq, l.T, m_tok);
  for (int64_t id = 0; id < ids + 3; ++id) {  // ids past the grid: empty
    QueryTile t = msa::cuda::kern::decode_tile(l.cu.data(), l.nseq, l.T, m_tok, id);
    keys.place(t);
    if (id >= ids) {
      EXPECT_EQ(t.count, 0) << "tile id " << id << " past the grid";
      continue;
    }
    if (t.count == 0) continue;
    ASSERT_LE(t.count, m_tok);
    ASSERT_EQ(t.seq_start, l.cu[t.seq]);
    ASSERT_EQ(t.seq_len, l.n[t.seq]);
    ASSERT_LE(t.first + t.count, t.seq_len) << "a tile crosses its sequence's end";
    EXPECT_EQ(t.key_len, l.m[t.seq]);
    EXPECT_EQ(keys.key_start(t), apart ? l.cu_k[t.seq] : l.cu[t.seq]);
    for (int32_t u = 0; u < t.count; ++u) {
      const int64_t tok = t.seq_start + t.first + u;
      ++seen[tok];
      EXPECT_EQ(t.pos0 + u, l.position(tok)) << "token " << tok;
    }
  }
  for (int32_t tok = 0; tok < l.T; ++tok) ASSERT_EQ(seen[tok], 1) << "token " << tok << " in " << seen[tok] << " tiles";
  EXPECT_EQ(keys.rows(l.T), apart ? l.Tk : l.T);
}

// KV tiles of Bk keys: every key row once (first_row + j), its sequence's tokens, the numbering
// first_kv_tile(s) + b, and the mask u - token_base >= j against the positions.
void check_kv_tiles(const Layout& l, const PagedKeys& keys, int32_t bk, bool apart) {
  const int32_t key_total = apart ? l.Tk : l.T;
  std::vector<int> seen(key_total, 0);
  const int64_t ids = num_tile_ids(l.nseq, key_total, bk);
  std::vector<std::vector<int64_t>> block_tile(l.nseq);  // [s][b]: the tile id of block b of s
  for (int64_t x = 0; x < ids; ++x) {
    const QueryTile t = keys.tile_of(l.cu.data(), l.nseq, l.T, bk, x);
    if (t.count == 0) continue;
    const int32_t s = t.seq;
    ASSERT_GE(s, 0);
    ASSERT_LT(s, l.nseq);
    ASSERT_EQ(t.first % bk, 0) << "tile " << x;
    ASSERT_LE(t.count, bk);
    ASSERT_LE(t.first + t.count, l.m[s]) << "tile " << x << " past its sequence's keys";
    EXPECT_EQ(t.seq_start, l.cu[s]) << "tile " << x << ": not its sequence's tokens";
    EXPECT_EQ(t.seq_len, l.n[s]);
    EXPECT_EQ(t.key_len, l.m[s]);
    const int64_t row0 = keys.first_row(t, bk);
    EXPECT_EQ(row0, (apart ? l.cu_k[s] : l.cu[s]) + t.first);
    for (int32_t j = 0; j < t.count; ++j) ++seen[row0 + j];
    const int32_t b = t.first / bk;
    if (static_cast<int32_t>(block_tile[s].size()) <= b) block_tile[s].resize(b + 1, -1);
    block_tile[s][b] = x;
    // The mask: token u of the sequence sees key first + j iff its position is at least that.
    const int64_t base = keys.token_base(t);
    for (int32_t u = 0; u < l.n[s]; ++u) {
      const int64_t tok = l.cu[s] + u;
      for (int32_t j = 0; j < t.count; ++j)
        ASSERT_EQ(tok - base >= j, l.position(tok) >= t.first + j)
            << "tile " << x << ", token " << tok << ", key " << j;
    }
    // The dense entry lists start at the first token that sees the block (EntryList): before it
    // no token sees any key of the block, from it on the first key at least.
    const int64_t first_tok = std::max<int64_t>(base - t.seq_start, 0);
    if (first_tok > 0) ASSERT_LT(l.position(t.seq_start + first_tok - 1), t.first);
    if (first_tok < t.seq_len) ASSERT_GE(l.position(t.seq_start + first_tok), t.first);
  }
  for (int32_t r = 0; r < key_total; ++r) ASSERT_EQ(seen[r], 1) << "key row " << r << " in " << seen[r] << " tiles";
  for (int32_t s = 0; s < l.nseq; ++s) {
    const int32_t blocks = (l.m[s] + bk - 1) / bk;
    ASSERT_EQ(static_cast<int32_t>(block_tile[s].size()), blocks) << "sequence " << s;
    for (int32_t b = 0; b < blocks; ++b)
      EXPECT_EQ(keys.first_kv_tile(s, l.cu[s], bk) + b, block_tile[s][b]) << "sequence " << s << ", block " << b;
  }
}

TEST(TileLayout, PackedTokensAreTheirKeys) {
  std::mt19937 rng(7);
  for (int rep = 0; rep < 200; ++rep) {
    const Layout l = random_layout(rng, /*apart=*/false);
    SCOPED_TRACE(describe(l));
    const PagedKeys keys;  // the default: the tokens' own
    EXPECT_FALSE(keys.keyed());
    for (int32_t m_tok : {16, 64, 128}) check_query_tiles(l, keys, m_tok, false);
    for (int32_t bk : {64, 128}) check_kv_tiles(l, keys, bk, false);
    if (HasFatalFailure()) return;
  }
}

TEST(TileLayout, KeysApartFromTokens) {
  std::mt19937 rng(11);
  for (int rep = 0; rep < 200; ++rep) {
    const Layout l = random_layout(rng, /*apart=*/true);
    SCOPED_TRACE(describe(l));
    PagedKeys keys;
    keys.cu_k = l.cu_k.data();
    keys.kv_rows = l.Tk;
    EXPECT_TRUE(keys.keyed());
    for (int32_t m_tok : {16, 64, 128}) check_query_tiles(l, keys, m_tok, true);
    for (int32_t bk : {64, 128}) check_kv_tiles(l, keys, bk, true);
    if (HasFatalFailure()) return;
  }
}

// Apart offsets equal to the tokens' describe the same call: the same tiles, rows and masks.
TEST(TileLayout, ApartOffsetsEqualToTheTokensChangeNothing) {
  std::mt19937 rng(13);
  for (int rep = 0; rep < 100; ++rep) {
    const Layout l = random_layout(rng, /*apart=*/false);
    SCOPED_TRACE(describe(l));
    PagedKeys apart;
    apart.cu_k = l.cu.data();
    apart.kv_rows = l.T;
    const PagedKeys packed;
    for (int32_t bk : {64, 128}) {
      for (int64_t x = 0; x < num_tile_ids(l.nseq, l.T, bk); ++x) {
        const QueryTile a = apart.tile_of(l.cu.data(), l.nseq, l.T, bk, x);
        const QueryTile p = packed.tile_of(l.cu.data(), l.nseq, l.T, bk, x);
        ASSERT_EQ(a.count, p.count) << "tile " << x;
        if (a.count == 0) continue;
        EXPECT_EQ(apart.first_row(a, bk), packed.first_row(p, bk));
        EXPECT_EQ(apart.token_base(a), packed.token_base(p));
        EXPECT_EQ(apart.first_kv_tile(a.seq, a.seq_start, bk), packed.first_kv_tile(p.seq, p.seq_start, bk));
      }
      for (int64_t id = 0; id < num_tile_ids(l.nseq, l.T, bk); ++id) {
        QueryTile a = msa::cuda::kern::decode_tile(l.cu.data(), l.nseq, l.T, bk, id);
        QueryTile p = a;
        apart.place(a);
        packed.place(p);
        EXPECT_EQ(a.pos0, p.pos0);
        EXPECT_EQ(a.key_len, p.key_len);
      }
    }
  }
}

// A prefill's pages: KV tile x is block x % max_pages of sequence x / max_pages, read from its
// page; the tokens are the last n_s of the m_s cached keys, and the mask is the causal rule.
TEST(TileLayout, PagedPrefillKeys) {
  std::mt19937 rng(17);
  const int32_t bk = 64, max_pages = 20, pages = 200;
  for (int rep = 0; rep < 100; ++rep) {
    Layout l = random_layout(rng, /*apart=*/true);
    for (int32_t s = 0; s < l.nseq; ++s) l.m[s] = std::min(l.m[s], max_pages * bk);
    for (int32_t s = 0; s < l.nseq; ++s) l.n[s] = std::min(l.n[s], l.m[s]);
    l = Layout(l.n, l.m);
    SCOPED_TRACE(describe(l));
    std::vector<int32_t> table(size_t(l.nseq) * max_pages);
    std::uniform_int_distribution<int32_t> page(0, pages - 1);
    for (int32_t& p : table) p = page(rng);
    PagedKeys keys;
    keys.page_table = table.data();
    keys.pt_s0 = max_pages;
    keys.seq_lens = l.m.data();
    keys.key_cap = max_pages * bk;
    keys.kv_rows = pages * bk;
    for (int64_t x = 0; x < keys.kv_tiles(l.nseq, bk); ++x) {
      const QueryTile t = keys.tile_of(l.cu.data(), l.nseq, l.T, bk, x);
      const int32_t s = static_cast<int32_t>(x / max_pages), b = static_cast<int32_t>(x % max_pages);
      const bool real = l.n[s] > 0 && b * bk < l.m[s];
      ASSERT_EQ(t.count > 0, real) << "tile " << x;
      if (!real) continue;
      EXPECT_EQ(keys.first_row(t, bk), int64_t(table[s * max_pages + b]) * bk);
      EXPECT_EQ(keys.first_kv_tile(s, l.cu[s], bk) + b, x);
      const int64_t base = keys.token_base(t);
      for (int32_t u = 0; u < l.n[s]; ++u)
        for (int32_t j = 0; j < t.count; ++j)
          ASSERT_EQ(l.cu[s] + u - base >= j, l.position(l.cu[s] + u) >= t.first + j);
    }
    for (int32_t m_tok : {16, 128}) {
      for (int64_t id = 0; id < num_tile_ids(l.nseq, l.T, m_tok); ++id) {
        QueryTile t = msa::cuda::kern::decode_tile(l.cu.data(), l.nseq, l.T, m_tok, id);
        keys.place(t);
        if (t.count == 0) continue;
        EXPECT_EQ(t.pos0, l.position(t.seq_start + t.first));
        EXPECT_EQ(t.key_len, l.m[t.seq]);
      }
    }
  }
}

// Unchecked key offsets (Launch::check_values off): decreasing, past Tk, negative. Every key row a
// tile names lies inside the key tensors, and no tile holds more keys than a block.
TEST(TileLayout, MalformedKeyOffsetsStayInBounds) {
  std::mt19937 rng(19);
  std::uniform_int_distribution<int32_t> wild(-300, 3000);
  for (int rep = 0; rep < 300; ++rep) {
    const Layout l = random_layout(rng, /*apart=*/true);
    std::vector<int32_t> bad = l.cu_k;
    for (int32_t& v : bad)
      if (rng() % 3 == 0) v = wild(rng);
    PagedKeys keys;
    keys.cu_k = bad.data();
    keys.kv_rows = l.Tk;
    for (int32_t bk : {64, 128}) {
      for (int64_t x = 0; x < num_tile_ids(l.nseq, l.Tk, bk) + 2; ++x) {
        const QueryTile t = keys.tile_of(l.cu.data(), l.nseq, l.T, bk, x);
        if (t.count == 0) continue;
        ASSERT_LE(t.count, bk);
        const int64_t row0 = keys.first_row(t, bk);
        ASSERT_GE(row0, 0);
        ASSERT_LE(row0 + t.count, l.Tk) << "tile " << x;
        ASSERT_GE(keys.first_kv_tile(t.seq, t.seq_start, bk), 0);
      }
      for (int64_t id = 0; id < num_tile_ids(l.nseq, l.T, bk); ++id) {
        QueryTile t = msa::cuda::kern::decode_tile(l.cu.data(), l.nseq, l.T, bk, id);
        keys.place(t);
        if (t.count == 0) continue;
        ASSERT_GE(keys.key_start(t), 0);
        ASSERT_LE(keys.key_start(t) + t.key_len, l.Tk);
        ASSERT_GE(t.pos0, 0);
      }
    }
  }
}

}  // namespace
