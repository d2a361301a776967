import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ws_sim import item_geometry, run
seen = {}
for causal in (True, False):
  for mirror in ((True, False) if causal else (False,)):
    for ql in range(2, 601):
      for ctx in list(range(0, 3601)):
        nb = (ql + 127) // 128
        for mb in range(nb):
            g = item_geometry(ql, ctx, causal, mirror, mb)
            if g[0] != 'run': continue
            key = (mirror,) + g[1:]
            if key not in seen: seen[key] = (ql, ctx, causal, mb)
print('distinct (mirror, n_tiles, t_first1, tail):', len(seen))
bad = 0
for key, ex in sorted(seen.items()):
    mirror, n, tf, tail = key
    for stages in (3, 2):
        for seed in range(4):
            r = run(n, tf, tail, stages=stages, mirror=mirror, seed=seed)
            if r != 'ok':
                bad += 1; print('FAIL', key, 'stages', stages, r, 'example', ex)
                break
print('failures:', bad)
