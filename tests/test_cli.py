"""The command line as a user meets it: bad flags and bad MINIPAGED_* variables
give one `error: ...` line on stderr and exit 2 before any work (no traceback,
no silent fallback to a default), and `check` never claims agreement it did
not measure. Issue #11."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipaged import cli

REPO = Path(__file__).resolve().parents[1]
CPU_ONLY = not torch.cuda.is_available()


def _assert_usage_error(rc, err, *words):
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2, (rc, err)
    assert len(error_lines) == 1, err
    assert "Traceback" not in err, err
    for w in words:
        assert w in error_lines[0], (w, error_lines[0])


@pytest.fixture
def no_work(monkeypatch):
    """Make building the engine or timing a case fail the test: validation must come first."""
    from minipaged.benchmark import runner
    from minipaged.engine import engine

    class NotBuilt:
        def __init__(self, *a, **k):
            raise AssertionError("the Engine was built before the arguments were checked")

    def not_run(*a, **k):
        raise AssertionError("the benchmark ran before the arguments were checked")

    monkeypatch.setattr(engine, "Engine", NotBuilt)
    monkeypatch.setattr(runner, "_run", not_run)
    # `bench` and `check` switch the Triton interpreter on in os.environ on CPU: undo it afterwards
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    for var in ("MINIPAGED_BACKEND", "MINIPAGED_PREFILL_BACKEND", "MINIPAGED_DECODE_BACKEND"):
        monkeypatch.delenv(var, raising=False)


def _main(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, words", [
    (["--block-size", "0"], ["--block-size", "0"]),
    (["--block-size", "3"], ["--block-size", "power of two"]),
    (["--block-size", "512"], ["--block-size", "512"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs", "0"]),  # was: silently the default
    (["--num-blocks", "0"], ["--num-blocks"]),
    (["--batch", "0"], ["--batch"]),
    (["--temperature", "-1"], ["--temperature", "-1"]),
    (["--temperature", "nan"], ["--temperature", "nan"]),
    (["--temperature", "inf"], ["--temperature"]),
    (["--top-p", "2"], ["--top-p", "2"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--top-p", "nan"], ["--top-p"]),
    (["--top-k", "-1"], ["--top-k", "-1"]),
    (["--presence-penalty", "3"], ["--presence-penalty", "3"]),
    (["--frequency-penalty", "nan"], ["--frequency-penalty"]),
    (["--repetition-penalty", "0"], ["--repetition-penalty"]),
    (["--device", "foo"], ["--device", "foo"]),
    (["--device", "cuda:99"], ["--device"]),
    (["--backend", "nope"], ["--backend", "nope", "valid names"]),
    (["--prompt", "hi"], ["--prompt", "--model"]),
    (["--chat"], ["--chat", "--prompt"]),
    (["--no-thinking"], ["--no-thinking", "--chat"]),
    (["--stream"], ["--stream", "--prompt", "--batch 1"]),
    (["--model", "/nonexistent/qwen3"], ["--model", "/nonexistent/qwen3"]),
    # past int32 / int64: refused here, not by an allocation or an overflow inside the run
    (["--num-blocks", str(2**62)], ["--num-blocks", "2147483647"]),
    (["--max-new-tokens", "1" + "0" * 400], ["--max-new-tokens", "401-digit"]),
    (["--seed", str(2**64)], ["--seed"]),
    (["--device", "cpu:1"], ["--device", "cpu:1"]),
    # the random 0.6B model's length limit (4096), and a cache too small for one prompt
    (["--prompt-len", "5000"], ["--prompt-len", "5000", "max_model_len=4096"]),
    (["--prompt-len", str(2**31 - 1)], ["--prompt-len", "max_model_len"]),
    (["--prompt-len", "100", "--num-blocks", "2"], ["--num-blocks 2", "11 blocks of 16"]),
])
def test_generate_rejects_bad_flags_before_building_the_model(argv, words, capsys, no_work):
    rc, _, err = _main(["generate", *argv], capsys)
    _assert_usage_error(rc, err, *words)


@pytest.mark.skipif(not CPU_ONLY, reason="needs a machine without a usable GPU")
def test_generate_cuda_device_on_a_cpu_machine(capsys, no_work):
    rc, _, err = _main(["generate", "--device", "cuda"], capsys)
    _assert_usage_error(rc, err, "--device", "cuda")


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: the interpreter's bf16 is what is refused")
def test_generate_triton_bf16_on_cpu_is_refused(capsys, no_work, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, _, err = _main(["generate", "--backend", "triton", "--dtype", "bfloat16"], capsys)
    _assert_usage_error(rc, err, "bfloat16", "interpreter")


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: triton needs the interpreter there")
def test_generate_triton_without_the_interpreter(capsys, no_work, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, _, err = _main(["generate", "--backend", "triton"], capsys)
    _assert_usage_error(rc, err, "triton", "TRITON_INTERPRET=1")


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: cuda is unavailable there")
def test_generate_env_backend_that_cannot_run(capsys, no_work, monkeypatch):
    monkeypatch.setenv("MINIPAGED_BACKEND", "cuda")
    rc, _, err = _main(["generate"], capsys)
    _assert_usage_error(rc, err, "MINIPAGED_BACKEND", "cuda")


@pytest.mark.parametrize("argv, words", [
    (["--reps", "0"], ["--reps", "0"]),    # was: 0 became the default of 5
    (["--reps", "-1"], ["--reps", "-1"]),  # was: an ERROR row per case and exit 0
    (["--max-time", "nan"], ["--max-time"]),
    (["--time-budget", "-1"], ["--time-budget"]),
    (["--backends", "nope"], ["--backends", "nope"]),
    (["--anchors", "nope"], ["--anchors", "nope"]),
    (["--op", "decode", "--anchors", "sdpa-efficient"], ["--anchors", "sdpa-efficient"]),
    # was: nothing timed, "(no rows)", empty results written, exit 0
    (["--backends", "none", "--anchors", "none"], ["--backends", "--anchors", "nothing to time"]),
    (["--backends", ",", "--anchors", ""], ["--backends", "--anchors", "nothing to time"]),
])
def test_bench_rejects_bad_flags_before_timing(argv, words, capsys, no_work, tmp_path):
    rc, _, err = _main(["bench", "--out", str(tmp_path), *argv], capsys)
    _assert_usage_error(rc, err, *words)


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: these backends / anchors do not exist there")
@pytest.mark.parametrize("argv, words", [
    (["--backends", "cuda"], ["--backends", "cuda", "unavailable"]),  # was: timed only anchors, exit 0
    (["--backends", "torch,cuda-wmma"], ["cuda-wmma"]),
    (["--backends", "triton", "--dtype", "bfloat16"], ["triton", "bf16"]),
    (["--anchors", "copy"], ["copy", "GPU only"]),
    (["--anchors", "sdpa-flash"], ["sdpa-flash", "sdpa-cpu"]),
])
def test_bench_rejects_what_cannot_run_on_cpu(argv, words, capsys, no_work, tmp_path):
    rc, _, err = _main(["bench", "--out", str(tmp_path), *argv], capsys)
    _assert_usage_error(rc, err, *words)


def test_bench_default_output_is_outside_the_tracked_tree():
    from minipaged.benchmark import runner

    out = runner.default_out_dir(torch.device("cpu"), True)
    assert out.parts[0] == runner.DEFAULT_OUT_ROOT and "bench" not in out.parts[:1]
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert f"/{runner.DEFAULT_OUT_ROOT}/" in ignored or f"{runner.DEFAULT_OUT_ROOT}/" in ignored


def test_bench_reps_reach_the_timer(tmp_path, monkeypatch):
    """--reps 1 is honoured as 1, not replaced by the default (the old `reps or 5`)."""
    from minipaged.benchmark import runner

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    cfg = runner.BenchConfig(op="prefill", backends=["torch"], anchors=[], quick=True, out=str(tmp_path),
                             reps=1, max_time_s=0, crosscheck=False, plots=False, progress=False,
                             log=lambda s: None)
    result = runner.run_bench(cfg)
    assert [r["reps"] for r in result["rows"]] == [1] * len(result["rows"])


def test_info_with_an_unknown_env_backend(capsys, no_work, monkeypatch):
    monkeypatch.setenv("MINIPAGED_BACKEND", "bogus")
    rc, out, err = _main(["info"], capsys)
    _assert_usage_error(rc, err, "MINIPAGED_BACKEND", "bogus", "valid names")
    assert out == ""  # the error comes before the table, not after it


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: triton runs interpreted, and bf16 is refused there")
def test_check_bf16_on_cpu_says_what_it_skipped(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, _ = _main(["check", "--dtype", "bfloat16"], capsys)
    assert rc == 1, out  # nothing but the oracle ran: not a pass
    assert "agree" not in out
    assert "only torch ran; nothing to compare" in out
    skipped = [line for line in out.splitlines() if line.startswith("skipped: triton")]
    assert skipped and all("bf16" in line and "interpreter" in line.lower() for line in skipped), out
    assert "compared with the torch oracle: none" in out


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: the default check compares the interpreted Triton")
def test_check_names_the_backends_it_compared(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, _ = _main(["check"], capsys)
    assert rc == 0, out
    assert "compared with the torch oracle: triton (prefill, decode)" in out
    assert "triton agrees with the oracle on every case" in out
    assert "skipped: cuda: " in out and "all backends agree" not in out


@pytest.mark.parametrize("argv, words", [
    ([], ["command"]),
    (["bogus"], ["bogus"]),
    (["check", "--dtype", "float64"], ["--dtype", "float64"]),
    (["generate", "--batch", "abc"], ["--batch", "abc"]),
    (["bench", "--op", "nope"], ["--op", "nope"]),
    (["bench", "--reps", "1" + "0" * 400], ["--reps", "401-digit"]),
    (["bench", "--seed", "1" + "0" * 400], ["--seed"]),
    (["bench", "--page-size", "abc"], ["--page-size", "abc"]),
    (["bench", "--page-size", "1.5"], ["--page-size", "1.5"]),
])
def test_parser_errors_are_one_error_line(argv, words, capsys, no_work):
    # argparse's own errors (missing command, bad choice, not an int) used to print the usage
    # text and a "minipaged X: error:" line; huge ints overflowed inside the checks
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    _, err = capsys.readouterr()
    _assert_usage_error(rc, err, *words)
    assert "usage:" not in err


# The same contract through a fresh interpreter, as a user's shell runs it: the
# console script's exit status and stderr, with nothing set up by conftest.
@pytest.mark.parametrize("argv, env, words", [
    (["info"], {"MINIPAGED_BACKEND": "bogus"}, ["MINIPAGED_BACKEND"]),
    (["generate", "--backend", "triton"], {}, ["triton"]),
    (["generate"], {"MINIPAGED_BACKEND": "cuda"}, ["cuda"]),
    (["bench", "--out", "/proc/nope"], {}, ["--out", "/proc/nope"]),
    (["generate", "--block-size", "0"], {}, ["--block-size"]),
])
@pytest.mark.skipif(not CPU_ONLY, reason="CPU-only machine expected (cuda/triton unavailable)")
def test_cli_subprocess_usage_errors(argv, env, words, tmp_path):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("TRITON_INTERPRET", "MINIPAGED_BACKEND", "MINIPAGED_PREFILL_BACKEND",
                             "MINIPAGED_DECODE_BACKEND")}
    full_env.update(env, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO / "src") + os.pathsep
                    + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "minipaged.cli", *argv], capture_output=True, text=True,
                          env=full_env, timeout=120, cwd=str(tmp_path))
    _assert_usage_error(proc.returncode, proc.stderr, *words)
    assert not list(tmp_path.iterdir())  # nothing written into the caller's folder


_TINY_CONFIG = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": True}


def _tiny_folder(path, weights: bytes | None = None):
    import json

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(_TINY_CONFIG))
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    return str(path)


def test_generate_checks_a_folder_before_building_the_model(tmp_path, capsys, no_work):
    """A checkpoint folder without tokenizer files cannot serve --prompt (transformers may hand
    back an empty tokenizer instead of failing), and --prompt-len is held to its own limit."""
    folder = _tiny_folder(tmp_path / "m")
    rc, _, err = _main(["generate", "--model", folder, "--prompt", "hello", "--device", "cpu"], capsys)
    _assert_usage_error(rc, err, "--prompt", "tokenizer", folder)
    rc, _, err = _main(["generate", "--model", folder, "--prompt-len", "129", "--device", "cpu"], capsys)
    _assert_usage_error(rc, err, "--prompt-len 129", "max_model_len=128")


def test_generate_damaged_checkpoint_is_one_error_line(tmp_path, capsys):
    folder = _tiny_folder(tmp_path / "m", weights=b"\xff" * 100)
    rc, _, err = _main(["generate", "--model", folder, "--prompt-len", "4", "--max-new-tokens", "2",
                        "--batch", "1", "--device", "cpu", "--backend", "torch"], capsys)
    _assert_usage_error(rc, err, "model.safetensors", "cannot be read as safetensors")


def test_generate_folder_without_config_or_with_missing_weights(tmp_path, capsys):
    # one plain line each: no errno text for a missing config.json, no quotes from a KeyError
    from safetensors.torch import save_file

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    rc, _, err = _main(["generate", "--model", str(empty), "--device", "cpu"], capsys)
    _assert_usage_error(rc, err, "has no config.json", str(empty))
    assert "Errno" not in err
    folder = _tiny_folder(tmp_path / "m")
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "m" / "model.safetensors"))
    rc, _, err = _main(["generate", "--model", folder, "--prompt-len", "4", "--max-new-tokens", "2", "--batch", "1",
                        "--device", "cpu", "--backend", "torch"], capsys)
    _assert_usage_error(rc, err, "checkpoint lacks")
    assert err.startswith("error: checkpoint lacks"), err


# ---------------------------------------------------------------------------- audit: late or unclear refusals


def _tiny_checkpoint(path, state=None):
    from minipaged.engine import Qwen3Config
    from minipaged.engine.loader import random_state_dict, save_checkpoint

    cfg = Qwen3Config.from_dict(_TINY_CONFIG)
    save_checkpoint(str(path), cfg, random_state_dict(cfg, seed=0) if state is None else state)
    return str(path)


_RUN_TINY = ["--device", "cpu", "--backend", "torch", "--batch", "1", "--prompt-len", "3", "--max-new-tokens", "2"]


def test_generate_malformed_generation_config_is_one_error_line(tmp_path, capsys):
    # was: TypeError from int() on a dict, a traceback
    folder = _tiny_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text('{"eos_token_id": {"a": 1}}')
    rc, _, err = _main(["generate", "--model", folder, *_RUN_TINY], capsys)
    _assert_usage_error(rc, err, "generation_config.json", "eos_token_id")


def test_generate_quantized_checkpoint_is_one_error_line(tmp_path, capsys):
    # was: fp8 weights cast without their scales, garbage tokens and exit 0
    from minipaged.engine import Qwen3Config
    from minipaged.engine.loader import random_state_dict

    state = {k: (v.to(torch.float8_e4m3fn) if k.endswith("proj.weight") else v)
             for k, v in random_state_dict(Qwen3Config.from_dict(_TINY_CONFIG)).items()}
    folder = _tiny_checkpoint(tmp_path / "m", state)
    rc, _, err = _main(["generate", "--model", folder, *_RUN_TINY], capsys)
    _assert_usage_error(rc, err, "float8_e4m3fn", "quantized weights are not supported")


def test_generate_tiny_top_p_runs(tmp_path, capsys):
    # --top-p 1e-300 is in (0, 1] but 0.0 in float32: every token was dropped and torch.multinomial
    # raised mid-generation (a traceback; on a GPU a device-side assert)
    folder = _tiny_checkpoint(tmp_path / "m")
    rc, out, err = _main(["generate", "--model", folder, *_RUN_TINY, "--temperature", "1", "--top-p", "1e-300"],
                         capsys)
    assert rc == 0 and "Traceback" not in err, err
    assert "first output tokens" in out


def test_generate_model_that_is_a_file(tmp_path, capsys, no_work):
    folder = _tiny_folder(tmp_path / "m")
    rc, _, err = _main(["generate", "--model", folder + "/config.json", "--device", "cpu"], capsys)
    _assert_usage_error(rc, err, "--model", "config.json", "is a file")  # was: "no such folder"


def test_generate_empty_prompt_is_refused_before_the_model(tmp_path, capsys, no_work):
    folder = _tiny_folder(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    rc, _, err = _main(["generate", "--model", folder, "--prompt", "", "--device", "cpu"], capsys)
    _assert_usage_error(rc, err, "--prompt is empty")


def test_generate_tokenizer_that_cannot_be_loaded_says_why(tmp_path, capsys):
    # the files exist (validate checked): the error used to say the folder needs a tokenizer
    pytest.importorskip("transformers")
    folder = _tiny_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("{garbage")
    rc, _, err = _main(["generate", "--model", folder, "--prompt", "hi", *_RUN_TINY], capsys)
    _assert_usage_error(rc, err, "--prompt", "tokenizer", "cannot be loaded")


def test_generate_batch_invariant_fp8_without_a_checkpoint(capsys, no_work):
    # random weights have no K/V scales: the engine refused this only after drawing the 0.6B weights
    rc, _, err = _main(["generate", "--batch-invariant", "--kv-cache-dtype", "fp8", "--dtype", "float16",
                        "--device", "cpu"], capsys)
    _assert_usage_error(rc, err, "--batch-invariant", "--kv-cache-dtype fp8", "--model")


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: triton needs the interpreter there")
def test_generate_batch_invariant_errors_name_that_flag(capsys, no_work, monkeypatch):
    # they named "--backend triton", a flag the user had not given
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, _, err = _main(["generate", "--batch-invariant"], capsys)
    _assert_usage_error(rc, err, "--batch-invariant", "TRITON_INTERPRET=1")
    assert "--backend" not in err


def test_generate_model_without_safetensors_installed(tmp_path, capsys, no_work, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors"
                        else find_spec(name, *a))
    folder = _tiny_folder(tmp_path / "m")
    rc, _, err = _main(["generate", "--model", folder, "--device", "cpu", "--prompt-len", "4"], capsys)
    _assert_usage_error(rc, err, "--model", "safetensors")


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: the default check compares the interpreted Triton")
def test_check_heads_runs_the_cases_at_that_layout(capsys, monkeypatch):
    from minipaged.benchmark import runner

    seen = []
    real = runner.crosscheck

    def spy(*a, heads=None, **k):
        seen.append(heads)
        return real(*a, heads=heads, **k)

    monkeypatch.setattr(runner, "crosscheck", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, _ = _main(["check", "--heads", "8/2"], capsys)
    assert rc == 0, out
    assert seen == [dict(num_q_heads=8, num_kv_heads=2, head_dim=64)]
    assert "triton agrees with the oracle on every case" in out


@pytest.mark.skipif(not CPU_ONLY, reason="CPU: the default check compares the interpreted Triton")
def test_check_page_size_builds_decode_caches_of_that_size(capsys, monkeypatch):
    from minipaged.benchmark import runner, cases

    seen, sizes = [], set()
    real, real_cases = runner.crosscheck, cases.crosscheck_decode_cases

    def spy(*a, page_size=16, **k):
        seen.append(page_size)
        return real(*a, page_size=page_size, **k)

    def spy_cases(*a, **k):
        built = real_cases(*a, **k)
        sizes.update(c.block_size for c in built)
        return built

    monkeypatch.setattr(runner, "crosscheck", spy)
    monkeypatch.setattr(cases, "crosscheck_decode_cases", spy_cases)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc, out, _ = _main(["check", "--page-size", "4"], capsys)
    assert rc == 0, out
    assert seen == [4] and sizes == {4}
    assert "triton agrees with the oracle on every case" in out


@pytest.mark.parametrize("argv, words", [
    (["check", "--page-size", "0"], ["--page-size", "power of two", "got 0"]),
    (["check", "--page-size", "48"], ["--page-size", "power of two", "got 48"]),
    (["check", "--page-size", "512"], ["--page-size", "power of two", "got 512"]),
    (["check", "--heads", "8"], ["--heads", "HQ/HKV"]),
    (["check", "--heads", "12/8"], ["HQ=12", "not a multiple of HKV=8"]),
    (["check", "--heads", "8/2/96"], ["--heads 8/2/96", "torch", "D=96"]),
])
def test_check_bad_heads_is_one_error_line(argv, words, capsys, no_work):
    rc, out, err = _main(argv, capsys)
    _assert_usage_error(rc, err, *words)
    assert out == ""
