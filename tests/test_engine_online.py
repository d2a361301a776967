"""The engine's online API: add_request() / step() / abort_request().

Requests join a running batch whenever they are added (continuous batching), so every request's
greedy tokens must still equal transformers' generate, whatever arrived before or after it;
sampled ones depend only on their own seed; an abort frees exactly the aborted request's pages.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minipaged.engine import Engine, RequestOutput  # noqa: E402

from hf_reference import hf_greedy, random_tokens  # noqa: E402

VOCAB = 500


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(serving_ckpt):
    return serving_ckpt


def _tokens(seed, n):
    return random_tokens(seed, n, VOCAB)


def _engine(folder, **kw):
    return Engine(folder, device="cpu", dtype=torch.float32, backend="torch",
                  **{"block_size": 4, "num_blocks": 64, **kw})


def _drain(eng, got, steps=None):
    """step() until nothing is unfinished (or `steps` steps), collecting tokens by request id and
    checking every output's fields against the tokens collected so far."""
    n = 0
    while eng.has_unfinished_requests() and (steps is None or n < steps):
        assert n < 500, "unfinished requests that step() does not finish"
        for out in eng.step():
            assert isinstance(out, RequestOutput)
            got.setdefault(out.request_id, []).append(out.token_id)
            assert out.output_ids == got[out.request_id]
            assert out.finished == (out.finish_reason is not None)
        n += 1
    return got


def test_requests_added_mid_flight_equal_transformers(ckpt):
    folder, hf = ckpt
    prompts = [_tokens(1, 21), _tokens(2, 6), _tokens(3, 13), _tokens(1, 15) + _tokens(4, 3)]
    news = [9, 5, 7, 6]
    eng = _engine(folder, max_num_batched_tokens=8, max_num_seqs=3)
    ids = [eng.add_request(prompts[0], news[0]), eng.add_request(prompts[1], news[1])]
    got = _drain(eng, {}, steps=4)
    assert got, "the first requests made no progress in four steps"
    ids.append(eng.add_request(prompts[2], news[2]))  # arrives while the others decode
    got = _drain(eng, got, steps=2)
    ids.append(eng.add_request(prompts[3], news[3]))  # shares a prefix with the first
    got = _drain(eng, got)
    assert len(set(ids)) == 4
    for i, rid in enumerate(ids):
        assert got[rid] == hf_greedy(hf, prompts[i], news[i]), i
    assert not eng.has_unfinished_requests() and eng.step() == []
    assert eng.cache.num_free_blocks == eng.cache.num_blocks
    st = eng.stats  # the busy period's stats, per request from its add_request()
    assert st.steps > 0 and st.prefill_tokens > 0
    assert len(st.ttft_seconds) == 4
    assert sorted(len(t) for t in st.token_seconds) == sorted(news)
    assert len(st.itl_seconds) == sum(news) - 4 and min(st.itl_seconds) >= 0 and min(st.ttft_seconds) > 0
    assert st.total_seconds >= max(st.ttft_seconds)
    # generate() works again once the online requests are done, on the same pages
    assert eng.generate([prompts[1]], max_new_tokens=news[1]) == [got[ids[1]]]


def test_logprobs_are_the_models_own(ckpt):
    """Each RequestOutput's logprob is the token's log-probability under the model's distribution at
    that position (a teacher-forced transformers forward), whatever penalties, temperature or cuts
    picked it, greedy or sampled."""
    folder, hf = ckpt
    prompts = [_tokens(13, 10), _tokens(14, 6)]
    eng = _engine(folder, max_num_batched_tokens=8)
    ids = [eng.add_request(prompts[0], 6),
           eng.add_request(prompts[1], 6, temperature=1.0, top_k=5, presence_penalty=1.5, seed=2)]
    got, lps = {}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o.token_id)
            lps.setdefault(o.request_id, []).append(o.logprob)
    for rid, prompt in zip(ids, prompts):
        seq = torch.tensor([prompt + got[rid]])
        with torch.inference_mode():
            logits = hf(seq).logits[0, len(prompt) - 1:-1].double()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(got[rid]).view(-1, 1)).squeeze(1)
        assert torch.allclose(torch.tensor(lps[rid], dtype=torch.float64), want, atol=1e-4), (lps[rid], want)
        assert max(lps[rid]) <= 0.0


def test_finish_reasons_and_stop_tokens(ckpt):
    folder, hf = ckpt
    prompt = _tokens(5, 9)
    want = hf_greedy(hf, prompt, 6)
    eng = _engine(folder)
    a = eng.add_request(prompt, 6)
    b = eng.add_request(prompt, 6, stop_token_ids=[want[2]])
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[a].output_ids == want and outs[a].finish_reason == "length"
    assert outs[b].output_ids == want[: want.index(want[2]) + 1] and outs[b].finish_reason == "stop"


def test_sampled_request_depends_only_on_its_seed(ckpt):
    folder, _ = ckpt
    prompt = _tokens(6, 11)
    eng = _engine(folder)
    alone = eng.add_request(prompt, 8, temperature=1.0, top_k=50, seed=42)
    first = _drain(eng, {})[alone]
    # the same request next to others that arrive at other times, with a smaller token budget
    eng2 = _engine(folder, max_num_batched_tokens=5)
    other = eng2.add_request(_tokens(7, 17), 8, temperature=1.0, seed=1)
    got = _drain(eng2, {}, steps=3)
    again = eng2.add_request(prompt, 8, temperature=1.0, top_k=50, seed=42)
    eng2.add_request(_tokens(8, 5), 4)
    got = _drain(eng2, got)
    assert got[again] == first
    assert got[other] != first
    eng3 = _engine(folder)  # another seed draws other tokens
    rid = eng3.add_request(prompt, 8, temperature=1.0, top_k=50, seed=43)
    assert _drain(eng3, {})[rid] != first


def test_abort_frees_the_request_and_leaves_the_others(ckpt):
    folder, hf = ckpt
    prompts = [_tokens(9, 14), _tokens(10, 10), _tokens(11, 30)]
    eng = _engine(folder, max_num_batched_tokens=6)
    ids = [eng.add_request(p, 6) for p in prompts]
    got = _drain(eng, {}, steps=3)
    eng.abort_request(ids[0])       # running
    eng.abort_request(ids[2])       # still prefilling or waiting
    with pytest.raises(KeyError):
        eng.abort_request(ids[0])   # already gone
    for bad in (12345678, "x", None, True):
        with pytest.raises(KeyError):
            eng.abort_request(bad)
    got = _drain(eng, got)
    assert got[ids[1]] == hf_greedy(hf, prompts[1], 6)
    assert ids[2] not in got or len(got[ids[2]]) < 6
    assert not eng.has_unfinished_requests()
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_generate_refuses_while_online_requests_run(ckpt):
    folder, _ = ckpt
    eng = _engine(folder)
    rid = eng.add_request(_tokens(12, 5), 3)
    with pytest.raises(RuntimeError, match="add_request"):
        eng.generate([[1, 2, 3]], max_new_tokens=2)
    eng.abort_request(rid)
    assert eng.generate([[1, 2, 3]], max_new_tokens=2) != []


@pytest.mark.parametrize("args, kw, exc", [
    (([],), {}, ValueError),
    (([1, 2, VOCAB],), {}, ValueError),
    (([1, 2.5],), {}, TypeError),
    (("12",), {}, TypeError),
    (([1, 2], 0), {}, ValueError),
    (([1, 2], -3), {}, ValueError),
    (([1, 2], 2.0), {}, ValueError),
    (([1, 2],), dict(temperature=float("nan")), ValueError),
    (([1, 2],), dict(top_p=0.0), ValueError),
    (([1, 2],), dict(top_k=-1), ValueError),
    (([1, 2],), dict(seed=1.5), TypeError),
    (([1, 2],), dict(stop_token_ids=7), TypeError),
    (([1, 2],), dict(stop_token_ids=[VOCAB]), ValueError),
    (([1, 2],), dict(ignore_eos="no"), TypeError),
    (([1] * 60, 10_000), {}, ValueError),  # could never fit the cache
])
def test_add_request_refuses_bad_input_and_queues_nothing(ckpt, args, kw, exc):
    eng = _engine(ckpt[0], num_blocks=16)
    with pytest.raises(exc):
        eng.add_request(*args, **kw)
    assert not eng.has_unfinished_requests() and eng.step() == []
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("backend, dtype", [("triton", torch.float32), ("cuda", torch.bfloat16)])
def test_online_requests_on_cuda_gpu(ckpt, backend, dtype):
    """On the GPU (CUDA-graph decode steps between mixed ones): requests added mid-flight all
    finish and free their pages; in fp32 (triton) their tokens equal transformers' greedy ones."""
    folder, hf = ckpt
    eng = Engine(folder, device="cuda", dtype=dtype, backend=backend, block_size=4, num_blocks=64,
                 max_num_batched_tokens=8, max_num_seqs=3)
    prompts = [_tokens(20, 19), _tokens(21, 7), _tokens(22, 12)]
    ids = [eng.add_request(prompts[0], 8), eng.add_request(prompts[1], 8)]
    got = _drain(eng, {}, steps=5)
    ids.append(eng.add_request(prompts[2], 8))
    got = _drain(eng, got)
    assert [len(got[r]) for r in ids] == [8, 8, 8]
    assert eng.cache.num_free_blocks == eng.cache.num_blocks
    if dtype == torch.float32:
        assert [got[r] for r in ids] == [hf_greedy(hf, p, 8) for p in prompts]


def test_bench_serving_arrivals_driver(ckpt):
    """bench_serving's arrivals workload feeds requests through add_request() as their arrival
    times pass and idles between them; with a fake clock its records and outputs can be checked."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from bench_serving import serve_arrivals

    folder, hf = ckpt
    now = [0.0]
    slept = []

    def clock():
        now[0] += 0.001  # every look at the clock costs a millisecond
        return now[0]

    def sleep(s):
        slept.append(s)
        now[0] += s

    prompts = [_tokens(30, 9), _tokens(31, 5), _tokens(32, 14), _tokens(33, 3)]
    news = [4, 6, 3, 5]
    arrive = [0.0, 0.0025, 5.0, 5.001]  # two early, then a pause: the engine drains and idles
    eng = _engine(folder, max_num_batched_tokens=8)
    steps = []
    outs, rec = serve_arrivals(eng, prompts, news, arrive, clock=clock, sleep=sleep, step_s=steps)
    assert outs == [hf_greedy(hf, p, n) for p, n in zip(prompts, news)]
    assert slept and max(slept) > 4.0
    for r, a, n in zip(rec, arrive, news):
        assert r["arrival_s"] >= a and len(r["token_s"]) == n
        assert r["arrival_s"] < r["token_s"][0] and r["token_s"] == sorted(r["token_s"])
    assert rec[2]["arrival_s"] >= 5.0 and rec[1]["token_s"][-1] < 5.0
    assert len(steps) >= max(news) and min(steps) > 0 and sum(steps) < max(r["token_s"][-1] for r in rec)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


_ONLINE_BASES = [_tokens(40, 23), _tokens(41, 9), _tokens(42, 31)]


@st.composite
def _online_scripts(draw):
    """An engine configuration and a script of add / step / abort actions (then a drain)."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    need = -(-48 // block_size)
    kw = dict(block_size=block_size, max_model_len=48, num_blocks=draw(st.sampled_from([need, 2 * need, 8 * need])),
              max_num_seqs=draw(st.sampled_from([1, 2, 4])), max_num_batched_tokens=draw(st.sampled_from([3, 8, 64])),
              enable_prefix_caching=draw(st.booleans()))
    script = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]))
        if kind == "add":
            base = draw(st.sampled_from(_ONLINE_BASES))
            prompt = base[:draw(st.integers(1, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
            script.append(("add", prompt, draw(st.integers(1, 8))))
        elif kind == "abort":
            script.append(("abort", draw(st.integers(0, 7))))
        else:
            script.append(("step",))
    return kw, script


@given(work=_online_scripts())
@settings(deadline=None)
def test_online_scripts_keep_every_request_on_transformers_tokens(ckpt, work):
    """Any interleaving of add_request / step / abort_request on any configuration (small pools:
    preemption; tiny budgets: chunked prompts; caching on or off): every request's tokens are a
    prefix of transformers' greedy ones (all of them unless aborted), aborted requests stop
    getting tokens, and every page is free once the queue drains."""
    folder, hf = ckpt
    kw, script = work
    eng = Engine(folder, device="cpu", dtype=torch.float32, backend="torch", **kw)
    added, aborted, got = [], set(), {}

    def step():
        for o in eng.step():
            assert o.request_id not in aborted
            got.setdefault(o.request_id, []).append(o.token_id)

    for action in script:
        if action[0] == "add":
            added.append((eng.add_request(action[1], action[2]), action[1], action[2]))
        elif action[0] == "step":
            step()
        elif added:
            rid = added[action[1] % len(added)][0]
            try:
                eng.abort_request(rid)
                aborted.add(rid)
            except KeyError:  # it had finished, or was aborted already
                pass
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        step()
    assert not eng.has_unfinished_requests()
    for rid, prompt, n in added:
        want = hf_greedy(hf, prompt, n)
        mine = got.get(rid, [])
        assert mine == want[:len(mine)] and (rid in aborted or mine == want), (rid, kw)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


# Differential fuzzing of the scheduling: one engine under every kind of pressure against a plain one
# (one request at a time, no prefix cache, one prefill per prompt), with the pages checked after every
# step. Prompts are cut from a random base and from one of a repeated token (equal blocks everywhere)
# at block-relative lengths, or are another prompt again, a prefix of it or an extension of it.
_FUZZ_LEN = 40  # max_model_len
_FUZZ_BASES = [_tokens(50, 30), [7] * 30]
_FUZZ_SAMPLING = [{}, {}, dict(temperature=1.0, top_k=8, seed=5), dict(presence_penalty=0.5, repetition_penalty=1.3)]


@st.composite
def _fuzz_scripts(draw):
    """An engine configuration and a script of add / step / abort actions, drawn from a Random that
    hypothesis seeds (a script's prompts refer to earlier ones; per-element draws gave short scripts of
    short requests, which rarely preempted). Adds outnumber steps, so requests pile up and the drain at
    the end runs under pressure."""
    bs = draw(st.sampled_from([2, 1, 16]))
    need = -(-_FUZZ_LEN // bs)  # one request of the longest length fills the pool
    kw = dict(block_size=bs, max_model_len=_FUZZ_LEN, num_blocks=draw(st.sampled_from([need, need + 1, 4 * need])),
              max_num_seqs=draw(st.sampled_from([3, 8, 1])),
              enable_prefix_caching=draw(st.booleans().map(lambda b: not b)),  # on first: the simplest draw
              # budgets that end chunks at every residue mod block_size
              max_num_batched_tokens=draw(st.sampled_from([bs + 1, max(bs - 1, 1), 5, 64, 1])))
    rnd = draw(st.randoms(use_true_random=False))
    script, prompts = [], []
    for _ in range(rnd.randint(2, 30)):
        kind = rnd.choice(["add", "add", "add", "step", "step", "abort"])
        if kind != "add":  # (abort: which unfinished request; True: one mid-prefill if there is one)
            script.append(("step",) if kind == "step" else ("abort", rnd.randrange(8), rnd.random() < 0.5))
            continue
        for _ in range(rnd.choice([1, 1, 3])):  # a burst: prompts admitted in one step
            rel = rnd.choice(["cut", "cut", "same", "prefix", "extend"]) if prompts else "cut"
            if rel == "cut":
                cut = rnd.choice([0, bs - 1, bs, bs + 1, 2 * bs + 1, rnd.randint(0, 30)])
                prompt = rnd.choice(_FUZZ_BASES)[:cut]
                prompt = prompt + [rnd.randrange(VOCAB) for _ in range(rnd.randint(0 if prompt else 1, 3))]
            else:
                src = rnd.choice(prompts)
                prompt = {"same": src, "prefix": src[:rnd.randint(1, len(src))],
                          "extend": src + [rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 3))]}[rel]
            prompts.append(prompt[:_FUZZ_LEN - 2])
            script.append(("add", prompts[-1], rnd.choice([20, 20, 1, 2, 5]), rnd.randrange(len(_FUZZ_SAMPLING))))
    return kw, script


@pytest.fixture(scope="module")
def plain_engine(ckpt):
    """The reference: one request at a time, no prefix cache, one prefill per prompt; results cached."""
    eng = _engine(ckpt[0], block_size=16, num_blocks=8, max_num_seqs=1, max_model_len=_FUZZ_LEN,
                  enable_prefix_caching=False)
    done, keys = {}, {}

    def run(prompt, n, sampling):
        key = (tuple(prompt), n, sampling)
        if key not in done:
            eng.add_request(prompt, n, **_FUZZ_SAMPLING[sampling])
            outs = []
            while eng.has_unfinished_requests():
                outs += eng.step()
            done[key] = [o.token_id for o in outs], [o.logprob for o in outs]
        return done[key]

    def last_layer_k(tokens):
        """The last layer's K of `tokens` (a function of the whole prefix) from one plain prefill."""
        from minipaged import PagedKVCache
        from minipaged.engine.model import AttentionMetadata

        key = tuple(tokens)
        if key not in keys:
            n, cfg = len(tokens), eng.config
            cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=n,
                                 block_size=1, dtype=torch.float32)
            meta = AttentionMetadata("prefill", torch.arange(n), cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
                                     max_seqlen_q=n)
            with torch.inference_mode():
                eng.model.forward(torch.tensor(tokens), torch.arange(n), meta, cache)
            keys[key] = cache.k_caches[-1][:, 0].clone()
        return keys[key]

    return run, last_layer_k


def _check_pages(eng, prefix_of, last_layer_k):
    """Pages are held by exactly the running requests (refcount = table membership, the rest free);
    a page in two tables is a named block every holder has computed; a named block in a table is named
    by the hash of the tokens there; every named block, referenced or evictable, holds the K of the
    prefix its hash names."""
    cache, sched = eng.cache, eng._online
    bs = cache.block_size
    running = list(sched.running) if sched is not None else []
    assert sorted(cache.seq_ids) == sorted(s.seq_id for s in running), "pages held by a request not running"
    holders = {}
    for s in running:
        table = cache.block_table(s.seq_id)
        hashes = cache.block_hashes(s.token_ids)
        for i, b in enumerate(table):
            holders.setdefault(b, []).append((s, i))
            if cache.is_cached(b):
                assert i < len(hashes) and cache._hash_of[b] == hashes[i], f"block {b} named for other tokens"
    assert [cache.ref_count(b) for b in range(cache.num_blocks)] == \
        [len(holders.get(b, ())) for b in range(cache.num_blocks)], "refcounts != table membership"
    assert cache.num_free_blocks == cache.num_blocks - len(holders)
    for b, hs in holders.items():
        if len(hs) > 1:
            assert cache.is_cached(b) and all(s.num_computed >= (i + 1) * bs for s, i in hs), \
                f"block {b} shared by {hs} is not a named block they all computed"
    for h, b in cache._by_hash.items():
        want = last_layer_k(prefix_of[h])[-bs:]
        assert torch.allclose(cache.k_caches[-1][b], want, atol=1e-4), f"named block {b} holds other K"


@given(work=_fuzz_scripts())  # (the ci profile's 12 examples take about 4 s)
def test_any_scheduling_gives_the_plain_engines_tokens_and_logprobs(ckpt, plain_engine, work):
    """Prefix caching, chunks ending anywhere in a block, preemption and eviction in a pool that holds
    one longest request, block sizes 1/2/16, prompts that repeat, extend or cut each other (also in one
    step), arrivals mid-generation and aborts mid-prefill or mid-decode: every request gets the plain
    engine's tokens and logprobs (greedy, penalised and seeded sampling; a prefix of them if aborted),
    the pages are consistent after every step, and all are free at the end (also after a generate()
    with max_new_tokens 0 and 1 over the same prompts)."""
    run, last_layer_k = plain_engine
    kw, script = work
    eng = _engine(ckpt[0], **kw)
    added, aborted, got, lps, prefix_of = {}, set(), {}, {}, {}

    def named(tokens):
        for i, h in enumerate(eng.cache.block_hashes(tokens)):
            prefix_of.setdefault(h, list(tokens[:(i + 1) * eng.cache.block_size]))

    def step():
        for o in eng.step():
            assert o.request_id not in aborted
            got.setdefault(o.request_id, []).append(o.token_id)
            lps.setdefault(o.request_id, []).append(o.logprob)
            named(added[o.request_id][0] + o.output_ids)
        _check_pages(eng, prefix_of, last_layer_k)

    for action in script:
        if action[0] == "add":
            _, prompt, n, sampling = action
            added[eng.add_request(prompt, n, **_FUZZ_SAMPLING[sampling])] = prompt, n, sampling
            named(prompt)
        elif action[0] == "step":
            step()
        else:
            live = [r for r in added if r in eng._online_seqs]
            prefill = [r for r in live if not eng._online_seqs[r].is_decoding and eng._online_seqs[r].num_computed]
            pick = prefill if action[2] and prefill else live
            if pick:
                eng.abort_request(pick[action[1] % len(pick)])
                aborted.add(pick[action[1] % len(pick)])
                _check_pages(eng, prefix_of, last_layer_k)
    # a budget of 1 takes a step per token (a full script's drain takes hundreds); recompute after preemption more
    limit = 100 + 10 * sum(len(p) + n for p, n, _ in added.values())
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            break
        step()
    assert not eng.has_unfinished_requests() and eng.cache.num_free_blocks == eng.cache.num_blocks
    for rid, (prompt, n, sampling) in added.items():
        want, want_lps = run(prompt, n, sampling)
        mine = got.get(rid, [])
        assert mine == want[:len(mine)] and (rid in aborted or mine == want), (rid, prompt, n, sampling, kw)
        assert torch.allclose(torch.tensor(lps.get(rid, [])), torch.tensor(want_lps[:len(mine)]), atol=1e-4)
    prompts = [p for p, _, _ in added.values()][:3]
    news = [i % 3 for i in range(len(prompts))]  # 0, 1, 2
    assert eng.generate(prompts, max_new_tokens=news) == [run(p, k, 0)[0] if k else [] for p, k in zip(prompts, news)]
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_bench_serving_counts_compiled_triton_variants(monkeypatch):
    """triton_variants() counts the compiled variants held by every JITFunction of minipaged's
    Triton modules (a plain JITFunction's own .fn is its Python function, not a kernel)."""
    import os
    import sys
    import types

    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from bench_serving import _new_variants, triton_variant_keys, triton_variants

    def kernel(x, n, BLOCK: "tl.constexpr", SPLIT: "tl.constexpr"):
        pass

    def tuned(x):
        pass

    jit, inner = JITFunction(kernel), JITFunction(tuned)
    jit.device_caches = {0: ({"a": 1, "b": 2}, None, None, None, None), 1: ({"c": 3}, None, None, None, None)}
    inner.device_caches = {0: ({"d": 4}, None, None, None, None)}
    mod = types.ModuleType("minipaged.triton._fake_kernels")
    # the same kernel twice counts once; an autotuner holds its JITFunction in .fn
    mod.kernel, mod.again, mod.tuned = jit, jit, types.SimpleNamespace(fn=inner)
    before, keys = triton_variants(), triton_variant_keys()
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert triton_variants() - before == 4
    # the new variants are named by kernel, device and key
    assert _new_variants(keys, triton_variant_keys()) == ["kernel@0: a", "kernel@0: b", "kernel@1: c", "tuned@0: d"]
    # keys in Triton's text form: a new variant is told by the arguments in which it differs from the
    # closest variant the kernel had (by name)
    old = str([("*bf16", "D"), ("i32", ""), ("constexpr", 64), ("constexpr", False)]) + "{'num_warps': 4}"
    new = str([("*bf16", "D"), ("i32", "D"), ("constexpr", 64), ("constexpr", True)]) + "{'num_warps': 4}"
    far = str([("*bf16", ""), ("i32", "D"), ("constexpr", 32), ("constexpr", False)]) + "{'num_warps': 4}"
    jit.device_caches = {0: ({old: 1, far: 2}, None, None, None, None)}
    mod.kernel, mod.again, mod.tuned = jit, jit, jit
    keys = triton_variant_keys()
    jit.device_caches[0][0][new] = 3
    assert _new_variants(keys, triton_variant_keys()) == ["kernel@0: n='D' (had ''), SPLIT=True (had False)"]
    keys = triton_variant_keys()
    fp32 = str([("*fp32", "D"), ("i32", ""), ("constexpr", 64), ("constexpr", False)]) + "{'num_warps': 4}"
    jit.device_caches[0][0][fp32] = 4
    assert _new_variants(keys, triton_variant_keys()) == ["kernel@0: x='*fp32' (had '*bf16')"]


def test_bench_serving_gc_pauses_are_counted():
    import gc
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from bench_serving import gc_pauses

    with gc_pauses() as stats:
        gc.collect()
        gc.collect(0)
    assert stats["collections"][2] >= 1 and stats["collections"][0] >= 1
    assert 0 < stats["max_s"] <= stats["total_s"]
    n = len(gc.callbacks)
    with gc_pauses():
        pass
    assert len(gc.callbacks) == n
