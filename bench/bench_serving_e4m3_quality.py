#!/usr/bin/env python3
"""What E4M3 caches change in a decode step (docs/contract.md §6): the selection's recall of the
bf16 cache's selection, and the outputs' cosine similarity with the bf16 cache's outputs.

For each level of index inputs (``selection_patterns.index_inputs``: alpha 0.44, the mixed
level's alpha at 128K, and alpha 0, random), ``batch`` sequences of ``ctx`` tokens whose last
``q_len`` tokens are the new ones; caches of Bk-token pages (a shuffled page table) holding
bf16 k, v, k_idx, and E4M3 copies with a scale per page (the page's largest magnitude / 448,
torch's rounding to the nearest code, as the append does). Paper heads by default (Hq 64,
Hkv 4, Hi 4, Hik 1, D = Di = 128, k 16, sink 1, local 4). Reported per level:

  overlap    the neighbour overlap of the bf16 selection over the new tokens of a sequence;
  recall     the share of the bf16 selection's blocks the E4M3 index keys' selection holds
             (all entries, and the entries that are not forced blocks);
  cos attend the cosine similarity of paged_forward over the bf16 selection with E4M3 k, v
             against bf16 k, v: over all outputs, and the lowest of any (token, head) row
             (and the ratio of the two outputs' norms, which a cosine does not see);
  cos step   the same for the whole step (each cache's own selection, then its attention).

Runs on the CUDA backend when there is one, else on the CPU backend (smaller default ctx):

    python bench/bench_serving_e4m3_quality.py --ctx 1048576 --batch 8 --out docs/e4m3-quality
"""

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msa  # noqa: E402
from msa import serving  # noqa: E402
import selection_patterns as sp  # noqa: E402
from bench_select_fp8 import recall  # noqa: E402

LEVELS = {"mixed": 0.44, "random": 0.0}
FP8 = torch.float8_e4m3fn


def quantise(x: torch.Tensor):
    """E4M3 codes of a cache [pages, Bk, H, D] and its scales (a page's largest magnitude / 448)."""
    s = x.abs().amax(dim=(1, 2, 3)).float().clamp(min=1e-12) / 448.0
    return (x.float() / s.view(-1, 1, 1, 1)).to(FP8), s


def cosine(a: torch.Tensor, b: torch.Tensor):
    """(cosine over every element, lowest cosine of a row [.., D]) of two outputs."""
    a, b = a.double(), b.double()
    whole = float((a * b).sum() / (a.norm() * b.norm()).clamp(min=1e-300))
    rows = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=1e-300)
    return whole, float(rows.min())


def quality(alpha: float, ctx: int, batch: int, q_len: int, device, seed: int = 0, Hq: int = 64,
            Hkv: int = 4, Hi: int = 4, Hik: int = 1, D: int = 128, Di: int = 128, Bk: int = 128,
            k: int = 16) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    sink, local = sp.SINK_BLOCKS, sp.LOCAL_BLOCKS
    per = -(-ctx // Bk)
    pages = batch * per
    cu_full = torch.arange(batch + 1, device=device, dtype=torch.int64) * ctx
    q_idx_full, k_idx_full = sp.index_inputs(alpha, cu_full, Hi, Hik, Di, Bk, dtype=torch.bfloat16,
                                             generator=gen, device=device)
    table = torch.randperm(pages, generator=gen, device=device).to(torch.int32).view(batch, per)
    # Cache row of token x of sequence s: page table[s, x // Bk], row x % Bk.
    t = torch.arange(batch * ctx, device=device)
    seq, x = t // ctx, t % ctx
    rows = table[seq, x // Bk].long() * Bk + x % Bk

    def cache(values, H, dim):
        c = torch.zeros(pages * Bk, H, dim, device=device, dtype=torch.bfloat16)
        c[rows] = values
        return c.view(pages, Bk, H, dim)

    r = lambda *s: torch.randn(*s, device=device, generator=gen).to(torch.bfloat16)  # noqa: E731
    kc, vc, kic = cache(r(batch * ctx, Hkv, D), Hkv, D), cache(r(batch * ctx, Hkv, D), Hkv, D), \
        cache(k_idx_full, Hik, Di)
    (k8, ks), (v8, vs), (ki8, kis) = quantise(kc), quantise(vc), quantise(kic)
    new = (seq * ctx + x)[x >= ctx - q_len]  # the new tokens, sequence by sequence
    q_idx = q_idx_full[new].contiguous()
    q = r(batch * q_len, Hq, D)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len
    kw = dict(top_k=k, max_q_len=q_len, sink_blocks=sink, local_blocks=local)
    with msa.value_checks(False):
        ref = serving.paged_select_blocks(q_idx, kic, table, lens, cu, **kw)
        got = serving.paged_select_blocks(q_idx, ki8, table, lens, cu, k_idx_scale=kis, **kw)
        out = serving.paged_forward(q, kc, vc, table, lens, cu, block_idx=ref, **kw)
        out8 = serving.paged_forward(q, k8, v8, table, lens, cu, block_idx=ref, k_scale=ks,
                                     v_scale=vs, **kw)
        step8 = serving.paged_forward(q, k8, v8, table, lens, cu, q_idx=q_idx, k_idx_cache=ki8,
                                      k_scale=ks, v_scale=vs, k_idx_scale=kis, **kw)
    own = ((ctx - q_len + torch.arange(q_len, device=device)) // Bk).repeat(batch)[:, None, None]
    forced = (ref >= 0) & ((ref < sink) | ((ref <= own) & (ref > own - local)))
    rec, rec_free = recall(got, ref, forced)
    stats = sp.selection_stats(ref, cu, k=k)
    ca, ca_min = cosine(out8, out)
    norm_ratio = float(out8.double().norm() / out.double().norm())
    cs, cs_min = cosine(step8, out)
    return dict(alpha=alpha, ctx=ctx, batch=batch, q_len=q_len, overlap=round(stats["overlap"], 3),
                recall=rec, recall_free=rec_free, cos_attend=ca, cos_attend_min=ca_min,
                norm_ratio_attend=norm_ratio,
                cos_step=cs, cos_step_min=cs_min)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available() and msa.backend_available("cuda")
    p.add_argument("--ctx", type=int, default=131072 if cuda else 16384)
    p.add_argument("--batch", type=int, default=8 if cuda else 2)
    p.add_argument("--q-len", type=int, default=8)
    p.add_argument("--levels", default="mixed,random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write PREFIX.csv")
    args = p.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    for name in [s.strip() for s in args.levels.split(",") if s.strip()]:
        row = dict(level=name, **quality(LEVELS[name], args.ctx, args.batch, args.q_len, device,
                                         seed=args.seed))
        rows.append(row)
        print(f"{name}: overlap {row['overlap']:.3f}  recall {row['recall']:.4f} (non-forced "
              f"{row['recall_free']:.4f})  cos attend {row['cos_attend']:.6f} (row min "
              f"{row['cos_attend_min']:.6f})  cos step {row['cos_step']:.6f} (row min "
              f"{row['cos_step_min']:.6f})", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
