# Protocol model of prefill_ws_kernel (paged 16-bit, non-persistent): producer warp 0, two consumer
# warpgroups (ping-pong, pipelined+overlap), mbarriers with parity waits, named barriers 3/4.
# Mirrors mainloop_ws.cuh:380-407 (set_item), 496-575 (paged producer), 934-1060 (consumers).
import itertools, random, sys

def item_geometry(ql, ctx, causal, mirror, m_block):
    """set_item + consume_item t_first for one CTA; returns None for 'return' / empty."""
    seqlen_q, seqlen_k = ql, ctx
    if mirror:
        b64 = (ql + 63) // 64
        if 2 * m_block >= b64: return ('skip',)
        m_start = (b64 - 1 - m_block) * 64; m_rows = min(64, ql - m_start)
        m_start1 = m_block * 64; m_rows1 = 0 if m_start1 == m_start else 64
    else:
        m_start = m_block * 128
        if m_start >= ql: return ('skip',)
        m_rows = min(128, ql - m_start); m_start1 = m_rows1 = 0
    diag = seqlen_k - seqlen_q
    n_end = seqlen_k
    if causal: n_end = min(n_end, m_start + m_rows + diag)
    if n_end <= 0: return ('empty',)
    n_tiles = (n_end + 127) // 128
    t_first1 = 0
    if mirror:
        wg_end = seqlen_k
        if causal: wg_end = min(wg_end, m_start1 + m_rows1 + diag)
        wg_tiles = (wg_end + 127) // 128 if (m_rows1 > 0 and wg_end > 0) else 0
        t_first1 = n_tiles - wg_tiles
    tail = (n_tiles - 1) * 128 + 128 - seqlen_k > 0
    return ('run', n_tiles, t_first1, tail)

class MBar:
    def __init__(s, count): s.count = count; s.pending = count; s.tx = 0; s.ph = 0
    def arrive(s, tx=0):
        s.pending -= 1; s.tx += tx
        assert s.pending >= 0, "over-arrival"
        s._check()
    def complete_tx(s, tx):
        s.tx -= tx; s._check()
    def _check(s):
        if s.pending == 0 and s.tx == 0:
            s.ph += 1; s.pending = s.count
    def ready(s, parity): return (s.ph & 1) != parity

def run(n_tiles, t_first1, tail, stages=3, mirror=True, seed=None):
    rng = random.Random(seed)
    B = {}
    B['q_full'] = MBar(1); B['v_tail'] = MBar(1)
    for s in range(stages):
        B[('kf', s)] = MBar(1); B[('vf', s)] = MBar(1); B[('ke', s)] = MBar(8); B[('ve', s)] = MBar(8)
    named = {3: [0, 0], 4: [0, 0]}  # [arrivals this generation, generation]
    inflight = []  # (bar, bytes) TMA not yet landed
    # ---- programs as generators yielding ('wait', cond) ----
    def producer():
        B['q_full'].arrive(1); inflight.append(('q_full', 1))
        fix_at = min(1, n_tiles - 1)
        for t in range(n_tiles):
            s = t % stages; par = ((t // stages) & 1) ^ 1
            yield lambda: B[('ke', s)].ready(par)
            B[('kf', s)].arrive(1); inflight.append((('kf', s), 1))
            vb = 'v_tail' if (t == 0 and tail) else ('vf', s)
            yield lambda: B[('ve', s)].ready(par)
            B[vb].arrive(1); inflight.append((vb, 1))
            if tail and t == fix_at:
                yield lambda: B['v_tail'].ready(0)
                B[('vf', 0)].arrive()
    def consumer(cw):
        slot = lambda t: t % stages; ph = lambda t: (t // stages) & 1
        def rel(b):
            for _ in range(4): B[b].arrive()
        def sync(i):
            g = named[i]; g[0] += 128; gen = g[1]
            assert g[0] <= 256, f"named barrier {i} over-subscribed"
            if g[0] == 256: g[0] = 0; g[1] += 1
            return lambda: named[i][1] > gen
        def arrive(i):
            g = named[i]; g[0] += 128
            assert g[0] <= 256, f"named barrier {i} over-subscribed"
            if g[0] == 256: g[0] = 0; g[1] += 1
        def sched_wait(): return sync(3 + cw)
        def sched_signal(last):
            if not (last and cw == 1): arrive(3 + (1 - cw))
        if cw == 1: arrive(3)
        yield lambda: B['q_full'].ready(0)
        t0 = t_first1 if (mirror and cw == 1) else 0
        for t in range(t0):
            yield lambda: B[('kf', slot(t))].ready(ph(t)); rel(('ke', slot(t)))
            yield lambda: B[('vf', slot(t))].ready(ph(t)); rel(('ve', slot(t)))
            yield sched_wait(); sched_signal(False)
        if t0 < n_tiles:
            yield lambda: B[('kf', slot(t0))].ready(ph(t0))
            yield sched_wait(); sched_signal(False)
            rel(('ke', slot(t0)))
            for t in range(t0 + 1, n_tiles):
                yield lambda: B[('kf', slot(t))].ready(ph(t))
                yield lambda: B[('vf', slot(t - 1))].ready(ph(t - 1))
                yield sched_wait(); sched_signal(False)
                rel(('ke', slot(t))); rel(('ve', slot(t - 1)))
            yield lambda: B[('vf', slot(n_tiles - 1))].ready(ph(n_tiles - 1))
            yield sched_wait(); sched_signal(True)
            rel(('ve', slot(n_tiles - 1)))
        else:
            yield sched_wait(); sched_signal(True)
    agents = {'P': producer(), 'C0': consumer(0), 'C1': consumer(1)}
    conds = {k: None for k in agents}
    done = set()
    steps = 0
    while len(done) < 3:
        steps += 1
        if steps > 100000: return 'livelock?'
        # land some TMA at random
        if inflight and rng.random() < 0.5:
            b, n = inflight.pop(rng.randrange(len(inflight))); B[b].complete_tx(n); continue
        runnable = [k for k in agents if k not in done and (conds[k] is None or conds[k]())]
        if not runnable:
            if inflight:
                b, n = inflight.pop(0); B[b].complete_tx(n); continue
            return f'DEADLOCK waiting: {[k for k in agents if k not in done]}'
        k = rng.choice(runnable)
        try: conds[k] = next(agents[k])
        except StopIteration: done.add(k)
    # every barrier balanced at the end?
    for key, b in B.items():
        if b.pending != b.count or b.tx != 0: return f'unbalanced {key}'
    for i, g in named.items():
        if g[0] != 0: return f'named {i} left with {g[0]} arrivals'
    return 'ok'
