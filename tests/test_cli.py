"""The `cabinlm` command line, run as a user runs it (a subprocess), including bad input:
every error is one line that says what to do, with a non-zero exit and no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REQUIRED_TURN_KEYS = {
    "turn", "reply", "prompt_tokens", "new_tokens", "cache_tokens", "cache_bytes", "evicted_tokens", "decode_tok_s",
    "rss_mb",
}


def cabinlm(*args: str, stdin: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cabinlm", *map(str, args)], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, p.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def cli_artifact(tiny_qwen2_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "art"
    p = cabinlm("export", tiny_qwen2_dir, "-o", out, "--sink", 4, "--pinned", 28, "--window", 60, "--chunk", 16)
    assert p.returncode == 0, p.stderr
    assert "exported" in p.stdout and (out / "manifest.json").exists()
    return out


def test_export_then_chat_json_one_object_per_turn(cli_artifact):
    p = cabinlm("chat", cli_artifact, "--json", "--max-new-tokens", 6, stdin="hello there\n\ncheck the route\n")
    assert p.returncode == 0, p.stderr
    turns = [json.loads(line) for line in p.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    for t in turns:
        assert REQUIRED_TURN_KEYS <= set(t)
        assert 0 <= t["new_tokens"] <= 6 and t["cache_tokens"] <= 4 + 28 + 60


def test_chat_text_mode_prints_each_turn(cli_artifact):
    p = cabinlm("chat", cli_artifact, "--max-new-tokens", 4, stdin="hello\nthe route\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("user: ") == 2 and p.stdout.count("assistant: ") == 2


def test_chat_reports_a_too_long_message_and_goes_on(cli_artifact):
    p = cabinlm("chat", cli_artifact, "--json", "--max-new-tokens", 3, stdin="the route " * 80 + "\nhello\n")
    assert_clean_error(p, "window holds 60")
    assert [json.loads(line)["turn"] for line in p.stdout.splitlines()] == [1]


def test_perplexity_json_and_nll_file(cli_artifact, tmp_path, long_text):
    text = tmp_path / "t.txt"
    text.write_text(long_text)
    nll = tmp_path / "nll.npy"
    p = cabinlm("perplexity", cli_artifact, "--text", text, "--max-tokens", 150, "--json", "--nll-out", nll)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    arr = np.load(nll)
    assert r["tokens"] == 150 and arr.shape == (149,) and arr.dtype == np.float64
    assert abs(r["ppl"] - float(np.exp(arr.mean()))) < 1e-6 * r["ppl"]


def test_missing_artifact_folder(tmp_path):
    assert_clean_error(cabinlm("chat", tmp_path / "nope"), "no such folder")


def test_a_folder_that_is_not_an_artifact(tmp_path):
    assert_clean_error(cabinlm("chat", tmp_path), "not a cabinlm artifact")


def corrupt_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def test_a_corrupt_manifest(cli_artifact, tmp_path):
    bad = corrupt_copy(cli_artifact, tmp_path / "a", lambda d: (d / "manifest.json").write_text("{ not json"))
    assert_clean_error(cabinlm("chat", bad), "corrupt manifest")


def test_a_manifest_of_an_unknown_version(cli_artifact, tmp_path):
    def edit(d):
        m = json.loads((d / "manifest.json").read_text())
        m["format_version"] = 99
        (d / "manifest.json").write_text(json.dumps(m))

    assert_clean_error(cabinlm("chat", corrupt_copy(cli_artifact, tmp_path / "a", edit)), "format_version 99")


def test_a_manifest_that_does_not_match_its_files(cli_artifact, tmp_path):
    def truncate(d):
        data = d / "decoder.onnx.data"
        data.write_bytes(data.read_bytes()[:1000])

    assert_clean_error(cabinlm("chat", corrupt_copy(cli_artifact, tmp_path / "a", truncate)), "do not belong")

    def edit_layout(d):
        m = json.loads((d / "manifest.json").read_text())
        m["cache"]["window"] = 100
        (d / "manifest.json").write_text(json.dumps(m))

    assert_clean_error(cabinlm("chat", corrupt_copy(cli_artifact, tmp_path / "b", edit_layout)), "does not match")


def test_export_refuses_a_missing_model(tmp_path):
    assert_clean_error(cabinlm("export", tmp_path / "nope", "-o", tmp_path / "o"), "no such file or folder")


def test_export_refuses_a_head_width_without_quantized_weights(tiny_llama_dir, tmp_path):
    assert_clean_error(cabinlm("export", tiny_llama_dir, "--head", "int4", "-o", tmp_path / "o"), "--weights int8 or int4")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--sink", "-1"], ["--sink", "-1"]),
        (["--window", "64", "--chunk", "128"], ["--chunk 128", "--window 64"]),
        (["--max-ppl-increase", "-5"], ["--max-ppl-increase", "-5"]),
        (["--kv", "int8", "--calib", "missing-calibration.txt"], ["--calib missing-calibration.txt", "no such file"]),
        (["--profile", "cpu", "--pinned", "-3"], ["--pinned", "-3"]),
    ],
    ids=["sink", "chunk-over-window", "max-ppl-increase", "calib", "profile-pinned"],
)
def test_export_refuses_a_bad_option_value_before_looking_at_the_model(tmp_path, args, needles):
    # The model does not exist: an option checked after the model is looked up (or loaded) would
    # fail with "no such file or folder" instead.
    p = cabinlm("export", tmp_path / "no-model", "-o", tmp_path / "o", *args)
    assert_clean_error(p, *needles)
    assert p.returncode == 2 and not (tmp_path / "o").exists()


def test_export_offers_only_the_weight_formats_a_graph_holds(tmp_path):
    # fp16 is a profile's build-time weight precision, not an export choice
    p = cabinlm("export", tmp_path / "no-model", "-o", tmp_path / "o", "--weights", "fp16")
    assert p.returncode == 2 and "'fp16' is not one of 'fp32', 'int8', 'int4'" in p.stderr
    p = cabinlm("export", tmp_path / "no-model", "-o", tmp_path / "o", "--head", "fp32")
    assert p.returncode == 2 and "'fp32' is not one of 'int8', 'int4'" in p.stderr


def test_plan_reads_a_config_json_without_torch():
    config = Path(__file__).parent / "data" / "configs" / "smollm2-135m.json"
    code = (
        "import sys; sys.modules.update(torch=None, transformers=None)\n"
        f"sys.argv = ['cabinlm', 'plan', {str(config)!r}, '--profile', 'orin-x', '--json']\n"
        "from cabinlm.cli import main; main()"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["profile"] == "orin-x" and plan["kv"] == "fp16" and plan["fits"]


def test_export_refuses_a_folder_without_config(tmp_path):
    assert_clean_error(cabinlm("export", tmp_path, "-o", tmp_path / "o"), "no config.json")


def test_export_refuses_an_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    assert_clean_error(
        cabinlm("export", tmp_path / "gpt2", "-o", tmp_path / "o"), "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2"
    )


def test_export_refuses_a_window_beyond_the_model_positions(tiny_llama_dir, tmp_path):
    # the tiny model has 512 positions: 4 + 124 + 1020 + 64 does not fit
    p = cabinlm("export", tiny_llama_dir, "-o", tmp_path / "o", "--window", 1020)
    assert_clean_error(p, "only 512", "--window 320")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_perplexity_refuses_a_missing_text(cli_artifact, tmp_path):
    assert_clean_error(cabinlm("perplexity", cli_artifact, "--text", tmp_path / "none.txt"), "no such file")


def test_help_teaches_the_three_steps():
    p = cabinlm("--help")
    assert p.returncode == 0
    for word in ("export", "chat", "perplexity"):
        assert word in p.stdout
