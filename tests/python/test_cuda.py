"""The CUDA backend against the CPU backend (the same op on CPU copies) and the eager reference.

Skipped unless ``msa.backend_available("cuda")``. Inputs are fresh random bf16/fp16 tensors;
the references see the same 16-bit values widened to float32 (CPU op) or float64 (reference).

Rules (docs/contract.md §2, §3): a CUDA selection is correct when every forced block is present and every
selected non-forced block scores at least the k-th best non-forced float64 score minus SEL_TOL;
attention outputs are within a relative L2 error of OUT_TOL (per tensor; ROW_FACTOR times that
per (token, head) row), LSE within LSE_TOL where finite, and -inf (with a zero output) exactly
where the reference's support is empty. Tests that compare attention pass one block_idx to both
sides.

MSA_TEST_DEVICE=cpu runs the same tests with the CPU backend as the device under test (a check
of the tests themselves; the stream, graph and synchronisation tests then skip).
"""

import functools
import importlib.util
import os
import re
import time

import pytest
import torch

import msa
from msa import reference as R
from conftest import check_selection

DEV = os.environ.get("MSA_TEST_DEVICE", "cuda")
IS_CUDA = DEV == "cuda"

if IS_CUDA:
    _ready = torch.cuda.is_available() and msa.backend_available("cuda")
    pytestmark = pytest.mark.skipif(not _ready, reason="the library has no usable CUDA backend")
cuda_only = pytest.mark.skipif(not IS_CUDA, reason="CUDA streams and graphs")


def skip_unbuilt(test):
    """Skips (instead of failing) a case whose variant this build of the library leaves out
    (e.g. a fast build with bf16, D = 128, Bk = 128 only): the library says "... built ..."."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except NotImplementedError as e:
            if re.search(r"\bbuilt\b", str(e)) and "no backend" not in str(e):
                pytest.skip(f"not in this build: {e}")
            raise
    return wrapper

BF16, FP16 = torch.bfloat16, torch.float16
OUT_TOL = {BF16: 1e-2, FP16: 3e-3}
ROW_FACTOR = 8.0
LSE_TOL = 1e-3
# Index scores accumulate in fp32 from 16-bit inputs (about 1e-6 from float64 at these sizes).
SEL_TOL = 5e-3
# Fraction of (token, index head) rows whose selection must equal the float64 reference's:
# only near-ties (gaps below the fp32 error) may differ.
SEL_SAME_ROWS = 0.99
# Work handed to the CPU backend per comparison (FLOPs); bigger problems compare a row sample.
CPU_FLOP_BUDGET = 1.5e9
MIN_SAMPLED_ROWS = 32


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------


def rand(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32, device=DEV).to(dtype)


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEV)


def seqs(lengths):
    out, a = [], 0
    for n in lengths:
        out.append((a, a + n))
        a += n
    return out


def positions(lengths):
    """Position of each packed token inside its sequence [T] (int64, on DEV)."""
    parts = [torch.arange(n, device=DEV) for n in lengths]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=DEV)


def random_block_idx(lengths, Hi, k, Bk, empty_rows=0.0, no_own=0.0, shuffle=True, pos=None):
    """A caller's block_idx [T, Hi, k]: the own block plus up to k-1 random earlier ones, in a
    random order with -1 anywhere (a set, contract §2); a fraction `empty_rows` of the rows is all
    -1 (empty support), a fraction `no_own` lacks the own block (allowed for a caller's). `pos`:
    each row's position (default: the tokens of `lengths`, e.g. other positions with keys apart)."""
    pos = positions(lengths) if pos is None else pos
    T = pos.numel()
    if T == 0:
        return torch.zeros((0, Hi, k), dtype=torch.int32, device=DEV)
    own = pos // Bk
    nb = int(own.max()) + 1
    blk = torch.arange(nb, device=DEV)
    score = torch.rand(T, Hi, nb, device=DEV)
    score = torch.where(blk == own[:, None, None], torch.full_like(score, 2.0), score)
    score = torch.where(blk > own[:, None, None], torch.full_like(score, -1.0), score)
    kk = min(k, nb)
    val, idx = score.topk(kk, dim=-1)
    idx = torch.where(val >= 0, idx, torch.full_like(idx, -1))
    if kk < k:
        idx = torch.cat([idx, idx.new_full((T, Hi, k - kk), -1)], dim=-1)
    if no_own > 0:
        drop = (torch.rand(T, Hi, 1, device=DEV) < no_own) & (idx == own[:, None, None])
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    if empty_rows > 0:
        drop = torch.rand(T, Hi, device=DEV) < empty_rows
        idx = torch.where(drop[..., None], torch.full_like(idx, -1), idx)
    if shuffle:
        perm = torch.rand(T, Hi, k, device=DEV).argsort(dim=-1)
        idx = idx.gather(-1, perm)
    return idx.to(torch.int32).contiguous()


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------


def ref_attention(q, k, v, block_idx, lengths, Bk, scale=None):
    """contract §3/§5 with reference.py in float64 on the device, one index head (sparse) or one
    KV head (dense) at a time to bound memory: (out [T, Hq, D] f64, lse [T, Hq] f64)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cu = cu_of(lengths)
    wide = [x.detach().to(torch.float64) for x in (q, k, v)]
    groups = block_idx.shape[1] if block_idx is not None else Hkv
    hpg = Hq // groups  # query heads per chunk: one index head's, or one KV head's
    outs, lses = [], []
    for g in range(groups):
        h0 = g * hpg
        r = h0 // G
        bi = None if block_idx is None else block_idx[:, g:g + 1]
        o, lse, _ = R.attention_over_support_ref(
            wide[0][:, h0:h0 + hpg], wide[1][:, r:r + 1], wide[2][:, r:r + 1], None, None, bi,
            block_size=Bk, cu_seqlens=cu, scale=scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def sample_rows(T, per_row_flops):
    """None (all rows) when the CPU backend can afford the whole problem, else sorted rows."""
    if T * per_row_flops <= CPU_FLOP_BUDGET:
        return None
    n = max(MIN_SAMPLED_ROWS, int(CPU_FLOP_BUDGET // max(per_row_flops, 1)))
    n = min(n, T)
    return torch.randperm(T, device=DEV)[:n].sort().values


def cpu_attention(q, k, v, block_idx, lengths, Bk, rows=None, scale=None):
    """The same op on the CPU backend, float32 copies: (out, lse) on DEV, valid on `rows`.

    With `rows`, every other row's support is emptied (sparse), and a dense problem becomes
    the sparse one whose rows list every block up to their own (equal to dense, contract §3)."""
    cu = cu_of(lengths).cpu()
    q32, k32, v32 = (x.detach().cpu().float() for x in (q, k, v))
    if block_idx is None and rows is None:
        out, _, lse = msa.warmup_attention(q32, k32, v32, None, None, cu_seqlens=cu, scale=scale,
                                           kl_value=False, return_lse=True)
        return out.to(DEV), lse.to(DEV)
    if block_idx is None:  # dense rows as a sparse problem listing all causal blocks
        pos = positions(lengths)
        nb = max(1, int(pos.max()) // Bk + 1) if pos.numel() else 1
        blk = torch.arange(nb, device=DEV, dtype=torch.int32)
        full = torch.where(blk[None] <= (pos // Bk)[:, None], blk[None], -1)
        block_idx = full[:, None, :].expand(-1, k.shape[1], -1).contiguous()  # Hi = Hkv
    bi = block_idx.detach().clone()
    if rows is not None:
        keep = torch.zeros(bi.shape[0], dtype=torch.bool, device=bi.device)
        keep[rows] = True
        bi = torch.where(keep[:, None, None], bi, torch.full_like(bi, -1))
    out, _, lse = msa.sparse_attention(q32, k32, v32, None, None, block_idx=bi.cpu(),
                                       block_size=Bk, cu_seqlens=cu, scale=scale,
                                       kl_value=False, return_lse=True)
    return out.to(DEV), lse.to(DEV)


def check_attention(out, lse, want_out, want_lse, dtype, name, rows=None):
    """OUT_TOL / LSE_TOL rules of the module docstring (on `rows` only when given)."""
    T, Hq, D = want_out.shape
    assert out.shape == (T, Hq, D) and out.dtype == dtype, f"{name}: out {out.shape} {out.dtype}"
    assert lse.shape == (T, Hq) and lse.dtype == torch.float32, f"{name}: lse {lse.dtype}"
    o, w = out.double(), want_out.double()
    l, wl = lse.double(), want_lse.double()
    if rows is not None:
        o, w, l, wl = o[rows], w[rows], l[rows], wl[rows]
    if w.numel() == 0:
        return
    assert torch.isfinite(o).all(), f"{name}: non-finite output"
    fin = torch.isfinite(wl)
    bad = fin != torch.isfinite(l)
    assert not bad.any(), (f"{name}: LSE finite/-inf pattern differs at {int(bad.sum())} rows, "
                           f"first {bad.nonzero()[:4].tolist()}")
    assert (l[~fin] == float("-inf")).all(), f"{name}: LSE of an empty row is not -inf"
    assert (o[~fin] == 0).all(), f"{name}: output of an empty row is not 0"
    if fin.any():
        lerr = (l - wl).abs()[fin].max().item()
        assert lerr < LSE_TOL, f"{name}: LSE max abs error {lerr:.3e}"
    norm = w.norm().item()
    if norm > 0:
        err = (o - w).norm().item() / norm
        assert err < OUT_TOL[dtype], f"{name}: out rel-L2 error {err:.3e} (tol {OUT_TOL[dtype]})"
    rn = w.norm(dim=-1)
    re = (o - w).norm(dim=-1) / rn.clamp_min(1e-30)
    re = torch.where(rn > 0, re, torch.zeros_like(re))
    worst = re.max().item()
    if worst >= ROW_FACTOR * OUT_TOL[dtype]:
        at = divmod(int(re.argmax()), Hq)
        raise AssertionError(f"{name}: worst row rel-L2 error {worst:.3e} at (row, head) {at}")


def check_against_references(out, lse, q, k, v, block_idx, lengths, Bk, dtype, scale=None):
    """Both references: the CPU op (a row sample when large) and reference.py."""
    T, Hq, D = q.shape
    keys_per_row = (block_idx.shape[2] * Bk) if block_idx is not None else (max(lengths or [1]))
    rows = sample_rows(T, 4.0 * keys_per_row * Hq * D)
    c_out, c_lse = cpu_attention(q, k, v, block_idx, lengths, Bk, rows=rows, scale=scale)
    check_attention(out, lse, c_out, c_lse, dtype, "vs CPU backend", rows=rows)
    r_out, r_lse = ref_attention(q, k, v, block_idx, lengths, Bk, scale=scale)
    check_attention(out, lse, r_out, r_lse, dtype, "vs reference.py")


def check_selection_vs_reference(bi, qi, ki, top_k, Bk, lengths, sink, local, scale_idx=None):
    """The contract §2 tolerance rule, plus: nearly all rows equal the exact float64 selection."""
    cu = cu_of(lengths)
    qi64, ki64 = qi.double(), ki.double()
    check_selection(bi, qi64, ki64, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                    local_blocks=local, scale_idx=scale_idx, tol=SEL_TOL)
    want = R.select_blocks_ref(qi64, ki64, top_k, Bk, cu, sink, local, scale_idx)
    if bi.shape[0]:
        same = (bi.to(want.device) == want).all(-1).double().mean().item()
        assert same >= SEL_SAME_ROWS, f"only {same:.4f} of the rows equal the exact selection"
    return want


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------
# Lengths 1, 113, 799, 4224 and packed sets with empty sequences; Bk 64/128; D 64/128;
# G = Hq/Hkv in 1..16; Hi = Hkv or 2*Hkv; Hik = 1 or Hi; bf16 and fp16. Di is 128 (docs/contract.md §1).

# (id, lengths, Hq, Hkv, Hi, Hik, D, Bk, top_k, dtype)
ATTN_CASES = [
    ("len1", [1], 8, 2, 2, 1, 128, 128, 16, BF16),
    ("len113_g4_bk64_d64", [113], 8, 2, 2, 1, 64, 64, 4, FP16),
    ("len799_mha_hik_eq_hi", [799], 4, 4, 4, 4, 64, 64, 8, BF16),
    ("len799_g8_hi2hkv", [799], 16, 2, 4, 1, 128, 128, 4, FP16),
    ("len799_g3", [799], 6, 2, 2, 2, 128, 128, 3, BF16),
    ("len4224_paper_heads", [4224], 64, 4, 4, 1, 128, 128, 16, BF16),
    ("len4224_g2_hi2hkv_bk64", [4224], 16, 8, 16, 16, 64, 64, 16, FP16),
    ("varlen_empty_g16", [0, 113, 0, 1, 799, 256, 0], 16, 1, 2, 1, 128, 128, 4, BF16),
    ("varlen_empty_bk64", [64, 0, 65, 4224, 0, 127], 8, 4, 4, 1, 64, 64, 16, FP16),
]
ATTN_IDS = [c[0] for c in ATTN_CASES]

# (id, lengths, Hi, Hik, Bk, top_k, sink, local, dtype)
SEL_CASES = [
    ("len1", [1], 4, 1, 128, 16, 0, 1, BF16),
    ("len113_bk64", [113], 2, 2, 64, 2, 0, 1, FP16),
    ("len799_sink", [799], 4, 1, 64, 8, 1, 1, BF16),
    ("len4224", [4224], 4, 1, 128, 16, 0, 1, BF16),
    ("len4224_bk64_local2", [4224], 8, 8, 64, 16, 1, 2, FP16),
    ("varlen_empty", [0, 113, 1, 0, 799, 1500, 0], 2, 1, 128, 4, 0, 1, BF16),
]
SEL_IDS = [c[0] for c in SEL_CASES]
DI = 128


# --------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", SEL_CASES, ids=SEL_IDS)
@skip_unbuilt
def test_select_blocks(case):
    _, lengths, Hi, Hik, Bk, top_k, sink, local, dtype = case
    T = sum(lengths)
    qi, ki = rand(T, Hi, DI, dtype=dtype), rand(T, Hik, DI, dtype=dtype)
    cu = cu_of(lengths)
    bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink, local_blocks=local)
    assert bi.shape == (T, Hi, top_k) and bi.dtype == torch.int32 and bi.device == qi.device
    want = check_selection_vs_reference(bi, qi, ki, top_k, Bk, lengths, sink, local)
    # the CPU backend (exact on the same values) where it is cheap enough
    if T * T * Hi * DI <= 2 * CPU_FLOP_BUDGET:
        c = msa.select_blocks(qi.cpu().float(), ki.cpu().float(), top_k, Bk, cu_seqlens=cu.cpu(),
                              sink_blocks=sink, local_blocks=local)
        assert torch.equal(c, want.cpu()), "the CPU backend and reference.py disagree"
    # deterministic
    assert torch.equal(bi, msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                             local_blocks=local))


@pytest.mark.parametrize("case", SEL_CASES, ids=SEL_IDS)
@skip_unbuilt
def test_select_blocks_fp8(case):
    """select_scores="fp8", with fp8_rerank 0 (the E4M3 copies decide) and 4 (they shortlist,
    the inputs re-rank): the rule over the scores of the copies (reference.py), the CPU
    backend's selection on the same inputs, and the recall of the inputs' own selection, higher
    with re-ranking."""
    _, lengths, Hi, Hik, Bk, top_k, sink, local, dtype = case
    T = sum(lengths)
    qi, ki = rand(T, Hi, DI, dtype=dtype), rand(T, Hik, DI, dtype=dtype)
    cu = cu_of(lengths)
    q8, k8 = R.fp8_index_copies_ref(qi, ki, Bk, cu)
    exact = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                              local_blocks=local)
    recall = {}
    for m in (0, 4):
        bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                               local_blocks=local, select_scores="fp8", fp8_rerank=m)
        if m == 0:
            check_selection(bi, q8, k8, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                            local_blocks=local, tol=SEL_TOL)
        else:
            check_selection(bi, qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                            local_blocks=local, tol=SEL_TOL, shortlist=(q8, k8, m))
        if T * T * Hi * DI <= 2 * CPU_FLOP_BUDGET:
            c = msa.select_blocks(qi.cpu(), ki.cpu(), top_k, Bk, cu_seqlens=cu.cpu(),
                                  sink_blocks=sink, local_blocks=local, select_scores="fp8",
                                  fp8_rerank=m)
            same = (c == bi.cpu()).all(-1).double().mean().item() if T else 1.0
            assert same >= SEL_SAME_ROWS, f"only {same:.4f} of the rows equal the CPU backend's"
        held = (bi.unsqueeze(-1) == exact.unsqueeze(-2)).any(-1) & (exact >= 0)
        recall[m] = held.sum().item() / max(1, (exact >= 0).sum().item())
        # deterministic (the re-ranking's lists are built by atomics)
        assert torch.equal(bi, msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu,
                                                 sink_blocks=sink, local_blocks=local,
                                                 select_scores="fp8", fp8_rerank=m))
    if T:
        assert recall[0] > 0.5 and recall[4] >= recall[0], recall


@skip_unbuilt
def test_select_blocks_fp8_rerank_every_candidate():
    """A shortlist that holds every candidate (fp8_rerank at least the blocks of the sequence)
    re-ranks them all by the inputs' scores, computed as the bf16 selection computes them: the
    selection equals select_scores="input" bit for bit, over several sequences and a negative
    scale."""
    Bk, top_k = 128, 8
    lengths = [1000, 129, 0, 2048, 77]
    cu = cu_of(lengths)
    T = sum(lengths)
    qi, ki = rand(T, 4, DI, dtype=BF16), rand(T, 2, DI, dtype=BF16)
    for scale in (None, -0.3):
        for sink, local in ((0, 1), (1, 2)):
            want = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                     local_blocks=local, scale_idx=scale)
            got = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                    local_blocks=local, scale_idx=scale, select_scores="fp8",
                                    fp8_rerank=16)
            assert torch.equal(got, want), (scale, sink, local)


@skip_unbuilt
def test_select_blocks_negative_scale():
    """scale_idx < 0 reverses the ranking (the kernels flip the signs of q_idx, or of its E4M3
    codes): the rule over the scaled scores, with the inputs' own and with FP8 scores (alone and
    re-ranked). The scale is the default's magnitude: the FP8 scores' fp16 sums are good to about
    1e-3 of a score, inside SEL_TOL at these scores' size."""
    T, Hi, Bk, top_k = 1000, 4, 64, 6
    scale = DI ** -0.5
    qi, ki = rand(T, Hi, DI, dtype=BF16), rand(T, 1, DI, dtype=BF16)
    q8, k8 = R.fp8_index_copies_ref(qi, ki, Bk)
    for scores, (q, k), m in (("input", (qi, ki), 4), ("fp8", (q8, k8), 0), ("fp8", (qi, ki), 4)):
        bi = msa.select_blocks(qi, ki, top_k, Bk, scale_idx=-scale, select_scores=scores,
                               fp8_rerank=m)
        shortlist = (q8, k8, m) if scores == "fp8" and m > 0 else None
        check_selection(bi, q, k, top_k, Bk, scale_idx=-scale, tol=SEL_TOL, shortlist=shortlist)
        assert not torch.equal(bi, msa.select_blocks(qi, ki, top_k, Bk, scale_idx=scale,
                                                     select_scores=scores, fp8_rerank=m))


@skip_unbuilt
def test_select_blocks_scale_does_not_change_ranking():
    T, Hi, Bk, top_k = 1000, 4, 64, 6
    qi, ki = rand(T, Hi, DI, dtype=BF16), rand(T, 1, DI, dtype=BF16)
    a = msa.select_blocks(qi, ki, top_k, Bk)
    b = msa.select_blocks(qi, ki, top_k, Bk, scale_idx=0.37)
    check_selection_vs_reference(b, qi, ki, top_k, Bk, [T], 0, 1, scale_idx=0.37)
    same = (a == b).all(-1).double().mean().item()
    assert same >= SEL_SAME_ROWS


# --------------------------------------------------------------------------------------------
# attention forward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fwd_pass", ["auto", "query_tile", "kv_block", "split"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=ATTN_IDS)
@skip_unbuilt
def test_forward_given_block_idx(case, fwd_pass):
    """Every forward pass: the query tile, the KV block (partial outputs per KV block, then their
    combine), the split (query tiles over the blocks most of their tokens share, the KV block
    over the rest) and the device's choice."""
    _, lengths, Hq, Hkv, Hi, Hik, D, Bk, top_k, dtype = case
    T = sum(lengths)
    q, k, v = rand(T, Hq, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype)
    bi = random_block_idx(lengths, Hi, top_k, Bk, empty_rows=0.02, no_own=0.02)
    out, kl, lse, bi_back = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk,
                                                 cu_seqlens=cu_of(lengths), kl_value=False,
                                                 return_lse=True, return_block_idx=True,
                                                 fwd_pass=fwd_pass)
    assert bi_back is bi and kl.shape == () and float(kl) == 0.0
    check_against_references(out, lse, q, k, v, bi, lengths, Bk, dtype)


@pytest.mark.parametrize("case", ATTN_CASES, ids=ATTN_IDS)
@skip_unbuilt
def test_forward_with_selection(case):
    _, lengths, Hq, Hkv, Hi, Hik, D, Bk, top_k, dtype = case
    T = sum(lengths)
    q, k, v = rand(T, Hq, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype)
    qi, ki = rand(T, Hi, DI, dtype=dtype), rand(T, Hik, DI, dtype=dtype)
    cu = cu_of(lengths)
    out, _, lse, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu,
                                           kl_value=False, return_lse=True,
                                           return_block_idx=True)
    assert bi.shape == (T, Hi, top_k) and bi.dtype == torch.int32
    check_selection_vs_reference(bi, qi, ki, top_k, Bk, lengths, 0, 1)
    assert torch.equal(bi, msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu)), \
        "forward(select=True) and select_blocks disagree"
    check_against_references(out, lse, q, k, v, bi, lengths, Bk, dtype)


@skip_unbuilt
def test_forward_sink_and_local_blocks():
    lengths, Hq, Hkv, Hi, D, Bk, top_k = [1500, 0, 700], 8, 2, 2, 128, 64, 6
    T = sum(lengths)
    q, k, v = rand(T, Hq, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16)
    qi, ki = rand(T, Hi, DI, dtype=BF16), rand(T, 1, DI, dtype=BF16)
    out, _, lse, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu_of(lengths),
                                           sink_blocks=1, local_blocks=2, scale=0.1,
                                           kl_value=False, return_lse=True,
                                           return_block_idx=True)
    check_selection_vs_reference(bi, qi, ki, top_k, Bk, lengths, 1, 2)
    check_against_references(out, lse, q, k, v, bi, lengths, Bk, BF16, scale=0.1)


@pytest.mark.parametrize("fwd_pass", ["query_tile", "kv_block", "split", "warmup"])
@skip_unbuilt
def test_forward_negative_scale(fwd_pass):
    """A negative softmax scale (the kernels negate Q where they load it and use |scale|) in each
    forward pass and the dense warmup, against both references."""
    lengths, Hq, Hkv, Hi, D, Bk, top_k = [700, 0, 333], 16, 2, 2, 128, 128, 3
    T = sum(lengths)
    q, k, v = rand(T, Hq, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16)
    cu = cu_of(lengths)
    if fwd_pass == "warmup":
        out, _, lse = msa.warmup_attention(q, k, v, None, None, cu_seqlens=cu, scale=-0.2,
                                           kl_value=False, return_lse=True)
        bi = None
    else:
        bi = random_block_idx(lengths, Hi, top_k, Bk, empty_rows=0.02)
        out, _, lse = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk,
                                           cu_seqlens=cu, scale=-0.2, kl_value=False,
                                           return_lse=True, fwd_pass=fwd_pass)
    check_against_references(out, lse, q, k, v, bi, lengths, Bk, BF16, scale=-0.2)
    # and not the answer of the positive scale
    pos_out, _ = ref_attention(q, k, v, bi, lengths, Bk, scale=0.2)
    assert (out.double() - pos_out).norm() > 0.1 * pos_out.norm()


@pytest.mark.parametrize("with_index", [False, True], ids=["no_index", "index"])
@pytest.mark.parametrize("case", [
    ("len113_g4", [113], 8, 2, 2, 64, FP16),
    ("varlen_empty_g16", [0, 799, 1, 0, 300], 16, 1, 1, 128, BF16),
    ("len4224_paper_heads", [4224], 64, 4, 4, 128, BF16),
], ids=lambda c: c[0])
@skip_unbuilt
def test_warmup_dense(case, with_index):
    _, lengths, Hq, Hkv, Hi, D, dtype = case
    T = sum(lengths)
    q, k, v = rand(T, Hq, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype)
    qi = rand(T, Hi, DI, dtype=dtype) if with_index else None
    ki = rand(T, 1, DI, dtype=dtype) if with_index else None
    out, kl, lse = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu_of(lengths),
                                        kl_value=False, return_lse=True)
    assert float(kl) == 0.0
    check_against_references(out, lse, q, k, v, None, lengths, 128, dtype)


@skip_unbuilt
def test_dense_limit_equals_causal_sdpa():
    """With top_k covering every block, sparse attention is dense causal GQA attention."""
    T, Hq, Hkv, D, Bk = 1000, 8, 2, 128, 128
    q, k, v = rand(T, Hq, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16)
    qi, ki = rand(T, 2, DI, dtype=BF16), rand(T, 1, DI, dtype=BF16)
    out, _ = msa.sparse_attention(q, k, v, qi, ki, top_k=8, block_size=Bk, kl_value=False)
    wout, _ = msa.warmup_attention(q, k, v, None, None, kl_value=False)
    G = Hq // Hkv
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k.double().repeat_interleave(G, 1).transpose(0, 1),
        v.double().repeat_interleave(G, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    for name, o in (("sparse", out), ("warmup", wout)):
        err = ((o.double() - want).norm() / want.norm()).item()
        assert err < OUT_TOL[BF16], f"{name}: rel-L2 {err:.3e}"


@skip_unbuilt
def test_non_contiguous_inputs():
    """Strided views (head-major, sliced) are read in place; a last dimension that is not
    contiguous is copied by the Python layer. Results match the references and the selection
    of contiguous copies."""
    lengths = [300, 400]
    T, Hq, Hkv, Hi, D, Bk, top_k = sum(lengths), 8, 2, 4, 128, 64, 5
    cu = cu_of(lengths)
    q = rand(Hq, T, 2 * D, dtype=BF16).transpose(0, 1)[..., :D]  # strides (2D, 2TD, 1)
    k = rand(2 * T, Hkv, D, dtype=BF16)[::2]                     # every other token
    v = rand(T, 2 * Hkv, D, dtype=BF16)[:, 1::2]                 # every other head
    qi = rand(T, DI, Hi, dtype=BF16).transpose(1, 2)             # last dim strided: copied
    ki = rand(1, T, DI, dtype=BF16).transpose(0, 1)              # [T, 1, Di]
    assert not any(x.is_contiguous() for x in (q, k, v, qi))
    args = dict(cu_seqlens=cu, kl_value=False, return_lse=True, return_block_idx=True)
    out, _, lse, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, **args)
    c = [x.contiguous() for x in (q, k, v, qi, ki)]
    check_selection_vs_reference(bi, c[3], c[4], top_k, Bk, lengths, 0, 1)
    bi_c = msa.select_blocks(c[3], c[4], top_k, Bk, cu_seqlens=cu)
    same = (bi == bi_c).all(-1).double().mean().item()
    assert same >= SEL_SAME_ROWS, f"strided and contiguous selections differ ({same:.4f} same)"
    check_against_references(out, lse, c[0], c[1], c[2], bi, lengths, Bk, BF16)
    # a head-major block_idx view, and a block_idx whose last dimension is strided
    for view in (bi.transpose(0, 1).contiguous().transpose(0, 1),
                 torch.stack([bi, bi], dim=-1)[..., 0]):
        out2, _, lse2 = msa.sparse_attention(q, k, v, None, None, block_idx=view, block_size=Bk,
                                             cu_seqlens=cu, kl_value=False, return_lse=True)
        check_attention(out2, lse2, out.double(), lse.double(), BF16, "block_idx view")


# --------------------------------------------------------------------------------------------
# the KL value, the backward: clear errors until the CUDA backend has them
# --------------------------------------------------------------------------------------------


def _small(dtype=BF16, requires_grad=False):
    T, Hq, Hkv, Hi, D = 300, 8, 2, 2, 128
    x = [rand(T, Hq, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype),
         rand(T, Hi, DI, dtype=dtype), rand(T, 1, DI, dtype=dtype)]
    return [t.requires_grad_(requires_grad) for t in x]


def _training_inputs(dtype, lengths=(0, 300, 77), Hq=8, Hkv=2, Hi=2, Hik=1, D=128):
    T = sum(lengths)
    x = [rand(T, Hq, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype),
         rand(T, Hi, D, dtype=dtype), rand(T, Hik, D, dtype=dtype)]
    return x, cu_of(lengths)


@skip_unbuilt
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_kl_value(mode):
    """kl_value=True (the default): the exact KL value, as the CPU backend computes it."""
    (q, k, v, qi, ki), cu = _training_inputs(BF16)
    c = [t.cpu().float() for t in (q, k, v, qi, ki)]
    if mode == "sparse":
        bi = msa.select_blocks(qi, ki, 2, 128, cu_seqlens=cu)
        _, kl = msa.sparse_attention(q, k, v, qi, ki, block_idx=bi, block_size=128, cu_seqlens=cu)
        _, kl_c = msa.sparse_attention(*c, block_idx=bi.cpu(), block_size=128, cu_seqlens=cu.cpu())
    else:
        _, kl = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu)
        _, kl_c = msa.warmup_attention(*c, cu_seqlens=cu.cpu())
    assert abs(float(kl) - float(kl_c)) <= 2e-3 * abs(float(kl_c)) + 1e-6, (float(kl), float(kl_c))


@skip_unbuilt
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_training_step_gradients(mode, dtype):
    """loss = task(out) + 0.3 * kl; loss.backward() gives q, k, v, q_idx, k_idx gradients close
    to the CPU backend's on the same 16-bit values (one selection for both sides)."""
    x, cu = _training_inputs(dtype, Hq=16, Hkv=2, Hi=4, Hik=2)
    x = [t.requires_grad_(True) for t in x]
    c = [t.detach().cpu().float().requires_grad_(True) for t in x]
    w = torch.randn(x[0].shape, device=DEV)

    def step(q, k, v, qi, ki, cu, bi):
        if mode == "sparse":
            out, kl = msa.sparse_attention(q, k, v, qi, ki, block_idx=bi, block_size=128,
                                           cu_seqlens=cu)
        else:
            out, kl = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu)
        loss = (out.float() * w.to(out.device)).sum() + 0.3 * kl
        return torch.autograd.grad(loss, (q, k, v, qi, ki))

    bi = msa.select_blocks(x[3].detach(), x[4].detach(), 3, 128, cu_seqlens=cu)
    g = step(*x, cu, bi)
    gc = step(*c, cu.cpu(), bi.cpu())
    tol = 3e-2 if dtype == BF16 else 1e-2
    for name, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), g, gc):
        assert a.dtype == dtype and a.shape == b.shape, name
        err = ((a.cpu().double() - b.double()).norm() / b.double().norm()).item()
        assert err < tol, f"{name}: rel-L2 {err:.3e}"


@skip_unbuilt
def test_backward_is_deterministic():
    """deterministic=True: two backward passes give the same bits."""
    x, cu = _training_inputs(BF16, lengths=(700, 0, 333), Hq=16, Hkv=2, Hi=2)
    x = [t.requires_grad_(True) for t in x]
    w = torch.randn(x[0].shape, device=DEV)

    def grads():
        out, kl = msa.sparse_attention(*x, 3, 128, cu_seqlens=cu, deterministic=True)
        return torch.autograd.grad((out.float() * w).sum() + kl, x)

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# streams, host synchronisation, CUDA graphs, torch.compile, opcheck
# --------------------------------------------------------------------------------------------

SLEEP_CYCLES = 1_000_000_000  # about 0.5 s of GPU time at 2 GHz


def _select_and_forward(q, k, v, qi, ki, cu, top_k, Bk):
    bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu)
    out, _, lse = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk,
                                       cu_seqlens=cu, kl_value=False, return_lse=True)
    out2, _, lse2, bi2 = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu,
                                              kl_value=False, return_lse=True,
                                              return_block_idx=True)
    wout, _ = msa.warmup_attention(q, k, v, None, None, cu_seqlens=cu, kl_value=False)
    # FP8 selection scores, re-ranked (the default) and alone: workspace, scans and atomics
    bi8 = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, select_scores="fp8")
    bi8_raw = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, select_scores="fp8",
                                fp8_rerank=0)
    out8, _ = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu, kl_value=False,
                                   select_scores="fp8", fp8_rerank=2)
    return bi, out, lse, out2, lse2, bi2, wout, bi8, bi8_raw, out8


def _stream_inputs():
    lengths = [0, 900, 1100]
    T, Hq, Hkv, Hi, D = sum(lengths), 16, 2, 2, 128
    x = [rand(T, Hq, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16),
         rand(T, Hi, DI, dtype=BF16), rand(T, 1, DI, dtype=BF16)]
    return x, cu_of(lengths), 4, 128


@cuda_only
@skip_unbuilt
def test_non_default_stream():
    """Calls run on the current stream: with that stream held busy, a call launched on any
    other stream would read the inputs before the copies that precede it on this one."""
    src, cu, top_k, Bk = _stream_inputs()
    want = _select_and_forward(*src, cu, top_k, Bk)
    dst = [torch.zeros_like(x) for x in src]
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for d, x in zip(dst, src):
            d.copy_(x)
        got = _select_and_forward(*dst, cu, top_k, Bk)
    s.synchronize()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs on a side stream"


@cuda_only
@skip_unbuilt
def test_no_host_synchronisation():
    """With the value checks off (their verdict is the only wait), no call waits for the device:
    with the stream busy for ~0.5 s, every call returns while the stream still has work queued
    (and torch sees no synchronising operation)."""
    x, cu, top_k, Bk = _stream_inputs()
    _select_and_forward(*x, cu, top_k, Bk)  # first calls: one-time initialisation
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    prev = torch.cuda.get_sync_debug_mode()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with msa.value_checks(False):
                _select_and_forward(*x, cu, top_k, Bk)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        elapsed = time.perf_counter() - t0
        pending = not s.query()
    s.synchronize()
    assert pending, f"the calls returned after the stream drained ({elapsed:.3f} s): a host sync"


@cuda_only
@skip_unbuilt
def test_value_checks_on_cuda():
    """Malformed cu_seqlens or block_idx values on CUDA tensors raise an error naming the
    argument (the library checks them on the device); msa.value_checks(False) skips the check,
    and the call still runs without touching memory outside its tensors."""
    (q, k, v, qi, ki), cu, top_k, Bk = _stream_inputs()
    bad_cu = cu.clone()
    bad_cu[1] = cu[-1] + 1  # not monotone
    with pytest.raises(Exception, match="cu_seqlens"):
        msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=bad_cu, kl_value=False)
    _, _, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu, kl_value=False,
                                    return_block_idx=True)
    bad_bi = bi.clone()
    bad_bi[0, 0, 0] = 5  # token 0 can only select its own block 0
    with pytest.raises(Exception, match="block_idx"):
        msa.sparse_attention(q, k, v, None, None, block_idx=bad_bi, block_size=Bk, cu_seqlens=cu,
                             kl_value=False)
    with msa.value_checks(False):
        msa.sparse_attention(q, k, v, None, None, block_idx=bad_bi, block_size=Bk, cu_seqlens=cu,
                             kl_value=False)
    torch.cuda.synchronize()


@cuda_only
@skip_unbuilt
def test_value_checks_once_per_tensor():
    """With the checks on, a cu_seqlens that passed is not checked again while unchanged: with
    the stream busy for ~0.5 s the second call returns while work is still queued (the check's
    wait would have drained it); changed in place to a malformed value, it is checked again
    and refused."""
    x, cu, top_k, Bk = _stream_inputs()
    cu = cu.clone()
    msa.sparse_attention(*x, top_k, Bk, cu_seqlens=cu, kl_value=False)  # checked
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        msa.sparse_attention(*x, top_k, Bk, cu_seqlens=cu, kl_value=False)
        elapsed = time.perf_counter() - t0
        pending = not s.query()
    s.synchronize()
    assert pending, f"the call returned after the stream drained ({elapsed:.3f} s): a host sync"
    cu[1] = cu[-1] + 1  # not monotone
    with pytest.raises(Exception, match="cu_seqlens"):
        msa.sparse_attention(*x, top_k, Bk, cu_seqlens=cu, kl_value=False)


@cuda_only
@skip_unbuilt
def test_cuda_graph_capture_and_replay():
    src, cu, top_k, Bk = _stream_inputs()
    static = [x.clone() for x in src]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _select_and_forward(*static, cu, top_k, Bk)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = _select_and_forward(*static, cu, top_k, Bk)
    for _ in range(2):  # two replays with fresh inputs
        fresh = [rand(*x.shape, dtype=x.dtype) for x in src]
        for st, f in zip(static, fresh):
            st.copy_(f)
        g.replay()
        want = _select_and_forward(*fresh, cu, top_k, Bk)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(captured, want)):
            assert torch.equal(a, b), f"graph replay output {i} differs from the eager call"


def _agreeing_block_idx(lengths, Hi, k, Bk):
    """Every token of a block selects the same blocks: its own, the one before, the first and
    the one halfway (repeats as -1)."""
    own = positions(lengths) // Bk
    cand = torch.stack([own, own - 1, torch.zeros_like(own), own // 2], dim=-1)[:, :k]
    for j in range(1, cand.shape[-1]):
        cand[:, j] = torch.where((cand[:, :j] == cand[:, j:j + 1]).any(-1), -1, cand[:, j])
    cand = torch.where(cand < 0, -1, cand)
    if cand.shape[-1] < k:
        cand = torch.cat([cand, cand.new_full((cand.shape[0], k - cand.shape[-1]), -1)], -1)
    return cand[:, None, :].expand(-1, Hi, -1).to(torch.int32).contiguous()


@cuda_only
@skip_unbuilt
def test_auto_forward_pass_follows_the_selection_under_graph_replay():
    """fwd_pass="auto" picks its pass on the device: a captured graph replayed with a selection
    whose tiles agree gives the query-tile pass's bits, and replayed with a scattered one the
    split's, with no host sync in between."""
    lengths, Hq, Hkv, Hi, D, Bk, k = [4096, 2000], 16, 2, 2, 128, 128, 4
    dtype = torch.bfloat16
    T = sum(lengths)
    cu = cu_of(lengths)
    q, kk, v = rand(T, Hq, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype), rand(T, Hkv, D, dtype=dtype)
    agree = _agreeing_block_idx(lengths, Hi, k, Bk)
    scattered = random_block_idx(lengths, Hi, k, Bk)

    def fwd(bi, fwd_pass):
        return msa.sparse_attention(q, kk, v, None, None, block_idx=bi, block_size=Bk, cu_seqlens=cu,
                                    kl_value=False, fwd_pass=fwd_pass)[0]

    static = agree.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd(static, "auto")
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = fwd(static, "auto")
    for bi, ran in ((scattered, "split"), (agree, "query_tile"), (scattered, "split")):
        static.copy_(bi)
        g.replay()
        tile, split = fwd(bi, "query_tile"), fwd(bi, "split")
        torch.cuda.synchronize()
        # where the tiles agree the split keeps every block with them: the same bits
        assert torch.equal(tile, split) == (ran == "query_tile"), "the two passes cannot be told apart"
        assert torch.equal(captured, tile if ran == "query_tile" else split), \
            f"the replay did not run the {ran} pass"


@skip_unbuilt
def test_compile_inference_forward():
    torch._dynamo.reset()
    (q, k, v, qi, ki), cu, top_k, Bk = _stream_inputs()

    def f(q, k, v, qi, ki, cu):
        out, kl = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu, kl_value=False)
        wout, _ = msa.warmup_attention(q, k, v, None, None, cu_seqlens=cu, kl_value=False)
        return out, out.float().square().sum(-1) + kl, wout

    backend = "inductor" if (IS_CUDA and importlib.util.find_spec("triton")) else "aot_eager"
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    with torch.no_grad():
        want = f(q, k, v, qi, ki, cu)
        got = compiled(q, k, v, qi, ki, cu)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


@skip_unbuilt
def test_compile_training_step():
    """torch.compile(fullgraph=True) of forward + KL loss; backward through the compiled graph
    gives the eager gradients."""
    torch._dynamo.reset()
    x, cu = _training_inputs(BF16, Hq=16, Hkv=2, Hi=2)
    w = torch.randn(x[0].shape, device=DEV)

    def loss_of(q, k, v, qi, ki):
        out, kl = msa.sparse_attention(q, k, v, qi, ki, 3, 128, cu_seqlens=cu)
        return (out.float() * w).sum() + 0.5 * kl

    backend = "inductor" if (IS_CUDA and importlib.util.find_spec("triton")) else "aot_eager"
    compiled = torch.compile(loss_of, fullgraph=True, backend=backend)
    grads = []
    for fn in (loss_of, compiled):
        xs = [t.detach().clone().requires_grad_(True) for t in x]
        fn(*xs).backward()
        grads.append([t.grad for t in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _opcheck(op, args):
    op(*args)  # a plain call first: an error of the op itself surfaces as it is
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@skip_unbuilt
def test_opcheck():
    """torch.library.opcheck of the ops' device kernels (inputs without grad: inference)."""
    lengths = [0, 200, 313]
    T, Hq, Hkv, Hi, D, Bk, top_k = sum(lengths), 8, 2, 2, 64, 64, 3
    q, k, v = rand(T, Hq, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16), rand(T, Hkv, D, dtype=BF16)
    qi, ki = rand(T, Hi, DI, dtype=BF16), rand(T, 1, DI, dtype=BF16)
    cu = cu_of(lengths)
    _opcheck(torch.ops.msa.select_blocks.default, (qi, ki, cu, top_k, Bk, 1, 1, 0.0))
    bi = torch.ops.msa.select_blocks(qi, ki, cu, top_k, Bk, 0, 1, 0.0)
    fwd = torch.ops.msa.forward.default
    #     q  k  v  q_idx k_idx block_idx cu  dense  select Bk  top_k sink local scale sc_idx kl   det
    _opcheck(fwd, (q, k, v, qi, ki, None, cu, False, True, Bk, top_k, 0, 1, 0.0, 0.0, False, False))
    _opcheck(fwd, (q, k, v, None, None, bi, cu, False, False, Bk, top_k, 0, 1, 0.3, 0.0, False,
                   False))
    _opcheck(fwd, (q, k, v, None, None, None, cu, True, False, Bk, top_k, 0, 1, 0.0, 0.0, False,
                   False))
    # Training: inputs with grad (autograd registration), the KL value, and the backward op.
    qd, kd, vd = rand(T, Hq, DI, dtype=BF16), rand(T, Hkv, DI, dtype=BF16), rand(T, Hkv, DI, dtype=BF16)
    bi128 = torch.ops.msa.select_blocks(qi, ki, cu, top_k, 128, 0, 1, 0.0)
    grad_args = [t.clone().requires_grad_(True) for t in (qd, kd, vd, qi, ki)]
    _opcheck(fwd, (*grad_args, bi128, cu, False, False, 128, top_k, 0, 1, 0.0, 0.0, True, True))
    out, lse, _, _ = fwd(qd, kd, vd, qi, ki, bi128, cu, False, False, 128, top_k, 0, 1, 0.0, 0.0,
                         False, True)
    kl_grad = torch.ones(1, dtype=torch.float32, device=DEV)
    _opcheck(torch.ops.msa.backward.default,
             (torch.randn_like(out), qd, kd, vd, out, lse, qi, ki, bi128, cu, kl_grad, False, 128,
              0.0, 0.0, True, True, True))


# Keys apart from queries (cu_seqlens_k, contract §1): keys per sequence and queries per sequence
# (its last positions): m = n, m > n with m not a multiple of Bk, one query, keys without queries
# (their gradients must be zero), an empty sequence, keys of later sequences starting off block
# edges in the packed key tensor, Tk about 11x T.
KA_KEYS = [77, 300, 129, 200, 0, 1000, 2000]
KA_QUERIES = [77, 45, 1, 0, 0, 128, 90]


def _apart_positions(keys, queries):
    """Each query's position in its sequence: the last n_s of m_s [T] (int64, on DEV)."""
    parts = [torch.arange(m - n, m, device=DEV) for m, n in zip(keys, queries)]
    return torch.cat(parts)


@skip_unbuilt
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("mode", ["sparse", "select", "warmup"])
def test_keys_apart_against_cpu(mode, dtype):
    """Keys apart from queries (cu_seqlens_k): msa.sparse_attention (a caller's block_idx, or its
    own selection) and msa.warmup_attention on CUDA against the same calls on float64 CPU copies
    (the CPU backend) over the same selection: out and lse, the KL value, and the gradients of
    loss = task(out) + 0.3 T * kl through autograd (q, q_idx: T rows; k, v, k_idx: Tk rows, zero
    for the keys of a sequence without queries). The GPU's selection equals on nearly every row
    the CPU backend's; with a caller's selection every forward pass agrees with the CPU."""
    Hq, Hkv, Hi, Hik, D, Bk, top_k = 8, 2, 2, 1, 128, 128, 4
    keys, queries = KA_KEYS, KA_QUERIES
    T, Tk = sum(queries), sum(keys)
    x = [rand(T, Hq, D, dtype=dtype), rand(Tk, Hkv, D, dtype=dtype), rand(Tk, Hkv, D, dtype=dtype),
         rand(T, Hi, D, dtype=dtype), rand(Tk, Hik, D, dtype=dtype)]
    x = [t.requires_grad_(True) for t in x]
    c = [t.detach().cpu().double().requires_grad_(True) for t in x]
    cu, cuk = cu_of(queries), cu_of(keys)
    w = torch.randn(T, Hq, D, dtype=torch.float64, device=DEV)
    kl_weight = 0.3 * T  # gamma / (T * Hi) independent of T: the KL gradient keeps fp16's range

    if mode == "sparse":
        bi = random_block_idx(queries, Hi, top_k, Bk, empty_rows=0.02, no_own=0.02,
                              pos=_apart_positions(keys, queries))
    elif mode == "select":
        bi = msa.select_blocks(x[3].detach(), x[4].detach(), top_k, Bk, cu_seqlens=cu,
                               cu_seqlens_k=cuk, sink_blocks=1)
        assert bi.shape == (T, Hi, top_k) and bi.device == x[0].device
        bi_cpu = msa.select_blocks(c[3].detach(), c[4].detach(), top_k, Bk, cu_seqlens=cu.cpu(),
                                   cu_seqlens_k=cuk.cpu(), sink_blocks=1)
        same = (bi.cpu() == bi_cpu).all(-1).double().mean().item()
        assert same >= SEL_SAME_ROWS, f"only {same:.4f} of the rows equal the CPU's selection"
    else:
        bi = None

    def step(args, cu_q, cu_k, block_idx, select):
        if mode == "warmup":
            out, kl, lse = msa.warmup_attention(*args, cu_seqlens=cu_q, cu_seqlens_k=cu_k,
                                                return_lse=True)
        elif select:
            out, kl, lse, sel = msa.sparse_attention(*args, top_k, Bk, cu_seqlens=cu_q,
                                                     cu_seqlens_k=cu_k, sink_blocks=1,
                                                     return_lse=True, return_block_idx=True)
            assert torch.equal(sel, block_idx), "forward's selection and select_blocks differ"
        else:
            out, kl, lse = msa.sparse_attention(*args, block_idx=block_idx, block_size=Bk,
                                                cu_seqlens=cu_q, cu_seqlens_k=cu_k,
                                                return_lse=True)
        loss = (out.double() * w.to(out.device)).sum() + kl_weight * kl.double()
        return out, kl, lse, torch.autograd.grad(loss, args)

    out, kl, lse, g = step(x, cu, cuk, bi, mode == "select")
    out_c, kl_c, lse_c, g_c = step(c, cu.cpu(), cuk.cpu(), None if bi is None else bi.cpu(), False)
    check_attention(out.detach(), lse, out_c.detach().to(DEV), lse_c.to(DEV), dtype,
                    f"{mode}: vs CPU backend")
    kl, kl_c = float(kl.detach()), float(kl_c.detach())
    assert abs(kl - kl_c) <= 2e-3 * abs(kl_c) + 1e-6, (kl, kl_c)
    assert kl_c > 0
    tol = 3e-2 if dtype == BF16 else 1e-2
    for name, a, b, rows in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), g, g_c, (T, Tk, Tk, T, Tk)):
        assert a.dtype == dtype and a.device == x[0].device and a.shape == b.shape, name
        assert a.shape[0] == rows, name
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = ((a.cpu().double() - b).norm() / b.norm()).item()
        assert err < tol, f"{mode} {name}: rel-L2 {err:.3e}"
    kcu = cuk.tolist()
    for s, n in enumerate(queries):
        if n == 0 and keys[s] > 0:
            for name, a in (("dk", g[1]), ("dv", g[2]), ("dk_idx", g[4])):
                assert (a[kcu[s]:kcu[s + 1]] == 0).all(), f"{name}, sequence {s}: not 0"

    if mode == "sparse":
        for fwd_pass in ("query_tile", "kv_block", "split"):
            with torch.no_grad():
                o, _, l = msa.sparse_attention(*x, block_idx=bi, block_size=Bk, cu_seqlens=cu,
                                               cu_seqlens_k=cuk, kl_value=False, return_lse=True,
                                               fwd_pass=fwd_pass)
            check_attention(o, l, out_c.detach().to(DEV), lse_c.to(DEV), dtype,
                            f"fwd_pass={fwd_pass}")
