"""A list-scheduling model of how the GPU runs a causal attention grid: programs start in
index order on the first free SM (one resident per SM), each taking time proportional to
its key tiles plus a fixed cost. It compares the makespan of the dense varlen prefill's grid
(heads vary fastest), the paged long-chunk kernel's grid with KV heads on an axis of their
own (every tile of head 0 first) and with heads fastest (configs.PAGED_HEADS_FASTEST), on
the triton paged benchmark's long rows. A model of the order only: it ignores everything but
the number of key tiles, so it says which order leaves long tiles for the last wave, not how
long a tile takes.

    python3 scripts/wave_model.py [--sms 132]
"""

from __future__ import annotations

import argparse
import heapq

# (name, sequences, q_len, context): the long rows of scripts/triton_paged_ab.py
ROWS = (("mixed: 2k chunk over 4k (its long launch)", 1, 2048, 4096),
        ("chunked B=8 q=512 L=4608", 8, 512, 4608),
        ("chunked B=1 q=2048 L=32768", 1, 2048, 32768))
HQ, HKV, BLOCK_N = 16, 8, 64


def makespan(jobs, sms: int) -> float:
    free = [0.0] * sms
    heapq.heapify(free)
    for j in jobs:
        heapq.heappush(free, heapq.heappop(free) + j)
    return max(free)


def tile_work(q_len: int, ctx: int, block_q: int, overhead: int = 2) -> list[int]:
    """Key tiles (plus a fixed cost) of each query tile, bottom-right causal, longest first."""
    diag = ctx - q_len
    return [-(-min(ctx, t * block_q + block_q + diag) // BLOCK_N) + overhead
            for t in reversed(range(-(-q_len // block_q)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args(argv)
    print(f"{'row':44} {'dense':>8} {'heads slowest':>14} {'heads fastest':>14}  (makespan, key tiles)")
    for name, seqs, q_len, ctx in ROWS:
        # dense: 128 query rows of one head per program, (sequence x head) fastest
        dense = [w for w in tile_work(q_len, ctx, 128) for _ in range(seqs * HQ)]
        # paged v2: 64 positions x group 2 heads per program, tile-major over sequences (DIRECT)
        slots = [w for w in tile_work(q_len, ctx, 64) for _ in range(seqs)]
        slowest = [w for _ in range(HKV) for w in slots]
        fastest = [w for w in slots for _ in range(HKV)]
        d, s, f = (makespan(x, args.sms) for x in (dense, slowest, fastest))
        print(f"{name:44} {d:8.0f} {s:14.0f} {f:14.0f}  slowest/fastest {s / f:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
