"""One launch each of the Triton dense varlen prefill and the Triton paged long-chunk kernel on
the same work, for ncu (issue #13: why the paged kernel is ~0.87x the dense one).

The case is `minipaged bench --op paged`'s chunked B=1 q=2048 L=32768 (or --case), page 16,
bf16, Hq/Hkv/D 16/8/128; inputs and paging as scripts/triton_paged_ab.py builds them. Each
kernel runs twice (a compile/warm-up call, then the profiled one), inside NVTX ranges named
`dense` and `paged`:

    ncu --clock-control none --set full --nvtx --nvtx-include "dense/" --nvtx-include "paged/" \\
        --launch-skip 1 ... python3 scripts/triton_paged_ncu.py

(or -k regex:"_attn_fwd|_paged_long_kernel"). Both outputs are checked against the fp64
oracle first, so a profile is never of a wrong kernel.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_paged_ab as ab  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="chunked B=1 q=2048 L=32768", help="a chunked case of scripts/triton_paged_ab.py")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes: the plumbing only")
    args = ap.parse_args()
    if args.smoke:
        ab._smoke_setup()
        args.case = next(c for c in ab.CASES if "chunked" in c)
    from minipaged.testing import cu_seqlens
    from minipaged.triton import ops

    dense = ab._dense(args.case)
    q, keys, vals = dense
    q_lens, ctxs = ab.CASES[args.case]
    k, v = torch.cat(keys), torch.cat(vals)
    cu_q, cu_k = cu_seqlens(q_lens, ab.DEVICE), cu_seqlens(ctxs, ab.DEVICE)
    scale = 1 / math.sqrt(ab.D)
    paged = ab._paged_fn(ab._paged_inputs(args.case, args.page, dense), {})

    def dense_fn():
        return ops.prefill_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(ctxs), True, scale, False)

    truth, lowp = ab._oracle(args.case, dense)
    bad = 0
    for name, fn in (("dense", dense_fn), ("paged", paged)):
        err, bound = ab._check(fn(), truth, lowp)
        print(f"{name}: max error {err:.3e} (bound {bound:.3e}) {'ok' if err <= bound else 'FAIL'}")
        bad += err > bound
    if ab.DEVICE != "cuda":
        return 1 if bad else 0
    torch.cuda.synchronize()
    for name, fn in (("dense", dense_fn), ("paged", paged)):
        torch.cuda.nvtx.range_push(name)
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
