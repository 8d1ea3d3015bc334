"""msa.distributed: context-parallel MSA over gloo on the CPU backend, against the
single-process call.

Each spawn of W processes (W = 2 and 3; a FileStore on a temporary file, collective timeouts
of 60 s and a deadline on the whole spawn, so a failure never hangs) runs every case: varlen
batches in both layouts, both exchange modes and both call layouts (``call="keys"``, the
queries over keys apart; ``call="rows"``, a query row per gathered key), twice each (bitwise
repeatability), and the bad-shard cases. The workers save their results; the tests here compare them with the
single-process call computed in this process.
"""

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

import msa
import msa.distributed as msad

from conftest import assert_close

SPAWN_DEADLINE_S = 240
PG_TIMEOUT_S = 60

# (name, cu_seqlens, dtype, options): small varlen batches with an empty and a short sequence
CASES = [
    ("varlen64", [0, 150, 170, 170, 333], torch.float64,
     dict(top_k=4, block_size=16, sink_blocks=1, local_blocks=2)),
    ("one32", [0, 200], torch.float32, dict(top_k=3, block_size=32)),
]
HEADS = dict(Hq=4, Hkv=2, Hi=2, Hik=1, D=8, Di=8)
LAYOUTS = ("contiguous", "balanced")
EXCHANGES = ("selected", "allgather")
CALLS = ("keys", "rows")
KL_WEIGHT = 0.7


def _inputs(name):
    """The whole batch's inputs of a case, the same in every process."""
    _, cu, dtype, _ = next(c for c in CASES if c[0] == name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    T = cu[-1]
    h = HEADS

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    x = dict(q=r(T, h["Hq"], h["D"]), k=r(T, h["Hkv"], h["D"]), v=r(T, h["Hkv"], h["D"]),
             q_idx=r(T, h["Hi"], h["Di"]), k_idx=r(T, h["Hik"], h["Di"]),
             gout=r(T, h["Hq"], h["D"]))
    return x, torch.tensor(cu, dtype=torch.int32)


NAMES = ("q", "k", "v", "q_idx", "k_idx")


def _reference(name, warmup=False):
    x, cu = _inputs(name)
    opts = next(c for c in CASES if c[0] == name)[3]
    ins = [x[n].clone().requires_grad_(True) for n in NAMES]
    if warmup:
        out, kl, lse = msa.warmup_attention(*ins, cu_seqlens=cu, return_lse=True)
        bi = torch.empty((0,), dtype=torch.int32)
    else:
        out, kl, lse, bi = msa.sparse_attention(*ins, cu_seqlens=cu, return_lse=True,
                                                return_block_idx=True, **opts)
    loss = (out * x["gout"]).sum() + KL_WEIGHT * kl
    gs = torch.autograd.grad(loss, ins)
    return dict(out=out.detach(), kl=kl.detach(), lse=lse, block_idx=bi,
                **{"d" + n: g for n, g in zip(NAMES, gs)})


def _empty_last_sizes(T, world):
    """Contiguous shard sizes whose last rank holds nothing."""
    return [T // (world - 1) + (r < T % (world - 1)) for r in range(world - 1)] + [0]


def _run_case(name, layout, exchange, call, rank, world):
    """One CP call and its gradients; ``call`` "warmup" runs msad.warmup_attention; layout
    "empty_last" is the contiguous layout with nothing on the last rank."""
    x, cu = _inputs(name)
    opts = next(c for c in CASES if c[0] == name)[3]
    T = cu[-1].item()
    sizes = _empty_last_sizes(T, world) if layout == "empty_last" else None
    lay = "contiguous" if layout == "empty_last" else layout
    pos = msad.shard_positions(lay, rank, world, T, cu, sizes=sizes)
    ins = [x[n][pos].clone().requires_grad_(True) for n in NAMES]
    if call == "warmup":
        out, kl, lse, stats = msad.warmup_attention(
            *ins, cu_seqlens=cu, layout=lay, exchange=exchange, return_lse=True,
            return_stats=True)
        bi = torch.empty((0,), dtype=torch.int32)
    else:
        out, kl, lse, bi, stats = msad.sparse_attention(
            *ins, cu_seqlens=cu, layout=lay, exchange=exchange, call=call, return_lse=True,
            return_block_idx=True, return_stats=True, **opts)
    loss = (out * x["gout"][pos]).sum() + KL_WEIGHT * kl
    gs = torch.autograd.grad(loss, ins)
    return dict(pos=pos, out=out.detach(), kl=kl.detach(), lse=lse, block_idx=bi,
                stats=dict(stats), **{"d" + n: g for n, g in zip(NAMES, gs)})


MODULE = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, block_size=16, top_k=3,
              sink_blocks=1, local_blocks=1, kl_weight=0.5, kl_value=True)
MODULE_CU = [0, 150, 170, 170, 333]


def _module(mode):
    torch.manual_seed(5)
    m = msa.nn.MSAAttention(**MODULE, mode=mode, dtype=torch.float64)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(MODULE_CU[-1], MODULE["d_model"], generator=g, dtype=torch.float64)
    w = torch.randn(MODULE_CU[-1], MODULE["d_model"], generator=g, dtype=torch.float64)
    return m, x, w, torch.tensor(MODULE_CU, dtype=torch.int32)


def _module_grads(m, x, w, cu):
    y, aux = m(x, cu)
    loss = (y * w).sum() + aux
    gs = torch.autograd.grad(loss, list(m.parameters()))
    return y.detach(), aux.detach(), [g.detach() for g in gs]


def _module_case(mode, layout, rank, world):
    """msa.nn.MSAAttention under context parallelism: this rank's y, the aux loss and the
    parameter gradients summed over the ranks."""
    import torch.distributed as dist
    m, x, w, cu = _module(mode)
    m.set_context_parallel(layout=layout)
    pos = msad.shard_positions(layout, rank, world, MODULE_CU[-1], cu)
    y, aux, gs = _module_grads(m, x[pos], w[pos], cu)
    for g in gs:
        dist.all_reduce(g)
    return dict(pos=pos, y=y, aux=aux, grads=gs)


def _worker(rank, world, store_path, outdir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        res = {}
        for name, *_ in CASES:
            for layout in LAYOUTS + ("empty_last",):
                for exchange in EXCHANGES:
                    for call in CALLS + ("warmup",):
                        a = _run_case(name, layout, exchange, call, rank, world)
                        b = _run_case(name, layout, exchange, call, rank, world)
                        a["repeat_equal"] = all(
                            torch.equal(a["d" + n], b["d" + n]) for n in NAMES) and torch.equal(
                            a["out"], b["out"]) and torch.equal(a["kl"], b["kl"])
                        res[(name, layout, exchange, call)] = a
        # bad shards: every rank gets an error naming the problem, none hangs
        x, cu = _inputs("varlen64")
        errors = {}
        pos = msad.shard_positions("contiguous", rank, world, cu[-1].item(), cu)
        ins = [x[n][pos] for n in NAMES]
        cut = [t[:-1] for t in ins] if rank == 1 else ins
        moved = msad.shard_positions("contiguous", rank, world, cu[-1].item(), cu,
                                     sizes=[x["q"].shape[0] - 5 * (world - 1)] + [5] * (world - 1))
        for kind, args, kw in (
            ("short_shard", [x[n][moved] for n in NAMES], dict(layout="balanced")),
            ("total", cut, dict(layout="contiguous")),
            ("top_k", ins, dict(top_k=4 + (rank == 1))),
            ("bad_tensor", [ins[0][0] if rank == 1 else ins[0]] + ins[1:], {}),
        ):
            kw = dict(dict(top_k=4, block_size=16, cu_seqlens=cu), **kw)
            try:
                msad.sparse_attention(*args, **kw)
                errors[kind] = None
            except ValueError as e:
                errors[kind] = str(e)
        res["errors"] = errors
        for mode in ("sparse", "warmup"):
            for layout in LAYOUTS:
                res[("module", mode, layout)] = _module_case(mode, layout, rank, world)
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()  # every rank's collectives done before any tears the group down
    finally:
        dist.destroy_process_group()


def _spawn(world):
    with tempfile.TemporaryDirectory(prefix="msa_cp_") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_worker, args=(world, store, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + SPAWN_DEADLINE_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.terminate()
                pytest.fail(f"{world} processes did not finish within {SPAWN_DEADLINE_S} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = _spawn(world)
    return _RESULTS[world]


_REFS = {}


def _ref(name, warmup=False):
    if (name, warmup) not in _REFS:
        _REFS[(name, warmup)] = _reference(name, warmup)
    return _REFS[(name, warmup)]


# call "warmup": msad.warmup_attention (dense, on the call over keys apart) against
# msa.warmup_attention; layout "empty_last": contiguous shards, the last rank empty.
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("call", CALLS + ("warmup",))
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("layout", LAYOUTS + ("empty_last",))
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_single_process(case, layout, exchange, call, world):
    ref = _ref(case, call == "warmup")
    f64 = next(c for c in CASES if c[0] == case)[2] == torch.float64
    rtol = 1e-12 if f64 else 2e-6
    rtol_idx = 1e-6  # the KL weight reaches the op as a float32 factor (see the module)
    per_rank = [res[(case, layout, exchange, call)] for res in _results(world)]
    T = ref["out"].shape[0]
    seen = torch.zeros(T, dtype=torch.int64)
    for r, got in enumerate(per_rank):
        pos = got["pos"]
        seen[pos] += 1
        if call == "warmup":
            assert got["block_idx"].numel() == 0, f"rank {r}: block_idx"
        else:
            assert torch.equal(got["block_idx"], ref["block_idx"][pos]), f"rank {r}: block_idx"
        assert_close(got["out"], ref["out"][pos], rtol, f"rank {r}: out")
        assert_close(got["lse"], ref["lse"][pos], 1e-6, f"rank {r}: lse")
        for n in ("dq", "dk", "dv"):
            assert_close(got[n], ref[n][pos], rtol, f"rank {r}: {n}")
        for n in ("dq_idx", "dk_idx"):
            assert_close(got[n], ref[n][pos], rtol_idx, f"rank {r}: {n}")
        assert_close(got["kl"], ref["kl"], 1e-6, f"rank {r}: kl")
        # the same support in the same order: the query side is the single-process call's bits
        for n in ("out", "lse", "dq"):
            assert torch.equal(got[n], ref[n][pos]), f"rank {r}: {n} not bitwise equal"
        assert got["repeat_equal"], f"rank {r}: a second run gave other bits"
    assert torch.equal(seen, torch.ones_like(seen)), "the shards must cover every token once"


@pytest.mark.parametrize("world", [2, 3])
def test_selected_exchange_moves_fewer_bytes(world):
    for case in [c[0] for c in CASES]:
        for layout in LAYOUTS:
            sel = [res[(case, layout, "selected", "keys")]["stats"] for res in _results(world)]
            ag = [res[(case, layout, "allgather", "keys")]["stats"] for res in _results(world)]
            sel_b = sum(msad.moved_bytes(s) for s in sel)
            ag_b = sum(msad.moved_bytes(s) for s in ag)
            assert 0 < sel_b < ag_b, (case, layout, sel_b, ag_b)
            assert sum(s["kv_allgather"] for s in sel) == 0
            assert sum(s["kv_fetch"] for s in ag) == 0


@pytest.mark.parametrize("world", [2, 3])
def test_keys_call_fetches_no_more_than_rows_call(world):
    # The call over keys apart fetches the same blocks' rows up to each run's end: the same rows
    # as the row call's with contiguous shards, no more with zigzag ones (whose first run's last
    # block may hold later rows the row call fetches); its call holds only this rank's queries.
    for case in [c[0] for c in CASES]:
        for layout in LAYOUTS:
            for res in _results(world):
                keys = res[(case, layout, "selected", "keys")]["stats"]
                rows = res[(case, layout, "selected", "rows")]["stats"]
                if layout == "contiguous":
                    assert keys["kv_fetch"] == rows["kv_fetch"], (case, layout)
                else:
                    assert keys["kv_fetch"] <= rows["kv_fetch"], (case, layout)
                assert keys["grad_return"] <= rows["grad_return"], (case, layout)


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_bytes_predicts_the_stats(world):
    # msad.exchange_bytes computes, from the single-process selection alone, what every rank's
    # stats dict records in a step (forward and backward): each byte count and fetched row
    res = _results(world)
    keys = ("k_idx_allgather", "kv_request_ids", "kv_fetch", "kv_allgather", "kl_allgather",
            "grad_request_ids", "grad_return", "fetched_tokens")
    for name, cu, dtype, opts in CASES:
        bi = _ref(name)["block_idx"]
        T = cu[-1]
        for layout in LAYOUTS + ("empty_last",):
            sizes = _empty_last_sizes(T, world) if layout == "empty_last" else None
            lay = "contiguous" if layout == "empty_last" else layout
            for exchange in EXCHANGES:
                for call in CALLS:
                    got = msad.exchange_bytes(
                        bi if exchange == "selected" else None, world,
                        cu_seqlens=torch.tensor(cu), layout=lay, sizes=sizes,
                        block_size=opts["block_size"], Hkv=HEADS["Hkv"], D=HEADS["D"],
                        Hik=HEADS["Hik"], Di=HEADS["Di"],
                        element_size=torch.empty((), dtype=dtype).element_size(),
                        exchange=exchange, call=call, kl_value=True)
                    for r in range(world):
                        st = res[r][(name, layout, exchange, call)]["stats"]
                        for key in keys:
                            assert got[r][key] == st[key], (name, layout, exchange, call, r, key,
                                                            got[r][key], st[key])
                        assert msad.moved_bytes(got[r]) == msad.moved_bytes(st)


def test_exchange_bytes_bad_arguments():
    bi = torch.zeros(64, 1, 2, dtype=torch.int32)
    ok = dict(cu_seqlens=torch.tensor([0, 64]), block_size=16, Hkv=1, D=8)
    msad.exchange_bytes(bi, 2, **ok)
    for kw, arg in ((dict(Hkv=0), "Hkv"), (dict(element_size=0), "element_size"),
                    (dict(layout="zigzag"), "layout"), (dict(call="auto"), "call"),
                    (dict(sizes=[10, 10]), "sizes"), (dict(cu_seqlens=torch.tensor([0, 65])),
                                                      "block_idx")):
        with pytest.raises(ValueError, match=f"'{arg}'"):
            msad.exchange_bytes(bi, 2, **dict(ok, **kw))
    for bad in (4, -2):  # 64 tokens of Bk 16: blocks 0..3
        with pytest.raises(ValueError, match="'block_idx'"):
            msad.exchange_bytes(torch.full_like(bi, bad), 2, **ok)
    with pytest.raises(ValueError, match="'block_idx'"):
        msad.exchange_bytes(None, 2, **ok)


def test_contiguous_sizes_balance_the_modelled_cost():
    def cost(sizes, cu, w):
        pos = torch.cat([torch.arange(a, b) - a for a, b in zip(cu[:-1], cu[1:])]).double()
        c = 1.0 + w * (pos + 1)
        out, lo = [], 0
        for n in sizes:
            out.append(float(c[lo: lo + n].sum()))
            lo += n
        return out

    # one sequence: every rank's cost within one block's cost of the others'; the first rank
    # (early, cheap selections) takes the most tokens; cuts on block boundaries
    for world, w in ((2, 1e-3), (3, 2e-3), (4, 5e-4)):
        T = 8192
        sizes = msad.contiguous_sizes(world, T, select_weight=w, block_size=64)
        assert sum(sizes) == T and all(x % 64 == 0 for x in sizes[:-1]), sizes
        c = cost(sizes, [0, T], w)
        assert max(c) - min(c) <= 2 * 64 * (1 + w * T), (sizes, c)
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], sizes
    # no selection cost: the even split
    assert msad.contiguous_sizes(4, 4096, select_weight=0.0, block_size=128) == [1024] * 4
    # packed sequences: cuts on the block boundaries of the sequence they fall in
    cu = [0, 1000, 1000, 5000, 5100]
    sizes = msad.contiguous_sizes(3, cu_seqlens=torch.tensor(cu), select_weight=1e-3,
                                  block_size=128)
    assert sum(sizes) == cu[-1]
    for cut in torch.tensor(sizes).cumsum(0)[:-1].tolist():
        s = max(i for i in range(len(cu) - 1) if cu[i] <= cut)
        assert (cut - cu[s]) % 128 == 0 or cut == cu[s + 1], (cut, cu)
    # a shard that is larger than the others' holds the earlier (cheaper) tokens
    assert sizes[0] >= sizes[1], sizes
    for kw, arg in ((dict(select_weight=-1.0), "select_weight"),
                    (dict(select_weight=float("nan")), "select_weight"),
                    (dict(block_size=0), "block_size")):
        with pytest.raises(ValueError, match=arg):
            msad.contiguous_sizes(2, 1024, **kw)
    with pytest.raises(ValueError, match="total"):
        msad.contiguous_sizes(2)
    with pytest.raises(ValueError, match="total"):
        msad.contiguous_sizes(2, 10, cu_seqlens=torch.tensor([0, 11]))


def _readable_rows(cu, positions, r):
    """The other ranks' rows that rank r reads: those up to its last row of their sequence."""
    seq_of = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    last = {}
    for x in positions[r].tolist():  # ascending: the last one per sequence wins
        last[int(seq_of[x])] = x
    return sum(1 for o in range(len(positions)) if o != r for x in positions[o].tolist()
               if x <= last.get(int(seq_of[x]), -1))


@pytest.mark.parametrize("world", [2, 3])
def test_selected_exchange_sends_only_the_readable_index_keys(world):
    # exchange="selected" sends a rank only the index keys of the prefix it reads (the stats key
    # keeps its name, k_idx_allgather); the baseline all-gathers every other rank's rows.
    res = _results(world)
    for name, cu, dtype, _ in CASES:
        row = HEADS["Hik"] * HEADS["Di"] * torch.empty((), dtype=dtype).element_size()
        for layout in LAYOUTS:
            positions = [res[r][(name, layout, "selected", "keys")]["pos"] for r in range(world)]
            for r in range(world):
                sel = res[r][(name, layout, "selected", "keys")]["stats"]["k_idx_allgather"]
                ag = res[r][(name, layout, "allgather", "keys")]["stats"]["k_idx_allgather"]
                assert sel == _readable_rows(cu, positions, r) * row, (name, layout, r)
                assert ag == (cu[-1] - positions[r].numel()) * row, (name, layout, r)
                if layout == "contiguous" and r == 0:
                    assert sel == 0, name  # nothing before the first rank's rows
                if layout == "contiguous" and len(cu) == 2:
                    # one sequence: every earlier rank's rows, none of the later ones
                    assert sel == sum(x.numel() for x in positions[:r]) * row, (name, r)
            if layout == "balanced":
                # zigzag: rank 0 holds each sequence's last chunk and reads all the others' rows
                assert res[0][(name, layout, "selected", "keys")]["stats"]["k_idx_allgather"] == (
                    cu[-1] - positions[0].numel()) * row, name


@pytest.mark.parametrize("world", [2, 3])
def test_bad_shard_raises_on_every_rank(world):
    res = _results(world)
    for kind, words in (("short_shard", "layout"), ("total", "cu_seqlens"),
                        ("top_k", "top_k"), ("bad_tensor", "rank 1")):
        for r in range(world):
            msg = res[r]["errors"][kind]
            assert msg is not None, f"{kind}: rank {r} raised nothing"
            assert words in msg, f"{kind}: rank {r}: {msg}"
    assert "argument 'q'" in res[1]["errors"]["bad_tensor"]


@pytest.mark.parametrize("kw, arg", [
    (dict(layout="zigzag"), "layout"),
    (dict(exchange="ring"), "exchange"),
    (dict(block_size=24), "block_size"),
    (dict(top_k=0), "top_k"),
    (dict(q_idx=None), "q_idx"),
    (dict(q_idx=None, k_idx=None), "q_idx"),
    (dict(k_idx=None, block_idx=torch.zeros(32, 1, 2, dtype=torch.int32)), "k_idx"),
    (dict(fwd_pass="tiles"), "fwd_pass"),
    (dict(call="dense"), "call"),
])
def test_bad_arguments_raise_before_any_collective(kw, arg):
    """Arguments a rank can judge alone are refused before the first collective (no process
    group is needed to see it), naming the argument."""
    T, D = 32, 8
    args = dict(q=torch.randn(T, 2, D), k=torch.randn(T, 1, D), v=torch.randn(T, 1, D),
                q_idx=torch.randn(T, 1, D), k_idx=torch.randn(T, 1, D), top_k=2, block_size=8)
    args.update(kw)
    with pytest.raises(ValueError, match=f"argument '{arg}'"):
        msad.sparse_attention(**args)


@pytest.mark.parametrize("kw, exc", [
    (dict(layout="zigzag"), ValueError),
    (dict(k_idx=None), ValueError),
    (dict(device="meta"), NotImplementedError),  # call="auto" off the CPU: not yet measured
    (dict(call="rows"), ValueError),  # the warmup runs only on the call over keys apart
])
def test_warmup_bad_arguments_raise_before_any_collective(kw, exc):
    T, D = 32, 8
    dev = kw.pop("device", "cpu")
    args = dict(q=torch.randn(T, 2, D, device=dev), k=torch.randn(T, 1, D, device=dev),
                v=torch.randn(T, 1, D, device=dev), q_idx=torch.randn(T, 1, D, device=dev),
                k_idx=torch.randn(T, 1, D, device=dev))
    args.update(kw)
    arg = "q" if dev != "cpu" else next(iter(kw))
    with pytest.raises(exc, match=f"argument '{arg}'"):
        msad.warmup_attention(**args)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_module_matches_single_process(mode, layout, world):
    m, x, w, cu = _module(mode)
    y, aux, gs = _module_grads(m, x, w, cu)
    for r, got in enumerate(res[("module", mode, layout)] for res in _results(world)):
        assert_close(got["y"], y[got["pos"]], 1e-12, f"rank {r}: y")
        assert_close(got["aux"], aux, 1e-6, f"rank {r}: aux")
        for i, (a, b) in enumerate(zip(got["grads"], gs)):
            # the KL weight reaches the op as a float32 factor (see msa.distributed)
            assert_close(a, b, 1e-6, f"rank {r}: parameter {i} gradient")


def test_module_context_parallel_arguments():
    m = msa.nn.MSAAttention(16, 2, 1)
    with pytest.raises(ValueError, match="'layout'"):
        m.set_context_parallel(layout="zigzag")
    with pytest.raises(ValueError, match="'exchange'"):
        m.set_context_parallel(exchange="ring")
    with pytest.raises(ValueError, match="'select_scores'"):
        msa.nn.MSAAttention(16, 2, 1, select_scores="fp8").set_context_parallel()
    m.set_context_parallel()
    with pytest.raises(ValueError, match="'x'"):
        m(torch.randn(2, 8, 16))
    m.set_context_parallel(layout=None)
    assert m(torch.randn(2, 8, 16))[0].shape == (2, 8, 16)


def test_shard_positions_cover_each_token_once():
    cu = torch.tensor([0, 7, 7, 40, 41], dtype=torch.int32)
    for world in (1, 2, 3, 4):
        for layout in LAYOUTS:
            allpos = torch.cat([msad.shard_positions(layout, r, world, 41, cu)
                                for r in range(world)])
            assert torch.equal(allpos.sort().values, torch.arange(41)), (layout, world)
    z = msad.shard_positions("balanced", 0, 2, 40, None)
    assert z.tolist() == list(range(0, 10)) + list(range(30, 40))


@pytest.mark.parametrize("layout,rank,world", [("contiguous", 1, 3), ("balanced", 0, 2),
                                               ("balanced", 2, 3)])
def test_selection_at_positions_matches_the_prefix_call(layout, rank, world):
    # A rank's selection scores only its queries (the paged selection at their positions); the
    # fallback selects over each sequence's prefix with zero rows elsewhere. Both must give the
    # single-process selection's rows, bit for bit.
    cu = [0, 150, 170, 170, 333, 400]
    T, Hi, Hik, Di = cu[-1], 4, 2, 8
    g = torch.Generator().manual_seed(7)
    q_idx = torch.randn(T, Hi, Di, generator=g, dtype=torch.float64)
    k_idx = torch.randn(T, Hik, Di, generator=g, dtype=torch.float64)
    opts = dict(top_k=4, sink_blocks=1, local_blocks=2, scale_idx=Di ** -0.5)
    p = msad._Plan()
    p.W, p.r, p.N, p.Bk, p.Hik, p.layout = world, rank, T, 16, Hik, layout
    p.cu = torch.tensor(cu, dtype=torch.int64)
    p.positions = [msad.shard_positions(layout, o, world, T, cu) for o in range(world)]
    p.sizes = [x.numel() for x in p.positions]
    p.geo = msad._geometry(p, torch.device("cpu"))
    pos = p.positions[rank]
    want = msa.select_blocks(q_idx, k_idx, opts["top_k"], p.Bk,
                             cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                             sink_blocks=1, local_blocks=2)[pos]
    at_positions = msad._select(p, q_idx[pos], k_idx, opts)
    prefix = msad._select_prefix(p, q_idx[pos], k_idx, opts)
    assert torch.equal(at_positions, want)
    assert torch.equal(prefix, want)


def test_multicast_stays_off():
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_bench_cp_tiny(tmp_path, capsys):
    """bench/bench_cp.py --device cpu --tiny on two local processes (gloo)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_cp
    out = tmp_path / "cp"
    rc = bench_cp.main(["--device", "cpu", "--tiny", "--spawn", "2", "--lengths", "256",
                        "--index", "random", "--reps", "1", "--timeout", "60", "--out", str(out),
                        "--warmup-check", "128"])
    assert rc == 0
    warm = list(__import__("csv").DictReader(open(tmp_path / "cp-warmup.csv")))
    assert [r["layout"] for r in warm] == ["contiguous", "balanced"]
    for r in warm:  # float32 on the CPU backend: the query side exact, the key side's sums close
        errs = {k: float(v) for k, v in r.items() if k.startswith("err_")}
        assert len(errs) == 7 and max(errs.values()) < 1e-6, r
    rows = (tmp_path / "cp.csv").read_text().splitlines()
    assert len(rows) == 1 + 6  # header + 3 layouts x 2 exchanges
    assert "err_out" in rows[0]
    import csv
    weighted = [r for r in csv.DictReader(rows) if r["layout"] == "contiguous-weighted"]
    assert len(weighted) == 2 and all(
        sum(map(int, r["shard_sizes"].split("/"))) == 256 for r in weighted), weighted


def test_cp_bytes_tiny(tmp_path):
    """bench/cp_bytes.py at tiny heads: per layout the bytes of the selected exchange (below
    the all-gather's) and the modelled work, the weighted contiguous shards the most even."""
    import csv
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import cp_bytes
    out = tmp_path / "b"
    assert cp_bytes.main(["--tiny", "--lengths", "2048", "--levels", "shared,random", "--world",
                          "3", "--select-weight", "1e-3", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(f"{out}.csv")))
    assert len(rows) == 2 * 3
    for level in ("shared", "random"):
        by = {r["layout"]: r for r in rows if r["level"] == level}
        for r in by.values():
            assert 0 < float(r["of_allgather"]) < 1, r
        assert float(by["contiguous-weighted"]["work_max_over_mean"]) < float(
            by["contiguous"]["work_max_over_mean"])
    # a list of seeds: one selection each, the listed seed's rows those of a run of it alone
    out2 = tmp_path / "s"
    assert cp_bytes.main(["--tiny", "--lengths", "2048", "--levels", "random", "--world", "3",
                          "--select-weight", "1e-3", "--seed", "1,0", "--out", str(out2)]) == 0
    rows2 = list(csv.DictReader(open(f"{out2}.csv")))
    assert [r["seed"] for r in rows2] == ["1"] * 3 + ["0"] * 3
    key = ("layout", "mib_selected", "fetched_tokens", "overlap", "union")
    assert [tuple(r[k] for k in key) for r in rows2[3:]] == [
        tuple(r[k] for k in key) for r in rows if r["level"] == "random"]
    assert [r["fetched_tokens"] for r in rows2[:3]] != [r["fetched_tokens"] for r in rows2[3:]]


def test_cp_scaling_tiny(tmp_path):
    """bench/cp_scaling.py --device cpu --tiny on two local processes (gloo): strong and weak
    scaling over 1 and 2 ranks from one launch, the 2-rank step checked against the one-rank
    step, its bytes below the all-gather's and its communication a share of its phases."""
    import csv
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import cp_scaling
    out = tmp_path / "sc"
    assert cp_scaling.main(["--device", "cpu", "--tiny", "--spawn", "2", "--worlds", "1,2",
                            "--strong", "512", "--weak", "256", "--index", "random", "--reps",
                            "1", "--phases", "--check", "--timeout", "60", "--out",
                            str(out)]) == 0
    rows = list(csv.DictReader(open(f"{out}.csv")))
    steps = [r for r in rows if r["mode"] in ("strong", "weak")]
    assert [(r["mode"], int(r["T"]), int(r["world"])) for r in steps] == [
        ("strong", 512, 1), ("strong", 512, 2), ("weak", 256, 1), ("weak", 512, 2)]
    for r in steps:
        assert float(r["ms"]) > 0 and float(r["efficiency"]) > 0, r
        if r["world"] == "1":
            assert float(r["efficiency"]) == 1.0 and r["of_allgather"] == "", r
        else:
            assert 0 < float(r["of_allgather"]) <= 1, r
            assert 0 < float(r["comm_share"]) < 1, r
    checks = [r for r in rows if r["mode"] == "check"]
    assert len(checks) == 1 and checks[0]["world"] == "2"
    errs = {k: float(v) for k, v in checks[0].items() if k.startswith("err_") and v}
    # float32 on the CPU backend: the query side exact, the key side's sums in another order
    assert len(errs) == 6 and max(errs.values()) < 1e-6, errs


@pytest.mark.parametrize("argv, name", [
    (["--worlds", "0,2"], "--worlds"), (["--worlds", "two"], "--worlds"),
    (["--strong", "1X"], "--strong"), (["--weak", "0"], "--weak"), (["--reps", "0"], "--reps"),
    (["--strong", "", "--weak", ""], "--strong")])
def test_cp_scaling_bad_arguments(argv, name, capsys):
    """bench/cp_scaling.py refuses a bad value before any process starts, naming the argument."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import cp_scaling
    with pytest.raises(SystemExit):
        cp_scaling.parse_args(["--device", "cpu", "--tiny"] + argv)
    assert f"argument {name}" in capsys.readouterr().err
