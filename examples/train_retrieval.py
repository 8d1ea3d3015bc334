#!/usr/bin/env python3
"""Does MSA learn? A small decoder-only model trained on a synthetic long-context retrieval task,
three ways from the same initialisation for the same steps:

  dense   torch SDPA causal attention (the index projections exist but are unused);
  warmup  msa.nn.MSAAttention: a warmup phase (dense attention + the KL that trains the index
          branch), then sparse attention over the selected blocks;
  sparse  MSA sparse attention from step 0 (the index branch learns from the KL alone).

The task (--task needle, the default): random filler tokens from the bottom half of the
vocabulary, one value token from the top half at a random place, and the last --queries tokens
all ANS: at each of them the model must answer the value, which sits up to a whole sequence
earlier, so attention must reach far back and a good index branch must select the needle's
block. --task mqar is multi-query associative recall (KEY k v pairs, QUERY k ANS at the end).
The filler is random and carries no loss by default, so a filler row's attention learns nothing;
--filler words with --lm-weight makes it repeated short words and adds a next-token loss over
them (local attention, as in text), and --bos starts every sequence with a BOS token.
--dense-layers N keeps the first N layers dense in the MSA models, as MiniMax's production
models keep their first layers dense; the KL and the recall then cover the other layers.
Training starts on short sequences (--curriculum) and ends at --seq-len; every evaluation is at
--seq-len. Weights are float32; on the GPU the model runs under bf16 autocast.

Reported per evaluation (CSV + PNG next to --out): answer accuracy and loss on held-out sequences;
the KL of each MSA layer; the index recall (means over layers, tokens and index heads): the share
of the dense teacher's attention mass that the selected blocks hold (recall_mass), the share its
own top-k blocks hold (recall_oracle, what a perfect index would reach), the paper's score and
block recall against that top-k (recall_score, recall_block), and how often the block holding the
answer's value is selected for the ANS tokens (recall_answer: any index head, mean over layers),
and the mass and oracle over the ANS rows alone (recall_ans_mass, recall_ans_oracle: the rows that
carry the task's loss, where a filler row's untrained attention does not dilute them);
each layer's mass, oracle, score and chance (recall_mass_l0, ...); the next-token loss of the
filler (lm_loss, with the training's train_lm);
the step time of each model. At the end, the trained warmup model's block_idx of its layers at
the training length is saved (PREFIX_block_idx.pt) for the kernel benchmarks.

    python examples/train_retrieval.py --device cuda --out runs/retrieval   # on a GPU (~2 minutes)
    python examples/train_retrieval.py --tiny --out /tmp/retrieval           # the CPU smoke run

At 32K with heads of 128 (the shape the Hopper kernels are built for; about 7 minutes on an H200,
where the sparse step is 1.8x faster than the dense one; docs/perf.md, 2026-12-03):

    python examples/train_retrieval.py --device cuda --seq-len 32768 --heads 8 --kv-heads 2 \\
      --head-dim 128 --curriculum 256:600,512:150,1024:150,2048:100,4096:100,8192:100,16384:100 \\
      --steps 1550 --warmup-steps 1100 --eval-every 250 --lr-decay-start 1300 --out runs/r32k

With two index heads per KV head (``--idx-heads 4``, each serving two query heads) and 550 steps
at 32K, the warmup-then-sparse model alone (``--models warmup --steps 1800 --eval-every 500``)
reached the paper's score recall 0.82 at full accuracy in about 5 minutes, where one index head
per KV head stays at 0.73-0.78; its sparse step, though, takes about the dense step's time
(docs/perf.md, 2026-12-04; one of two seeds learned the task). At 16K (``--seq-len 16384``, the
curriculum without its 16384 stage, ``--steps 1550 --seed 1 --idx-heads 4``) the three models
took 4.6 minutes, all at full accuracy, the warmup model's index holding 82% of the teacher's
attention; there the sparse step is 1.11x the dense one's time.

``--compile`` runs each model's training forward through torch.compile (all three alike: the
elementwise work around the attention, norms, rotary embeddings and projections, fused; a
recompile at each new length and at the switch to sparse mode, whose time the first steps of
that stage include).
"""

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

import msa
from msa.nn import MSAAttention

Tensor = torch.Tensor
FILLER0 = 4  # token ids: 0 BOS, 1 KEY, 2 QUERY, 3 ANSWER-slot; fillers, keys and values after
BOS = 0


def filler(B: int, L: int, vocab: int, kind: str, gen: torch.Generator) -> Tensor:
    """Filler token ids [B, L] from the bottom half of the vocabulary. "random": independent
    uniform tokens (nothing to predict, so nothing for the attention of a filler row to learn);
    "words": runs of 16-64 tokens, each a random word of 2-8 distinct tokens repeated, so that
    after a run's first word every token is the one a word length back: predicting it needs the
    last few tokens (a previous-token and an induction head), the local attention of text."""
    half = FILLER0 + (vocab - FILLER0) // 2
    if kind == "random":
        return torch.randint(FILLER0, half, (B, L), generator=gen)
    n = half - FILLER0
    lo_run, hi_run, lo_len, hi_len = 16, 64, 2, min(8, n)
    runs = L // lo_run + 1
    length = torch.randint(lo_run, hi_run + 1, (B, runs), generator=gen)
    start = length.cumsum(1) - length                                     # [B, runs]
    pos = torch.arange(L).expand(B, L).contiguous()
    run = torch.searchsorted(start, pos, right=True) - 1                  # [B, L]
    offset = pos - start.gather(1, run)
    period = torch.randint(lo_len, hi_len + 1, (B, runs), generator=gen).gather(1, run)
    words = torch.rand(B, runs, n, generator=gen).argsort(-1)[..., :hi_len] + FILLER0
    return words.gather(1, run[..., None].expand(B, L, hi_len)).gather(
        2, (offset % period)[..., None]).squeeze(-1)


def needle_batch(B: int, L: int, vocab: int, queries: int, gen: torch.Generator, device,
                 filler_kind: str = "random"):
    """The needle task: filler tokens from the bottom half of the vocabulary (filler()), one
    value token from the top half at a random position before the last `queries` tokens, which
    are all ANS: the model must answer that value at each of them. Returns what batch() does."""
    half = FILLER0 + (vocab - FILLER0) // 2
    x = filler(B, L, vocab, filler_kind, gen)
    vals = torch.randint(half, vocab, (B, 1), generator=gen)
    pos = torch.randint(0, L - queries, (B, 1), generator=gen)
    x.scatter_(1, pos, vals)
    x[:, L - queries:] = 3
    ans_pos = torch.arange(L - queries, L)
    return (x.to(device), vals.expand(B, queries).to(device), ans_pos.to(device),
            pos.expand(B, queries).to(device))


def make_batch(args, B: int, L: int, gen: torch.Generator, device):
    """A batch of the task; with --bos, its sequences are a BOS token and L - 1 tokens of it."""
    n = L - 1 if args.bos else L
    if args.task == "needle":
        x, target, ans_pos, value_pos = needle_batch(B, n, args.vocab, args.queries, gen, device,
                                                     args.filler)
    else:
        x, target, ans_pos, value_pos = batch(B, n, args.vocab, args.pairs, args.queries, gen,
                                              device, args.filler)
    if not args.bos:
        return x, target, ans_pos, value_pos
    x = torch.cat([torch.full((B, 1), BOS, dtype=x.dtype, device=x.device), x], 1)
    return x, target, ans_pos + 1, value_pos + 1


def batch(B: int, L: int, vocab: int, pairs: int, queries: int, gen: torch.Generator, device,
          filler_kind: str = "random"):
    """Token ids [B, L]; the answers [B, queries]; the positions of the ANS tokens [queries]
    (the same in every sequence) and of the answers' value tokens [B, queries]. Keys (distinct
    within a sequence) and values come from the top half of the vocabulary, fillers from the
    bottom half (filler())."""
    half = FILLER0 + (vocab - FILLER0) // 2
    assert pairs <= vocab - half and queries <= pairs
    x = filler(B, L, vocab, filler_kind, gen)
    keys = torch.stack([torch.randperm(vocab - half, generator=gen)[:pairs] for _ in range(B)]) + half
    vals = torch.randint(half, vocab, (B, pairs), generator=gen)
    slots = (L - 3 * queries) // 3
    starts = torch.stack([torch.randperm(slots, generator=gen)[:pairs] for _ in range(B)]) * 3
    ask = torch.stack([torch.randperm(pairs, generator=gen)[:queries] for _ in range(B)])
    rows = torch.arange(B)[:, None]
    x[rows, starts] = 1
    x[rows, starts + 1] = keys
    x[rows, starts + 2] = vals
    q0 = L - 3 * queries + 3 * torch.arange(queries)
    x[:, q0] = 2
    x[rows, q0 + 1] = keys.gather(1, ask)
    x[:, q0 + 2] = 3  # the model answers here
    target = vals.gather(1, ask)
    value_pos = starts.gather(1, ask) + 2
    return x.to(device), target.to(device), (q0 + 2).to(device), value_pos.to(device)


class Block(nn.Module):
    def __init__(self, d: int, attn: MSAAttention):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Model(nn.Module):
    """Embedding, layers of (attention, MLP) with pre-norm residuals, an output head. `kind`:
    "dense" runs SDPA on the attention layer's own q, k, v projections; "msa" runs the layer.
    The first `dense_layers` layers run SDPA in every kind (MiniMax's production models keep
    their first layers dense, paper.md: `sparse_attention_freq`); their index projections are
    unused."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, block: int,
                 top_k: int, kl_weight: float, head_dim=None, idx_heads=None,
                 select_scores: str = "input", dense_layers: int = 0):
        super().__init__()
        self.dense_layers = dense_layers
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            Block(d, MSAAttention(d, heads, kv_heads, head_dim=head_dim, n_idx_heads=idx_heads,
                                  block_size=block, top_k=top_k, sink_blocks=1, local_blocks=2,
                                  kl_weight=kl_weight, select_scores=select_scores))
            for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab)
        self.kind = "msa"

    def msa_layers(self) -> List[int]:
        """The layers that run MSA when kind is "msa"."""
        return list(range(self.dense_layers, len(self.blocks)))

    def set_mode(self, kind: str, mode: str = "sparse"):
        self.kind = kind
        for b in self.blocks:
            b.attn.set_mode(mode)

    def attend(self, attn: MSAAttention, h: Tensor, B: int, L: int, n: int):
        """Layer n's attention of h [B * L, d]: (output [B, L, d], KL term)."""
        if self.kind == "msa" and n >= self.dense_layers:
            return attn(h.view(B, L, -1))
        q, k, v, _, _ = attn.project(h, torch.arange(B + 1, device=h.device, dtype=torch.int32) * L,
                                     index=False)
        o = F.scaled_dot_product_attention(
            q.view(B, L, attn.n_heads, -1).transpose(1, 2), k.view(B, L, attn.n_kv_heads, -1).transpose(1, 2),
            v.view(B, L, attn.n_kv_heads, -1).transpose(1, 2), is_causal=True, enable_gqa=True)
        y = attn.o_proj(o.transpose(1, 2).reshape(B * L, -1))
        return y.view(B, L, -1), h.new_zeros((), dtype=torch.float32)

    def forward(self, x: Tensor, ans_pos: Tensor, lm: bool = False):
        """Logits at the answer positions [B, len(ans_pos), vocab] and the layers' KL sum; with
        `lm`, also the next-token loss over the filler (lm_loss())."""
        B, L = x.shape
        h = self.emb(x)
        aux = h.new_zeros((), dtype=torch.float32)
        for n, b in enumerate(self.blocks):
            a, kl = self.attend(b.attn, b.n1(h).reshape(B * L, -1), B, L, n)
            h = h + a
            h = h + b.mlp(b.n2(h))
            aux = aux + kl
        h = self.norm(h)
        logits = self.head(h[:, ans_pos])
        if not lm:
            return logits, aux
        return logits, aux, lm_loss(self.head(h[:, :-1]), x)


def lm_loss(logits: Tensor, x: Tensor) -> Tensor:
    """Next-token cross entropy of logits [B, L - 1, vocab] over the positions whose next token
    is filler and follows filler (not the needle, keys, values or the answer slots)."""
    half = FILLER0 + (logits.shape[-1] - FILLER0) // 2
    is_filler = (x >= FILLER0) & (x < half)
    keep = (is_filler[:, 1:] & is_filler[:, :-1]).flatten()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="none")
    return (ce * keep).sum() / keep.sum().clamp(min=1)


def selection_recall(pi: Tensor, sel: Tensor, rows: Tensor, block: int):
    """Sums over query rows of how well selections `sel` [..., R, k] (block ids, -1 unused)
    cover a teacher's attention `pi` [..., R, nblk] (each row's mass per key block) for the rows
    at positions `rows` [R]. I* is the teacher's own top-k blocks (the row's causal blocks when
    it has fewer than k). Returns a dict of sums over rows: "mass", the teacher mass inside the
    selection; "oracle", the mass inside I*; "score", the paper's score recall
    sum_{I* & sel} P_b / sum_{I*} P_b; "block", its block recall |I* & sel| / |I*|; "chance",
    the mass a uniform teacher would have inside the selection (the selected share of the row's
    causal keys); "rows"."""
    k = sel.shape[-1]
    valid = sel >= 0
    mass = (pi.gather(-1, sel.clamp(min=0)) * valid).sum(-1)
    keys = (valid * torch.clamp((rows[:, None] + 1) - sel.clamp(min=0) * block, 0, block)).sum(-1)
    top_p, top_b = pi.topk(k, dim=-1)
    kk = torch.clamp(rows // block + 1, max=k)  # |I*|: the row's causal blocks, at most k
    star = torch.arange(k, device=pi.device) < kk[:, None]
    # the selected blocks as a mask (unused slots go to a spare column past the last block)
    nblk = pi.shape[-1]
    chosen = torch.zeros(*pi.shape[:-1], nblk + 1, dtype=torch.bool, device=pi.device)
    chosen = chosen.scatter_(-1, torch.where(valid, sel, nblk), True)[..., :nblk]
    both = chosen.gather(-1, top_b) & star
    oracle = (top_p * star).sum(-1)
    score = (top_p * both).sum(-1) / oracle.clamp(min=1e-30)
    return dict(mass=float(mass.sum()), oracle=float(oracle.sum()), score=float(score.sum()),
                block=float((both.sum(-1) / kk).sum()), chance=float((keys / (rows + 1)).sum()),
                rows=mass.numel())


@torch.no_grad()
def recall(model: Model, x: Tensor, ans_pos: Tensor, value_pos: Tensor, max_rows: int = 8192,
           chunk: int = 1024):
    """How well the MSA layers' selections (--dense-layers' layers have none) cover their dense
    teachers on (at most two of) sequences x [B, L]: the means over layers of selection_recall's
    "mass" (the dense teacher's attention mass in the selected blocks), "oracle" (the mass in the
    teacher's own top-k blocks: what a perfect index would hold), "score" and "block" (the paper's
    score and block recall against that top-k), "chance" (the same mass for a uniform teacher: the
    selected share of each row's causal keys), "answer" (the share of (layer, answer) where the
    ANS token's selection holds the block of the answer's value), and "ans_mass", "ans_oracle"
    (mass and oracle over the ANS rows alone, the rows that carry the task's loss); also each
    layer's mass, oracle, score and chance (key "mass_l0", ...). The means are over query rows:
    every row when L <= max_rows, else an evenly strided sample of max_rows rows (an unbiased
    estimate); the dense teacher of those rows is computed `chunk` rows at a time."""
    x, value_pos = x[:2], value_pos[:2]
    B, L = x.shape
    h = model.emb(x)
    out: Dict[str, List[float]] = {}
    cu = torch.arange(B + 1, device=x.device, dtype=torch.int32) * L
    rows = torch.arange(0, L, max(1, L // max_rows), device=x.device)
    layers = model.msa_layers()
    for n, b in enumerate(model.blocks):
        a = b.attn
        hn = b.n1(h).reshape(B * L, -1)
        if n < model.dense_layers:  # a dense layer: no index branch to measure
            h = h + model.attend(a, hn, B, L, n)[0]
            h = h + b.mlp(b.n2(h))
            continue
        q, k, _, qi, ki = a.project(hn, cu)
        bi = msa.select_blocks(qi, ki, a.top_k, a.block_size, cu_seqlens=cu,
                               sink_blocks=a.sink_blocks, local_blocks=a.local_blocks)
        G, Gi = a.n_heads // a.n_kv_heads, a.n_heads // a.n_idx_heads
        qf = q.view(B, L, a.n_heads, -1).transpose(1, 2).float()
        kf = k.view(B, L, a.n_kv_heads, -1).transpose(1, 2).float().repeat_interleave(G, 1)
        sel = bi.view(B, L, a.n_idx_heads, -1).long().permute(0, 2, 1, 3)  # [B, Hi, L, k]
        nblk = -(-L // a.block_size)

        def cover(rows: Tensor) -> Dict[str, float]:
            """selection_recall's means over `rows`, the teacher computed `chunk` rows at a time."""
            sums = dict(mass=0.0, oracle=0.0, score=0.0, block=0.0, chance=0.0, rows=0)
            for r0 in range(0, rows.numel(), chunk):
                rr = rows[r0: r0 + chunk]
                s = qf[:, :, rr] @ kf.transpose(-1, -2) / math.sqrt(a.head_dim)  # [B, H, R, L]
                s = s.masked_fill(torch.arange(L, device=x.device)[None, :] > rr[:, None],
                                  -math.inf)
                pi = s.softmax(-1).view(B, a.n_idx_heads, Gi, rr.numel(), L).mean(2)
                del s
                pi = F.pad(pi, (0, nblk * a.block_size - L)).view(
                    B, a.n_idx_heads, rr.numel(), nblk, -1).sum(-1)
                for key, v in selection_recall(pi, sel[:, :, rr], rr, a.block_size).items():
                    sums[key] += v
                del pi
            n = sums.pop("rows")
            return {key: v / n for key, v in sums.items()}

        for key, v in cover(rows).items():
            out.setdefault(key, []).append(v)
        for key, v in cover(ans_pos).items():  # the rows that answer: the task's loss is there
            if key in ("mass", "oracle"):
                out.setdefault("ans_" + key, []).append(v)
        qsel = sel[:, :, ans_pos, :]  # the answering tokens' selections [B, Hi, queries, k]
        vb = (value_pos // a.block_size)[:, None, :, None]
        out.setdefault("answer", []).append(float((qsel == vb).any(3).any(1).float().mean()))
        a_out, _ = a(hn.view(B, L, -1))
        h = h + a_out
        h = h + b.mlp(b.n2(h))
    res = {key: sum(v) / len(v) for key, v in out.items()}
    for key in ("mass", "oracle", "score", "chance"):  # and each layer's (recall_mass_l0, ...)
        res.update({f"{key}_l{n}": v for n, v in zip(layers, out[key])})
    return res


def evaluate(model: Model, data, kind: str, mode: str):
    x, target, ans_pos, value_pos = data
    model.set_mode(kind, mode)
    for b in model.blocks:
        b.attn.kl_value = True
    with torch.no_grad():
        logits, aux, lm = model(x, ans_pos, lm=True)
    for b in model.blocks:
        b.attn.kl_value = False
    row = dict(loss=float(F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())),
               lm_loss=float(lm),
               acc=float((logits.argmax(-1) == target).float().mean()),
               kl=float(aux) / (len(model.msa_layers()) * model.blocks[-1].attn.kl_weight or 1.0))
    if kind == "msa":
        row.update({"recall_" + key: v for key, v in recall(model, x, ans_pos, value_pos).items()})
    return row


def length_at(args, step: int) -> int:
    """The training length at `step` (1-based): the --curriculum stages, then --seq-len."""
    done = 0
    for length, steps in args.curriculum:
        done += steps
        if step <= done:
            return length
    return args.seq_len


def batch_at(args, length: int) -> int:
    """The training batch at `length`: --batch, capped at --max-tokens tokens per step."""
    if args.max_tokens <= 0:
        return args.batch
    return max(1, min(args.batch, args.max_tokens // length))


def lr_at(args, step: int, length: int) -> float:
    """The learning rate at `step` (1-based): a linear warmup over --lr-warmup steps, then --lr,
    or with --lr-decay-start S > 0 a cosine from --lr at step S down to --lr-min x --lr at
    --steps (the long stages of a curriculum take small batches: a constant rate there can
    undo what the short stages learned); with --scale-lr, times the batch at `length` over
    --batch."""
    lr = args.lr * min(1.0, step / max(1, args.lr_warmup))
    start = args.lr_decay_start
    if start > 0 and step > start:
        frac = min(1.0, (step - start) / max(1, args.steps - start))
        lr *= args.lr_min + (1.0 - args.lr_min) * 0.5 * (1.0 + math.cos(math.pi * frac))
    if args.scale_lr:
        lr *= batch_at(args, length) / args.batch
    return lr


def parse_curriculum(text: str):
    """"1024:300,4096:300" -> [(1024, 300), (4096, 300)]."""
    out = []
    for part in filter(None, text.split(",")):
        length, steps = part.split(":")
        out.append((int(length), int(steps)))
    return out


def run(args) -> Dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    # float32 weights (bf16 weights would drop AdamW's small updates); on the GPU the matmuls
    # and the attention run in bf16 under autocast.
    base = Model(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads,
                 args.block_size, args.top_k, args.kl_weight, args.head_dim or None,
                 args.idx_heads or None, args.select_scores,
                 args.dense_layers).to(device=device)
    amp = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
           else contextlib.nullcontext)
    init = {k: v.clone() for k, v in base.state_dict().items()}
    gen_eval = torch.Generator().manual_seed(args.seed + 1)
    evals = make_batch(args, args.eval_batch, args.seq_len, gen_eval, device)
    rows: List[Dict] = []
    summary: Dict = {}
    t_start = time.perf_counter()
    for name in args.models.split(","):
        model = base
        model.load_state_dict(init)
        # --compile: the same module through torch.compile (its mode attributes are guarded)
        train_fwd = torch.compile(model) if args.compile else model
        # the index projections learn only from the KL; --idx-lr-mult scales their step
        idx = [p for n, p in model.named_parameters() if "_idx_proj" in n]
        main = [p for n, p in model.named_parameters() if "_idx_proj" not in n]
        opt = torch.optim.AdamW([dict(params=main, lr_mult=1.0),
                                 dict(params=idx, lr_mult=args.idx_lr_mult)],
                                lr=args.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(args.seed + 2)  # the same batches for every model
        times = []
        for step in range(1, args.steps + 1):
            if name == "dense":
                model.set_mode("dense")
            elif name == "warmup":
                model.set_mode("msa", "warmup" if step <= args.warmup_steps else "sparse")
            else:
                model.set_mode("msa", "sparse")
            L = length_at(args, step)
            x, target, ans_pos, _ = make_batch(args, batch_at(args, L), L, gen, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(args, step, L) * g["lr_mult"]
            with amp():
                if args.lm_weight > 0:
                    logits, aux, lm = train_fwd(x, ans_pos, lm=True)
                    aux = aux + args.lm_weight * lm
                else:
                    logits, aux = train_fwd(x, ans_pos)
                    lm = torch.zeros(())
                loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
            opt.zero_grad(set_to_none=True)
            (loss + aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0, L))
            if step % args.eval_every == 0 or step == args.steps:
                # the median step of the window at this step's length (a stage may start inside it)
                recent = sorted(t for t, n in times[-args.eval_every:] if n == L)
                mode = model.blocks[-1].attn.mode  # evaluated as trained at this step
                row = dict(model=name, step=step, mode="dense" if name == "dense" else mode,
                           train_loss=float(loss.detach()), train_lm=float(lm.detach()),
                           train_len=L, batch=batch_at(args, L),
                           step_ms=1e3 * recent[len(recent) // 2])
                with amp():
                    row.update(evaluate(model, evals, "dense" if name == "dense" else "msa", mode))
                rows.append(row)
                print(json.dumps(row), flush=True)
        summary[name] = rows[-1]
        if name == "warmup" and args.out:
            model.set_mode("msa", "sparse")
            with amp():
                save_selection(model, evals[0], args.out + "_block_idx.pt")
    return dict(rows=rows, summary=summary, wall_s=time.perf_counter() - t_start,
                args={k: v for k, v in vars(args).items() if k != "curriculum"},
                curriculum=args.curriculum)


@torch.no_grad()
def save_selection(model: Model, x: Tensor, path: str):
    """block_idx [T, Hi, k] of each MSA layer on the first evaluation sequence."""
    x = x[:1]
    B, L = x.shape
    cu = torch.tensor([0, L], device=x.device, dtype=torch.int32)
    h = model.emb(x)
    out = {}
    for n, b in enumerate(model.blocks):
        a = b.attn
        hn = b.n1(h).reshape(L, -1)
        if n >= model.dense_layers:
            _, _, _, qi, ki = a.project(hn, cu)
            out[f"layer{n}"] = msa.select_blocks(qi, ki, a.top_k, a.block_size, cu_seqlens=cu,
                                                 sink_blocks=a.sink_blocks,
                                                 local_blocks=a.local_blocks).cpu()
        h = h + model.attend(a, hn, 1, L, n)[0]
        h = h + b.mlp(b.n2(h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(dict(block_idx=out, block_size=model.blocks[0].attn.block_size), path)


def write_report(prefix: str, result: Dict):
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    keys: List[str] = []
    for r in result["rows"]:
        keys += [k for k in r if k not in keys]
    with open(prefix + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(result["rows"])
    with open(prefix + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    panels = [("acc", "answer accuracy"), ("loss", "eval loss"), ("kl", "KL per layer"),
              ("recall_mass", "teacher mass in selection"),
              ("recall_score", "score recall (vs teacher top-k)"),
              ("recall_answer", "answer block selected")]
    colors = {"dense": "tab:blue", "warmup": "tab:orange", "sparse": "tab:green"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        for name in dict.fromkeys(r["model"] for r in result["rows"]):
            pts = [(r["step"], r[key]) for r in result["rows"] if r["model"] == name and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, color=colors.get(name))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="dense,warmup,sparse")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--curriculum", type=parse_curriculum,
                   default=parse_curriculum("256:700,512:150,1024:150,2048:100,4096:100"),
                   help="shorter training lengths first, LEN:STEPS,... (then --seq-len); "
                        "evaluation is always at --seq-len")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=0,
                   help="cap the batch at this many tokens per step (0: no cap; long stages)")
    p.add_argument("--scale-lr", action="store_true",
                   help="scale the learning rate with the batch of each length (linear scaling: "
                        "a batch capped by --max-tokens takes proportionally smaller steps)")
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--task", choices=["needle", "mqar"], default="needle",
                   help="needle: one value token somewhere, answered at each of the last "
                        "--queries tokens; mqar: "
                        "multi-query associative recall over (KEY k v) pairs")
    p.add_argument("--filler", choices=["random", "words"], default="random",
                   help="random: independent filler tokens; words: repeated short words, "
                        "whose next token a model predicts from the last few (with --lm-weight)")
    p.add_argument("--lm-weight", type=float, default=0.0,
                   help="weight of a next-token loss over the filler added to the answer loss "
                        "(0: the answer loss alone, and the filler rows' attention is untrained)")
    p.add_argument("--bos", action="store_true",
                   help="start every sequence with a BOS token (a place for heads with nothing "
                        "to attend to: the attention sink of trained language models)")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dense-layers", type=int, default=0,
                   help="the first N layers run dense attention (SDPA) in every model, as "
                        "MiniMax's production models keep their first layers dense; the index "
                        "recall and the KL cover the other layers")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=0,
                   help="attention head width (0: d_model / heads); heads of 128 are the shape "
                        "the Hopper kernels are built for")
    p.add_argument("--idx-heads", type=int, default=0,
                   help="index query heads (0: one per KV head; e.g. 2 per KV head, an index "
                        "head per Hq / Hi query heads, for a sharper teacher)")
    p.add_argument("--select-scores", choices=("input", "fp8"), default="input",
                   help="what the sparse models' selection ranks blocks by (MSAAttention's "
                        "select_scores): the index inputs' own scores, or their E4M3 copies "
                        "re-ranked (the KL keeps the inputs' scores)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--kl-weight", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--idx-lr-mult", type=float, default=1.0,
                   help="learning rate of the index projections, as a multiple of --lr")
    p.add_argument("--lr-warmup", type=int, default=50)
    p.add_argument("--lr-decay-start", type=int, default=0,
                   help="from this step on, a cosine decay of the learning rate to --lr-min x "
                        "--lr at the last step (0: constant after the warmup)")
    p.add_argument("--lr-min", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--warmup-steps", type=int, default=800)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write PREFIX.csv, PREFIX.json, PREFIX.png")
    p.add_argument("--tiny", action="store_true", help="a small CPU configuration (seconds)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each model's training forward (all three alike; it compiles "
                        "again at a new length or mode; the steps timed then include those)")
    args = p.parse_args(argv)
    if args.tiny:
        args.device = "cpu"
        args.seq_len, args.batch, args.eval_batch, args.vocab, args.pairs, args.queries = 96, 4, 8, 64, 4, 3
        args.d_model, args.layers, args.heads, args.kv_heads = 32, 2, 4, 2
        args.block_size, args.top_k, args.lr = 8, 4, 3e-3
        args.steps, args.warmup_steps, args.eval_every = 36, 24, 12
        args.curriculum = [(48, 6)]
        args.lr_warmup = 4
    if not 0 <= args.dense_layers < args.layers:
        p.error(f"--dense-layers {args.dense_layers}: must be in [0, --layers = {args.layers}) "
                "(at least one MSA layer)")
    if args.filler == "words" and (args.vocab - FILLER0) // 2 < 2:
        p.error(f"--vocab {args.vocab}: --filler words needs at least 8 "
                "(two filler tokens for a word)")
    result = run(args)
    if args.out:
        write_report(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
