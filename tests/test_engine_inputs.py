"""Engine and `minipaged generate` inputs: a malformed config.json is a usage error naming
the field, arguments are checked before weights are built, and warmup() runs on every
engine that generate() can run on."""

from __future__ import annotations

import json

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
