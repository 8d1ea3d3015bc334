"""Selections of a chosen overlap for the kernel benchmarks, and the statistics that say how much
neighbouring tokens' selections overlap.

How fast the sparse kernels run depends on how alike the selections of neighbouring tokens are
(blocks a tile of queries shares are loaded once). The benchmarks therefore time MSA on index
inputs of several *overlap levels* and report, for every timed selection, two statistics of its
``block_idx`` ([T, Hi, k] int32, per row the valid block ids, then -1 padding):

* overlap: the mean over consecutive token pairs (t, t+1) of one sequence and over index heads
  of |I(t) & I(t+1)| / k, I = the valid ids of a row;
* union: the mean over aligned windows of ``window`` (8) consecutive tokens of one sequence (the
  last window of a sequence may be shorter) and over index heads of the number of distinct
  blocks the window's tokens select, divided by k (1 when the window's tokens agree, up to
  ``window`` when they share nothing).

Index inputs (``index_inputs``) have one parameter, alpha in [0, 1]. Every sequence has a random
salience per block, s(b) ~ N(0, 1); index keys are ``s(blk(j)) * e0 + n(j)`` with n(j) ~ N(0, I)
orthogonal to the shared direction e0, and index queries are
``Q_SCALE * sqrt(Di) * (alpha * e0 + (1 - alpha) * u(t))`` with u(t) a random unit vector
orthogonal to e0, one per (token, index head). The block score of token t is then
proportional to ``alpha * s(b) + (1 - alpha) * max_j u(t).n(j)``: at alpha = 0 it is that of
random index vectors (every token picks its own random blocks), at alpha = 1 every token ranks
blocks by the shared salience (neighbours select the same blocks), and the overlap rises
smoothly in between. The named ``LEVELS`` are alpha = 1 ("shared"), alpha calibrated by
bisection to an overlap of 0.57 ("mixed"; ``make_level`` calibrates on the very inputs it
returns) and alpha = 0 ("random").

Measured with Bk = 128, k = 16, Hi = 4, Di = 128, sink 1 + local 4 (one sequence of T tokens):

    T                      8K     16K    32K    64K    128K
    random overlap         0.56   0.48   0.42   0.38   0.35   (union 1.9 .. 5.0)
    mixed alpha            0.10   0.26   0.35   0.40   0.44   (union 1.8 .. 2.9)
    shared overlap         0.88   0.94   0.97   0.99   0.99   (union = overlap)

The random level is what independent uniform choices of the non-forced blocks give
(``random_overlap_expectation``); short sequences overlap more, since the first k*Bk tokens
select every block they can see, and there even identical neighbours stay below 1 when their
rows hold fewer than k blocks (hence shared < 0.9 at 8K).
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

SINK_BLOCKS = 1
LOCAL_BLOCKS = 4
WINDOW = 8
Q_SCALE = 4.0  # index scores scale_idx * q.k are Q_SCALE * (alpha * s + (1 - alpha) * u.n)

# The overlap levels: alpha fixed, or calibrated to a target overlap; "overlap" is the range a
# level is meant to land in at T >= 16K (the random level's value depends on the shape: see the
# table above).
LEVELS: Dict[str, Dict] = {
    "shared": dict(alpha=1.0, overlap=(0.9, 1.0),
                   text="every token ranks blocks by one shared salience"),
    "mixed": dict(target=0.57, overlap=(0.55, 0.6),
                  text="alpha calibrated to an overlap of 0.57"),
    "random": dict(alpha=0.0, overlap=(0.0, 0.5),
                   text="random index vectors: every token picks its own blocks"),
}

_INVALID = torch.iinfo(torch.int32).max
_CHUNK_ELEMS = 1 << 23  # block ids handled at once by selection_stats (about 25 bytes each)


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


def _cu(cu_seqlens, T: int, device) -> torch.Tensor:
    if cu_seqlens is None:
        return torch.tensor([0, T], dtype=torch.int64, device=device)
    cu = torch.as_tensor(cu_seqlens).to(device=device, dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens must run from 0 to T = {T}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must not decrease")
    return cu


def _first_of_each(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(v, new): x's values sorted along the last dim (int32; negative values as padding, last)
    and where each distinct non-negative value first appears in v."""
    v = torch.where(x >= 0, x.to(torch.int32), torch.full_like(x, _INVALID, dtype=torch.int32))
    v = v.sort(-1).values
    new = v != _INVALID
    new[..., 1:] &= v[..., 1:] != v[..., :-1]
    return v, new


def _distinct(x: torch.Tensor) -> torch.Tensor:
    """Number of distinct non-negative values along the last dim (int64, shape x.shape[:-1])."""
    return _first_of_each(x)[1].sum(-1)


def selection_stats(block_idx: torch.Tensor, cu_seqlens=None, k: Optional[int] = None,
                    window: int = WINDOW, chunk_elems: int = _CHUNK_ELEMS) -> Dict:
    """Overlap and union of a selection (see the module docstring), computed exactly (integer
    counts) on ``block_idx``'s device in chunks of about ``chunk_elems`` block ids.

    Returns dict(overlap, union, pairs, windows, overlap_count, union_count): ``overlap_count``
    is the sum of |I(t) & I(t+1)| over the ``pairs`` token pairs and the index heads,
    ``union_count`` the sum of distinct blocks over the ``windows`` windows and the index heads;
    overlap = overlap_count / (pairs * Hi * k), union = union_count / (windows * Hi * k) (NaN
    when there is no pair or window). Rows may list their ids in any order; -1 (any negative
    value) is padding and a repeated id counts once.
    """
    if block_idx.dim() != 3:
        raise ValueError("block_idx must be [T, Hi, k]")
    T, Hi, kk = block_idx.shape
    k = kk if k is None else int(k)
    if k <= 0 or window <= 0:
        raise ValueError("k and window must be positive")
    dev = block_idx.device
    cu = _cu(cu_seqlens, T, dev)
    bi = block_idx
    zero = torch.zeros((), dtype=torch.int64, device=dev)

    # pairs (t, t+1) of one sequence: t + 1 < T and t + 1 is no sequence boundary
    inter, npairs = zero.clone(), zero.clone()
    step = max(1, chunk_elems // max(1, 2 * Hi * kk))
    for s in range(0, max(T - 1, 0), step):
        e = min(s + step, T - 1)  # pairs t in [s, e)
        rows = bi[s:e + 1]
        d = _distinct(rows)  # [C+1, Hi]
        du = _distinct(torch.cat([rows[:-1], rows[1:]], -1))  # [C, Hi]
        nxt = torch.arange(s + 1, e + 1, device=dev)
        ok = ~torch.isin(nxt, cu)
        inter += ((d[:-1] + d[1:] - du) * ok[:, None]).sum()
        npairs += ok.sum()

    # aligned windows of each sequence: starts cu[s] + window*w, w < ceil(len/window)
    n = cu[1:] - cu[:-1]
    nw = (n + window - 1) // window
    W = int(nw.sum())
    union = zero.clone()
    if W:
        seq = torch.repeat_interleave(torch.arange(n.numel(), device=dev), nw)
        first = torch.cumsum(nw, 0) - nw
        wstart = cu[seq] + window * (torch.arange(W, device=dev) - first[seq])
        wend = torch.minimum(wstart + window, cu[seq + 1])
        off = torch.arange(window, device=dev)
        wstep = max(1, chunk_elems // max(1, window * Hi * kk))
        for a in range(0, W, wstep):
            b = min(a + wstep, W)
            idx = wstart[a:b, None] + off  # [Wc, window]
            valid = idx < wend[a:b, None]
            rows = bi[idx.clamp(max=T - 1)]  # [Wc, window, Hi, kk]
            rows = torch.where(valid[:, :, None, None], rows, torch.full_like(rows, -1))
            union += _distinct(rows.permute(0, 2, 1, 3).reshape(b - a, Hi, window * kk)).sum()
            del rows, idx, valid

    pairs, ov_count, un_count = int(npairs), int(inter), int(union)
    return dict(
        overlap=ov_count / (pairs * Hi * k) if pairs and Hi else float("nan"),
        union=un_count / (W * Hi * k) if W and Hi else float("nan"),
        pairs=pairs, windows=W, overlap_count=ov_count, union_count=un_count)


def split_work(block_idx: torch.Tensor, cu_seqlens=None, tile_tokens: int = 8,
               share_min: int = 4) -> Dict:
    """How the split forward (``fwd_pass="split"``) divides a selection, counted exactly: the
    query tiles are ``tile_tokens`` consecutive tokens of a sequence (from its first token), and
    a tile keeps, per index head, the blocks of its tokens' union that at least ``share_min`` of
    them selected (a repeated id counts once in its row, negative ids are padding); the
    KV-block pass computes every other selected (token, block) pair.

    Returns dict(pairs, union_blocks, kept_blocks, kept_pairs, kv_pairs, tiles): ``pairs`` the
    selected (token, index head, block) triples; ``union_blocks`` the (tile, index head, block)
    triples of the tiles' unions (the query-tile pass's work, in blocks of a whole tile each),
    ``kept_blocks`` those the split keeps and ``kept_pairs`` the selected pairs inside them;
    ``kv_pairs`` = pairs - kept_pairs; ``tiles`` the (tile, index head) pairs."""
    if block_idx.dim() != 3:
        raise ValueError("block_idx must be [T, Hi, k]")
    if tile_tokens <= 0 or share_min <= 0:
        raise ValueError("tile_tokens and share_min must be positive")
    T, Hi, _ = block_idx.shape
    dev = block_idx.device
    cu = _cu(cu_seqlens, T, dev)
    n = cu[1:] - cu[:-1]
    ntile = (n + tile_tokens - 1) // tile_tokens
    first_tile = torch.cumsum(ntile, 0) - ntile
    seq = torch.repeat_interleave(torch.arange(n.numel(), device=dev), n)
    tile = first_tile[seq] + (torch.arange(T, device=dev) - cu[seq]) // tile_tokens  # [T]
    v, ok = _first_of_each(block_idx)
    v = v.to(torch.int64)
    nb = int(v[ok].max()) + 1 if bool(ok.any()) else 1
    keys = (tile[:, None, None] * Hi + torch.arange(Hi, device=dev)[None, :, None]) * nb + v
    _, counts = torch.unique(keys[ok], return_counts=True)
    kept = counts >= share_min
    pairs = int(counts.sum())
    kept_pairs = int(counts[kept].sum())
    return dict(pairs=pairs, union_blocks=int(counts.numel()), kept_blocks=int(kept.sum()),
                kept_pairs=kept_pairs, kv_pairs=pairs - kept_pairs, tiles=int(ntile.sum()) * Hi)


def random_overlap_expectation(lengths: Sequence[int], Bk: int, k: int,
                               sink_blocks: int = SINK_BLOCKS,
                               local_blocks: int = LOCAL_BLOCKS) -> float:
    """The overlap of selections whose non-forced blocks are drawn uniformly and independently
    per token (the forced ones: the first ``sink_blocks`` and the last ``local_blocks`` blocks
    up to the own one). Random index vectors come close to it (a little above: tokens scored
    against the same keys agree slightly more often than chance)."""

    def sets(b):
        forced = (set(range(min(sink_blocks, b + 1)))
                  | set(range(max(0, b - local_blocks + 1), b + 1)))
        cand = set(range(b + 1)) - forced
        r = max(0, min(k - len(forced), len(cand)))
        return forced, cand, r

    def expect(b0, b1):  # E |I(t) & I(t+1)| for tokens of blocks b0 and b1
        f0, c0, r0 = sets(b0)
        f1, c1, r1 = sets(b1)
        p0 = r0 / len(c0) if c0 else 0.0
        p1 = r1 / len(c1) if c1 else 0.0
        return (len(f0 & f1) + len(f0 & c1) * p1 + len(c0 & f1) * p0
                + len(c0 & c1) * p0 * p1)

    total, pairs = 0.0, 0
    for L in lengths:
        if L < 2:
            continue
        nblk = (L + Bk - 1) // Bk
        for b in range(nblk):
            inside = min(Bk, L - b * Bk) - 1  # pairs inside block b
            total += inside * expect(b, b)
            pairs += inside
            if b + 1 < nblk:
                total += expect(b, b + 1)
                pairs += 1
    return total / (pairs * k) if pairs else float("nan")


# --------------------------------------------------------------------------------------------
# index inputs
# --------------------------------------------------------------------------------------------


def cu_seqlens_for(B: int, L: int, device=None) -> torch.Tensor:
    """cu_seqlens of B sequences of L tokens (int32)."""
    return torch.arange(B + 1, device=device, dtype=torch.int32) * L


def _lengths(cu_seqlens) -> List[int]:
    cu = torch.as_tensor(cu_seqlens).cpu().long()
    return (cu[1:] - cu[:-1]).tolist()


def index_inputs(alpha: float, cu_seqlens, Hi: int, Hik: int, Di: int, Bk: int, *,
                 dtype=torch.bfloat16, generator: Optional[torch.Generator] = None,
                 device=None, chunk_tokens: int = 1 << 17) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q_idx [T, Hi, Di], k_idx [T, Hik, Di]) whose selections overlap more as alpha goes from
    0 (random index vectors) to 1 (one shared per-block salience); see the module docstring.
    ``cu_seqlens`` ([nseq+1]) gives the sequences; the random numbers come from ``generator``
    (on ``device``), drawn ``chunk_tokens`` tokens at a time (float32 temporaries of that many
    tokens)."""
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if Di < 2:
        raise ValueError("Di must be at least 2")
    device = torch.device(device) if device is not None else (
        generator.device if generator is not None else torch.device("cpu"))
    cu = torch.as_tensor(cu_seqlens).to(device=device, dtype=torch.int64)
    T = int(cu[-1])
    nseq = cu.numel() - 1
    nblk = (int((cu[1:] - cu[:-1]).max()) + Bk - 1) // Bk if nseq > 0 else 0
    sal = torch.randn(max(nseq, 1), max(nblk, 1), device=device, generator=generator)
    q_idx = torch.empty(T, Hi, Di, device=device, dtype=dtype)
    k_idx = torch.empty(T, Hik, Di, device=device, dtype=dtype)
    qs = Q_SCALE * math.sqrt(Di)
    for s in range(0, T, chunk_tokens):
        e = min(s + chunk_tokens, T)
        t = torch.arange(s, e, device=device)
        seq = torch.searchsorted(cu, t, right=True) - 1
        blk = (t - cu[seq]) // Bk
        kn = torch.randn(e - s, Hik, Di, device=device, generator=generator)
        kn[..., 0] = sal[seq, blk][:, None]
        k_idx[s:e] = kn.to(dtype)
        u = torch.randn(e - s, Hi, Di, device=device, generator=generator)
        u[..., 0] = 0.0
        u = u / u.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        u *= (1.0 - alpha) * qs
        u[..., 0] = alpha * qs
        q_idx[s:e] = u.to(dtype)
        del kn, u
    return q_idx, k_idx


def select_by_gemm(q_idx: torch.Tensor, k_idx: torch.Tensor, cu_seqlens, k: int, Bk: int,
                   sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS,
                   blocks: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The selection of contract §3 by plain torch GEMMs (float32 scores of the inputs' values),
    for selection statistics at lengths the CPU backend's reference loop takes hours over: each
    query block's scores against its sequence's earlier keys, the block maxima, the forced
    blocks (sink, local, own) and the top of the rest. Blocks of the rows ascending, -1 padding
    last. Equal to ``msa.select_blocks``' sets where no two block scores tie (test_bench_patterns).
    ``blocks``: only those (global, packed) query blocks, the other rows -1 (sampling)."""
    T, Hi, Di = q_idx.shape
    Hik = k_idx.shape[1]
    G = Hi // Hik
    cu = _cu(cu_seqlens, T, q_idx.device).tolist()
    out = torch.full((T, Hi, k), -1, dtype=torch.int32, device=q_idx.device)
    todo = []
    for s in range(len(cu) - 1):
        a, L = cu[s], cu[s + 1] - cu[s]
        todo += [(a, b, L) for b in range((L + Bk - 1) // Bk)]
    if blocks is not None:
        todo = [todo[i] for i in blocks]
    kf = (None, None)  # the current sequence's index keys in float32, converted once
    for a, b, L in todo:
        q0, q1 = a + b * Bk, a + min((b + 1) * Bk, L)
        C = q1 - q0
        forced = set(range(min(sink_blocks, b + 1))) | set(range(max(b - local_blocks + 1, 0),
                                                                 b + 1))
        rest = k - len(forced)
        if b + 1 <= k or rest <= 0:
            # every visible block fits (or no slot beyond the forced ones): those, ascending
            pick = list(range(b + 1)) if b + 1 <= k else sorted(forced)
            row = torch.tensor(pick, dtype=torch.int32, device=q_idx.device)
            out[q0:q1, :, : row.numel()] = row
            continue
        if kf[0] != a:
            kf = (a, k_idx[a: a + L].float())
        keys = kf[1][: b * Bk]  # [b*Bk, Hik, Di]: the earlier blocks, whole
        q = q_idx[q0:q1].float().reshape(C, Hik, G, Di)
        sc = torch.einsum("chgd,nhd->hgcn", q, keys)  # [Hik, G, C, b*Bk]
        bm = sc.view(Hik, G, C, b, Bk).amax(-1).reshape(Hi, C, b)  # head order h*G + g
        del sc
        fl = [x for x in forced if x < b]
        if fl:
            bm[:, :, fl] = float("-inf")
        top = bm.topk(rest, dim=-1).indices  # [Hi, C, rest]
        f = torch.tensor(sorted(forced), dtype=torch.int64, device=q_idx.device)
        rows = torch.cat([top, f.expand(Hi, C, f.numel())], -1).sort(-1).values
        out[q0:q1] = rows.permute(1, 0, 2).to(torch.int32)
    return out


def _select(msa, q_idx, k_idx, cu, k, Bk, sink_blocks, local_blocks):
    return msa.select_blocks(q_idx, k_idx, k, Bk, cu_seqlens=cu.to(device=q_idx.device,
                                                                   dtype=torch.int32),
                             sink_blocks=sink_blocks, local_blocks=local_blocks)


def _device(device, generator) -> torch.device:
    if device is not None:
        return torch.device(device)
    return generator.device if generator is not None else torch.device("cpu")


def _inputs_and_stats(alpha, cu_seqlens, Hi, Hik, Di, Bk, k, dtype, device, generator,
                      sink_blocks, local_blocks):
    """(q_idx, k_idx, block_idx, stats) of ``index_inputs(alpha, ...)`` drawn from ``generator``."""
    import msa
    qi, ki = index_inputs(alpha, cu_seqlens, Hi, Hik, Di, Bk, dtype=dtype, generator=generator,
                          device=device)
    cu = torch.as_tensor(cu_seqlens).to(device)
    bi = _select(msa, qi, ki, cu, k, Bk, sink_blocks, local_blocks)
    st = selection_stats(bi, cu, k)
    st["alpha"] = float(alpha)
    return qi, ki, bi, st


def _bisect(f, target: float, tol: float, max_steps: int):
    """alpha in [0, 1] whose f(alpha) = (..., stats) has stats["overlap"] closest to ``target``
    (f increasing): f(0) and f(1) first, then bisection steps, the split point taken on the
    secant through the bracket and kept inside its middle 80%. Returns that f(alpha) (only it
    is kept: the others' outputs are dropped as soon as they are beaten)."""

    def err(out):
        return abs(out[-1]["overlap"] - target)

    best = f(0.0)
    lo = best[-1]
    if lo["overlap"] >= target or math.isnan(lo["overlap"]):
        return best
    out = f(1.0)
    hi = out[-1]
    if hi["overlap"] <= target or err(out) < err(best):
        best = out
    if hi["overlap"] <= target:
        return best
    del out
    for _ in range(max_steps):
        if err(best) <= tol:
            break
        a0, a1, y0, y1 = lo["alpha"], hi["alpha"], lo["overlap"], hi["overlap"]
        a = a0 + (a1 - a0) * (target - y0) / (y1 - y0)
        a = min(max(a, a0 + 0.1 * (a1 - a0)), a1 - 0.1 * (a1 - a0))
        out = f(a)
        if err(out) < err(best):
            best = out
        if out[-1]["overlap"] < target:
            lo = out[-1]
        else:
            hi = out[-1]
        del out
    return best


def measure(alpha: float, cu_seqlens, Hi: int, Hik: int, Di: int, Bk: int, k: int, *,
            dtype=torch.bfloat16, device=None, seed: int = 0,
            sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS) -> Dict:
    """Stats (and alpha) of the selection of ``index_inputs(alpha, ...)`` drawn with ``seed``."""
    device = _device(device, None)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return _inputs_and_stats(alpha, cu_seqlens, Hi, Hik, Di, Bk, k, dtype, device, gen,
                             sink_blocks, local_blocks)[-1]


_CALIBRATED: Dict[tuple, Tuple[float, Dict]] = {}


def calibrate(target_overlap: float, cu_seqlens, Hi: int, Hik: int, Di: int, Bk: int, k: int, *,
              dtype=torch.bfloat16, device=None, seed: int = 0,
              sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS,
              tol: float = 0.005, max_steps: int = 10) -> Tuple[float, Dict]:
    """alpha whose index inputs (drawn with ``seed``) give ``target_overlap`` on this shape, by
    bisection: each step one ``index_inputs`` + ``msa.select_blocks`` on the same random
    numbers, so the overlap is a smooth increasing function of alpha; usually 3 to 6 steps to
    reach ``tol``. Pass the sequences of the real shape or a representative part of them. Returns
    (alpha, stats at alpha); alpha is 0 when random index vectors already overlap at least the
    target, 1 when the shared level does not reach it. Results are cached per shape.
    ``make_level`` calibrates on the very inputs it returns instead."""
    device = _device(device, None)
    key = (float(target_overlap), tuple(_lengths(cu_seqlens)), Hi, Hik, Di, Bk, k, str(dtype),
           device.type, seed, sink_blocks, local_blocks, tol, max_steps)
    if key not in _CALIBRATED:
        st = _bisect(lambda a: (measure(a, cu_seqlens, Hi, Hik, Di, Bk, k, dtype=dtype,
                                        device=device, seed=seed, sink_blocks=sink_blocks,
                                        local_blocks=local_blocks),),
                     float(target_overlap), tol, max_steps)[-1]
        _CALIBRATED[key] = (st["alpha"], st)
    return _CALIBRATED[key]


def make_level(name: str, cu_seqlens, Hi: int, Hik: int, Di: int, Bk: int, k: int, *,
               dtype=torch.bfloat16, device=None, seed: int = 0,
               generator: Optional[torch.Generator] = None, alpha: Optional[float] = None,
               sink_blocks: int = SINK_BLOCKS, local_blocks: int = LOCAL_BLOCKS,
               tol: float = 0.005) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Dict]:
    """(q_idx, k_idx, block_idx, stats) of a named level: index inputs drawn from ``generator``
    (a fresh one seeded with ``seed`` when None), their selection by ``msa.select_blocks``
    (``sink_blocks`` and ``local_blocks`` forced) and its ``selection_stats`` plus ``level`` and
    ``alpha``. A calibrated level ("mixed") is calibrated on these very inputs (bisection over
    alpha, each step redrawing the same random numbers) unless ``alpha`` is given, so its
    overlap is the target to within ``tol`` wherever the random and shared levels bracket it.
    Afterwards ``generator`` has advanced past one draw of the inputs."""
    if name not in LEVELS:
        raise ValueError(f"unknown overlap level {name!r}; known: {', '.join(LEVELS)}")
    device = _device(device, generator)
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    lv = LEVELS[name]
    args = (cu_seqlens, Hi, Hik, Di, Bk, k, dtype, device, generator, sink_blocks, local_blocks)
    if alpha is None and "target" in lv:
        start, after = generator.get_state(), []

        def f(a):
            generator.set_state(start)
            out = _inputs_and_stats(a, *args)
            after[:] = [generator.get_state()]
            return out

        qi, ki, bi, st = _bisect(f, lv["target"], tol, 10)
        generator.set_state(after[0])  # the draw count does not depend on alpha
    else:
        qi, ki, bi, st = _inputs_and_stats(lv["alpha"] if alpha is None else alpha, *args)
    st["level"] = name
    return qi, ki, bi, st


def level_names(text: Union[str, Sequence[str]]) -> List[str]:
    """'shared,mixed,random' -> the names, checked."""
    names = [x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip()]
    for n in names:
        if n not in LEVELS:
            raise ValueError(f"unknown overlap level {n!r}; known: {', '.join(LEVELS)}")
    return names


# --------------------------------------------------------------------------------------------
# selections of a trained index branch
# --------------------------------------------------------------------------------------------


def load_trained(path: str, Hi: int, device=None) -> Tuple[Dict[str, torch.Tensor], int]:
    """The selections a trained model saved (examples/train_retrieval.py: {"block_idx": {layer:
    [T, Hi_file, k] int32, or int16 in a copy made smaller}, "block_size": Bk}), each as int32
    [T, Hi, k] for a benchmark of Hi index heads (index head i takes the file's head i % Hi_file),
    and the block size."""
    saved = torch.load(path, map_location="cpu")
    out = {}
    for name, bi in saved["block_idx"].items():
        heads = torch.arange(Hi) % bi.shape[1]
        out[name] = bi[:, heads, :].to(torch.int32).contiguous().to(device)
    return out, int(saved["block_size"])
