"""GPU: the triton decode over page sizes x head dims x groups x dtypes x split/no split, each
against the torch backend; prints one line per config (and the exception, if any)."""
import itertools, sys, time, traceback
import torch
import minipaged as mp
torch.manual_seed(0)
dev = "cuda"
fails = 0
for dt, D, page, group, lens in itertools.product([torch.bfloat16, torch.float16], [64, 128], [1, 2, 4, 16],
                                                  [1, 2, 8], [(5,), (3000,), (17, 0, 1025)]):
    hkv = 2
    hq = hkv * group
    B = len(lens)
    nbs = [(n + page - 1) // page for n in lens]
    width = max(nbs + [1])
    nblocks = sum(nbs) + 2
    kc = torch.randn(nblocks, page, hkv, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nblocks, device="cpu").to(torch.int32)
    bt = torch.full((B, width), -1, dtype=torch.int32)
    nxt = 0
    for b, nb in enumerate(nbs):
        bt[b, :nb] = perm[nxt:nxt + nb]; nxt += nb
    bt = bt.to(dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(B, hq, D, device=dev, dtype=dt)
    t0 = time.time()
    try:
        o = mp.decode_attention(q, kc, vc, bt, cl, backend="triton")
        r = mp.decode_attention(q, kc, vc, bt, cl, backend="torch")
        err = (o.float() - r.float()).abs().max().item()
        ok = err < 3e-2
        print(f"{'ok  ' if ok else 'BAD '} {dt} D{D} page{page} G{group} lens{lens} err {err:.2e} {time.time()-t0:.1f}s", flush=True)
        fails += not ok
    except Exception as e:
        fails += 1
        print(f"EXC  {dt} D{D} page{page} G{group} lens{lens}: {type(e).__name__}: {str(e)[-300:]}", flush=True)
print("fails", fails)
