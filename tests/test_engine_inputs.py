"""Engine and `minipaged generate` inputs: a malformed config.json is a usage error naming
the field, arguments are checked before weights are built, and warmup() runs on every
engine that generate() can run on."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minipaged import cli
from minipaged.engine import Engine, Qwen3Config
from minipaged.engine import engine as engine_mod

_TINY = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": True}


def _folder(path, config) -> str:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


_BAD_CONFIGS = [
    ("[1, 2]", ["config.json", "object"]),                             # was: TypeError from dict()
    ({**_TINY, "num_attention_heads": 0, "head_dim": None}, ["num_attention_heads", "0"]),  # ZeroDivisionError
    ({**_TINY, "num_hidden_layers": 0}, ["num_hidden_layers", "0"]),   # ZeroDivisionError sizing the cache
    ({**_TINY, "vocab_size": None}, ["vocab_size", "None"]),            # TypeError from int(None)
    ({**_TINY, "rope_scaling": "yarn"}, ["rope_scaling", "yarn"]),      # AttributeError: str has no .get
    ({**_TINY, "hidden_size": 0}, ["hidden_size", "0"]),                # was accepted: an engine of width 0
    ({**_TINY, "eos_token_id": "x"}, ["eos_token_id", "x"]),            # message did not name the field
    ({**_TINY, "tie_word_embeddings": "false"}, ["tie_word_embeddings", "false"]),  # bool("false"): tied
    ({**_TINY, "rms_norm_eps": -1}, ["rms_norm_eps", "-1"]),            # was accepted: NaN norms, token 0
    ({**_TINY, "head_dim": 64.5}, ["head_dim", "64.5"]),                # was truncated to 64
]


@pytest.mark.parametrize("config, words", _BAD_CONFIGS)
def test_malformed_config_is_a_value_error_naming_the_field(tmp_path, config, words):
    folder = _folder(tmp_path / "m", config)
    with pytest.raises(ValueError) as e:
        Qwen3Config.from_any(folder)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_object_checks_its_sizes():
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        with pytest.raises(ValueError, match=field):
            Qwen3Config.from_dict({**_TINY, field: 0})
    with pytest.raises(ValueError, match="rope_theta"):
        Qwen3Config.from_dict({**_TINY, "rope_theta": 0})
    with pytest.raises(ValueError, match="hidden_size"):
        Engine({**_TINY, "hidden_size": 0}, device="cpu", backend="torch", num_blocks=4)


@pytest.mark.parametrize("config, words", _BAD_CONFIGS[:5])
def test_generate_with_a_malformed_config_is_one_error_line(tmp_path, capsys, config, words):
    folder = _folder(tmp_path / "m", config)
    rc = cli.main(["generate", "--model", folder, "--device", "cpu", "--backend", "torch", "--batch", "1",
                   "--prompt-len", "4", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_max_model_len_is_checked_before_weights_are_built(tmp_path, monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("weights were built before max_model_len was checked")

    monkeypatch.setattr(engine_mod, "random_state_dict", no_weights)
    monkeypatch.setattr(engine_mod, "load_checkpoint", no_weights)
    with pytest.raises(ValueError, match="max_model_len=129"):
        Engine(_TINY, device="cpu", backend="torch", num_blocks=4, max_model_len=129)
    folder = _folder(tmp_path / "m", _TINY)
    with pytest.raises(ValueError, match="max_model_len=129"):
        Engine(folder, device="cpu", backend="torch", num_blocks=4, max_model_len=129)


@pytest.mark.parametrize("kw", [dict(max_model_len=3), dict(num_blocks=1, block_size=4),
                                dict(num_blocks=5, block_size=1), dict(num_blocks=1, block_size=1)])
def test_warmup_runs_on_every_engine_generate_runs_on(kw):
    """warmup() used a fixed 4-token prompt and 3 new tokens: an engine whose max_model_len or
    cache is smaller raised ValueError there (the CLI calls warmup() on CUDA, outside its checks)."""
    torch.manual_seed(0)
    eng = Engine(_TINY, device="cpu", backend="torch", **{"num_blocks": 16, **kw})
    assert eng.generate([[1]], max_new_tokens=1) != [[]]
    eng.warmup()
    c = eng.cache
    assert not c.seq_ids and c.num_free_blocks == c.num_blocks


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=5), dict(enable_prefix_caching=False)])
def test_warmup_runs_every_step_kind(kw):
    """warmup() reaches the step kinds a server meets, so their kernels compile there: decode-only
    steps, a packed multi-prompt prefill, a mixed step (a decode next to a prompt chunk), and with
    prefix caching a prompt tail that attends over cached pages. It leaves no request, page or
    stats behind."""
    torch.manual_seed(0)
    eng = Engine(_TINY, device="cpu", backend="torch", **{"num_blocks": 32, "block_size": 4, **kw})
    plans = []
    run = eng.runner.run

    def spy(plan, **k):
        plans.append([(c.start, c.num_tokens, c.start + c.num_tokens == len(c.seq.token_ids) and c.start > 0
                       and c.num_tokens == 1) for c in plan.chunks])
        return run(plan, **k)

    eng.runner.run = spy
    eng.warmup()
    decode_only = [p for p in plans if all(d for _, _, d in p)]
    packed = [p for p in plans if sum(1 for s, n, d in p if s == 0 and not d) >= 2]
    mixed = [p for p in plans if any(d for _, _, d in p) and any(not d for _, _, d in p)]
    tails = [p for p in plans if any(s > 0 and not d for s, _, d in p)]
    assert decode_only and packed and mixed, plans
    # A whole budget of prompt (half the cache at most: the rest decodes) next to one decode, and next
    # to as many decodes as the cache holds: the long-chunk and the batch-filling kernel variants.
    budget = eng.max_num_batched_tokens
    chunk = min(budget, min(eng.max_model_len, 32 * 4) // 2)
    full = {sum(d for _, _, d in p) for p in mixed
            if any(not d and n == min(chunk, budget - sum(d for _, _, d in p)) for _, n, d in p)}
    assert 1 in full and max(full) >= 2, plans
    if kw.get("enable_prefix_caching", True) or "max_num_batched_tokens" in kw:
        assert tails, plans  # a cached prefix's tail, or a chunk after the first
    c = eng.cache
    assert not c.seq_ids and c.num_free_blocks == c.num_blocks
    assert not eng.has_unfinished_requests() and eng.stats.steps == 0


def test_generate_ignore_eos_ignores_the_tokenizers_eos_too(tmp_path, capsys):
    """--ignore-eos ("always generate --max-new-tokens tokens") still stopped at the tokenizer's EOS,
    which the CLI passed as an explicit stop token."""
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from minipaged.engine.loader import random_state_dict, save_checkpoint

    cfg = Qwen3Config.from_dict(_TINY)
    folder = tmp_path / "m"
    save_checkpoint(str(folder), cfg, random_state_dict(cfg, seed=0))
    eng = Engine(str(folder), device="cpu", backend="torch", num_blocks=4)
    first = eng.generate([[1, 2]], max_new_tokens=1)[0][0]
    # the model's first greedy token is the tokenizer's EOS
    vocab = {f"w{i}": i for i in range(64)}
    vocab["[UNK]"] = 64
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=f"w{first}").save_pretrained(folder)
    argv = ["generate", "--model", str(folder), "--prompt", "w1 w2", "--device", "cpu", "--backend", "torch",
            "--batch", "1", "--max-new-tokens", "4", "--num-blocks", "4"]
    assert cli.main(argv) == 0
    assert "--- output 0 (1 tokens)" in capsys.readouterr().out  # stops at EOS by default
    assert cli.main([*argv, "--ignore-eos"]) == 0
    assert "--- output 0 (4 tokens)" in capsys.readouterr().out


def test_state_dict_that_is_not_a_dict_is_a_type_error():
    with pytest.raises(TypeError, match="state_dict"):  # was: AttributeError from .items()
        Engine(_TINY, device="cpu", backend="torch", num_blocks=4, state_dict=[("model.norm.weight", None)])


def test_numpy_sampling_numbers_are_numbers():
    """A temperature or seed computed with numpy (np.float32, np.int64) was a TypeError."""
    import numpy as np

    eng = Engine(_TINY, device="cpu", backend="torch", num_blocks=8)
    want = eng.generate([[1, 2, 3]], max_new_tokens=4, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)
    got = eng.generate([[1, 2, 3]], max_new_tokens=4, temperature=np.float32(0.7), top_p=np.float64(0.9),
                       seed=np.int64(5), ignore_eos=True)
    assert got == want
    with pytest.raises(TypeError, match="temperature"):
        eng.generate([[1]], max_new_tokens=1, temperature=np.bool_(True))


def test_block_table_widths_are_padded_to_a_multiple_of_16():
    """On a GPU, eager paged and decode steps pass block tables whose row stride is a multiple of 16 columns
    whatever the batch's longest sequence (Triton would compile another kernel variant for each
    stride class: 1, divisible by 16, other), padded with -1 past each row's own pages; outputs
    match an engine run one request at a time."""
    from minipaged.engine import runner as runner_mod

    torch.manual_seed(0)
    eng = Engine(_TINY, device="cpu", backend="torch", num_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert eng.runner.table_multiple == 1  # on the CPU nothing compiles: no padding
    eng.runner.table_multiple = runner_mod.TABLE_WIDTH_MULTIPLE  # what a GPU runner does
    widths = []
    forward = eng.runner.model.forward

    def spy(ids, positions, meta, cache):
        if meta.block_tables is not None:
            widths.append(meta.block_tables.stride(0))
        return forward(ids, positions, meta, cache)

    eng.runner.model.forward = spy
    prompts = [[3, 4, 5, 6, 7, 8, 9], list(range(10, 40)), [11, 12]]
    outs = eng.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert widths and all(w % 16 == 0 for w in widths), widths
    alone = [eng.generate([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    assert outs == alone
    assert runner_mod.table_width(1) == 16 and runner_mod.table_width(16) == 16 and runner_mod.table_width(17) == 32
    assert runner_mod.table_width(5, 1) == 5


# ---------------------------------------------------------------------------- audit: late or unclear refusals


def _tiny_engine(**kw) -> Engine:
    return Engine(_TINY, device="cpu", backend="torch", **{"num_blocks": 16, **kw})


def _no_step(eng):
    def fail(*a, **k):
        raise AssertionError("a step ran before the arguments were checked")

    eng.runner.run = fail


def test_sampling_extremes_never_reach_multinomial():
    """Values that pass the range checks in float64 but not as the float32 the sampler holds them in:
    top_p=1e-300 became 0 and dropped every token, repetition_penalty=1e-40 pushed penalised logits to
    inf (inf - inf = NaN), top_k=2**70 overflowed int64. All three failed mid-generation (torch.multinomial's
    RuntimeError, a device-side assert on a GPU, or 'Overflow when unpacking long long')."""
    eng = _tiny_engine()
    p = [[1, 2, 3]]
    greedy = eng.generate(p, max_new_tokens=4, ignore_eos=True)
    # the most likely token always survives the nucleus cut
    assert eng.generate(p, max_new_tokens=4, temperature=1.0, top_p=1e-300, seed=1, ignore_eos=True) == greedy
    # top_k past the vocabulary keeps every token: the same draws as no cut
    want = eng.generate(p, max_new_tokens=4, temperature=1.0, top_k=0, seed=1, ignore_eos=True)
    assert eng.generate(p, max_new_tokens=4, temperature=1.0, top_k=2**70, seed=1, ignore_eos=True) == want
    rid = eng.add_request([1, 2, 3], 2, temperature=1.0, top_k=2**70, seed=1)
    while eng.has_unfinished_requests():
        eng.step()
    out = eng.generate([[1, 2, 3]], max_new_tokens=4, temperature=1.0, repetition_penalty=1e-40, seed=1)
    assert all(0 <= t < _TINY["vocab_size"] for t in out[0]), out
    assert rid is not None and eng.cache.num_free_blocks == eng.cache.num_blocks


def test_repetition_penalty_that_is_zero_in_float32_is_refused_before_a_step():
    eng = _tiny_engine()
    _no_step(eng)
    for call in (lambda: eng.generate([[1, 2]], max_new_tokens=2, repetition_penalty=1e-300),
                 lambda: eng.add_request([1, 2], 2, temperature=1.0, repetition_penalty=1e-50)):
        with pytest.raises(ValueError, match="repetition_penalty"):
            call()
    assert not eng.has_unfinished_requests()
    # the edge: at or below half float32's smallest subnormal rounds to 0.0; just above it does not
    from minipaged.engine.sampler import make_sampling_params
    edge = 2.0**-150
    with pytest.raises(ValueError, match="repetition_penalty"):
        make_sampling_params(repetition_penalty=edge)
    for ok in (math.nextafter(edge, 1.0), 2.0**-149):
        p = make_sampling_params(repetition_penalty=ok)
        assert float(torch.tensor(p.repetition_penalty, dtype=torch.float32)) > 0


def test_engine_seed_is_checked_and_numpy_sizes_are_ints(monkeypatch):
    """Engine(seed=2**64) failed in torch ('Overflow when unpacking long long', no argument named) after
    the argument checks; seed=np.int64 passed them and then failed in manual_seed; np.int64 sizes were
    refused as 'must be a positive int, got np.int64(8)'."""
    import numpy as np

    real = engine_mod.random_state_dict

    def no_weights(*a, **k):
        raise AssertionError("weights were built before the seed was checked")

    monkeypatch.setattr(engine_mod, "random_state_dict", no_weights)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            _tiny_engine(seed=seed)
    monkeypatch.setattr(engine_mod, "random_state_dict", real)
    want = _tiny_engine(seed=3, num_blocks=8, block_size=4, max_num_seqs=2, max_model_len=64,
                        max_num_batched_tokens=16).generate([[1, 2, 3]], max_new_tokens=3)
    eng = _tiny_engine(seed=np.int64(3), num_blocks=np.int64(8), block_size=np.int64(4), max_num_seqs=np.int32(2),
                       max_model_len=np.int64(64), max_num_batched_tokens=np.int64(16),
                       gpu_memory_fraction=np.float32(0.5))
    assert eng.generate([[1, 2, 3]], max_new_tokens=3) == want
    assert type(eng.cache.block_size) is int and type(eng.max_num_seqs) is int


@pytest.mark.parametrize("call, exc, words", [
    (lambda e: e.add_request(5), TypeError, "prompt"),               # was: 'int' object is not iterable
    (lambda e: e.add_request(None), TypeError, "prompt"),
    (lambda e: e.add_request(torch.tensor(3)), TypeError, "prompt"),  # was: iteration over a 0-d tensor
    (lambda e: e.generate([torch.tensor(5)]), TypeError, "prompt 0"),
    (lambda e: e.generate([[1]], stop_token_ids=torch.tensor(5)), TypeError, "stop_token_ids"),
    (lambda e: e.generate([[1]], max_new_tokens=torch.tensor(2)), ValueError, "max_new_tokens"),
    (lambda e: e.prefill_logits(5), TypeError, "prompts"),
])
def test_prompt_arguments_that_are_not_sequences_name_the_argument(call, exc, words):
    eng = _tiny_engine()
    _no_step(eng)
    with pytest.raises(exc, match=words):
        call(eng)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_prompt_that_never_fits_is_refused_with_max_new_tokens_0():
    """A prompt over max_model_len or the cache was accepted alone with max_new_tokens=0 (returning [[]])
    and refused when another prompt of the call asked for a token."""
    eng = _tiny_engine(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="max_model_len=128"):
        eng.generate([[1] * 129], max_new_tokens=0)
    with pytest.raises(ValueError, match="blocks"):
        eng.generate([[1] * 20], max_new_tokens=0)
    assert eng.generate([[1] * 8], max_new_tokens=0) == [[]]


def test_prefill_logits_checks_its_prompts():
    """A prompt past max_model_len indexed past the RoPE tables (IndexError on the CPU, a device-side assert on
    a GPU); an empty list failed in max()."""
    eng = _tiny_engine(num_blocks=32)
    with pytest.raises(ValueError, match="max_model_len=128"):
        eng.prefill_logits([[1] * 129])
    assert eng.prefill_logits([]) == []
    assert eng.cache.num_free_blocks == eng.cache.num_blocks
    assert eng.prefill_logits([[1, 2]])[0].shape == (2, _TINY["vocab_size"])


def _saved(folder, state=None, config=None):
    from minipaged.engine.loader import random_state_dict, save_checkpoint

    cfg = Qwen3Config.from_dict(config or _TINY)
    save_checkpoint(str(folder), cfg, random_state_dict(cfg, seed=0) if state is None else state)
    return str(folder)


@pytest.mark.parametrize("text", ['{"eos_token_id": {"a": 1}}', '{"eos_token_id": [null]}', '{"eos_token_id": "x"}'])
def test_malformed_generation_config_is_a_value_error_naming_it(tmp_path, text):
    # was: TypeError / int()'s bare ValueError, a traceback in `minipaged generate`
    folder = _saved(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        Engine(folder, device="cpu", backend="torch", num_blocks=4)
    (tmp_path / "m" / "generation_config.json").write_text("[1, 2]")  # not an object: no EOS from it
    assert Engine(folder, device="cpu", backend="torch", num_blocks=4).eos_token_ids == []


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.int32])
def test_quantized_weights_are_refused(tmp_path, dtype):
    """An FP8 / int8 checkpoint's weights were cast to the model dtype without their scales: garbage
    tokens and no error."""
    from minipaged.engine.loader import random_state_dict

    cfg = Qwen3Config.from_dict(_TINY)
    state = {k: (v.to(dtype) if k.endswith("proj.weight") else v) for k, v in random_state_dict(cfg).items()}
    with pytest.raises(ValueError, match="q_proj.weight is .*quantized weights are not supported"):
        _tiny_engine(state_dict=state)
    folder = _saved(tmp_path / "m", state)
    with pytest.raises(ValueError, match="quantized weights are not supported"):
        Engine(folder, device="cpu", backend="torch", num_blocks=4)


def test_state_dict_value_that_is_not_a_tensor_is_a_type_error():
    from minipaged.engine.loader import random_state_dict

    state = random_state_dict(Qwen3Config.from_dict(_TINY))
    state["model.norm.weight"] = [1.0] * 32
    with pytest.raises(TypeError, match="model.norm.weight"):  # was: AttributeError on .shape
        _tiny_engine(state_dict=state)
    with pytest.raises(TypeError, match="state_dict"):  # was: random weights, silently
        Engine.from_state_dict(_TINY, None, device="cpu", backend="torch", num_blocks=4)


def test_checkpoint_folder_kv_scales_are_read(tmp_path):
    """The loader kept only the weights' names, so a checkpoint folder's self_attn.k_scale / v_scale
    never reached the engine: kv_cache_dtype='fp8' calibrated instead (and batch_invariant with fp8
    refused a checkpoint that had them)."""
    from minipaged.engine.loader import random_state_dict

    cfg = Qwen3Config.from_dict(_TINY)
    state = random_state_dict(cfg, dtype=torch.bfloat16)
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    folder = _saved(tmp_path / "m", state)
    eng = Engine(folder, dtype=torch.bfloat16, device="cpu", backend="torch", num_blocks=8, kv_cache_dtype="fp8")
    assert not eng._calibrate_kv
    assert eng.cache.k_scales.tolist() == [[0.25]] and eng.cache.v_scales.tolist() == [[0.5]]


def test_batch_invariant_fp8_with_random_weights_is_refused_before_drawing_them(monkeypatch):
    import minipaged as mp

    if not mp.available_backends()["triton"][0]:
        pytest.skip("needs the triton backend (TRITON_INTERPRET=1 on CPU)")

    def no_weights(*a, **k):
        raise AssertionError("random weights were drawn before batch_invariant + fp8 was refused")

    monkeypatch.setattr(engine_mod, "random_state_dict", no_weights)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        Engine(_TINY, device="cpu", dtype=torch.float16, kv_cache_dtype="fp8", batch_invariant=True, num_blocks=8)


def test_model_path_that_is_a_file_says_so(tmp_path):
    folder = _folder(tmp_path / "m", _TINY)
    with pytest.raises(NotADirectoryError, match="is a file"):  # was: "model folder ... does not exist"
        Engine(folder + "/config.json", device="cpu", backend="torch", num_blocks=4)
