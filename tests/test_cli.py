"""The `cabinlm` command line, run as a user runs it (a subprocess), including bad input:
every error is one line that says what to do, with a non-zero exit and no traceback."""

from __future__ import annotations

import json
import os
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


# Options checked before the model loads. The artifact does not exist: an option checked after the
# artifact is opened (or the model loaded) would fail with "no such folder" instead.
@pytest.mark.parametrize(
    "command, args, needles",
    [
        ("chat", ["--max-new-tokens", "0"], ["--max-new-tokens", "0"]),
        ("chat", ["--temperature", "nan"], ["--temperature", "nan"]),
        ("chat", ["--temperature", "inf"], ["--temperature", "inf"]),
        ("chat", ["--temperature", "-0.5"], ["--temperature", "-0.5"]),
        ("chat", ["--top-p", "0"], ["--top-p", "0"]),
        ("chat", ["--top-p", "1.5"], ["--top-p", "1.5"]),
        ("chat", ["--threads", "0"], ["--threads", "0"]),
        ("chat", ["--threads", "100000"], ["--threads 100000", "core"]),
        ("chat", ["--seats", "0"], ["--seats", "0"]),
        ("chat", ["--seats", "1" + "0" * 40], ["--seats", "at most 64"]),
        ("chat", ["--seed", "-1"], ["--seed", "-1"]),
        ("perplexity", ["--text", "{tmp}/t.txt", "--nll-out", "{tmp}/missing/nll.npy"], ["--nll-out", "does not exist"]),
        ("perplexity", ["--text", "{tmp}/t.txt", "--nll-out", "{tmp}"], ["--nll-out", "is a folder"]),
        ("perplexity", ["--text", "{tmp}/t.txt", "--max-tokens", "1"], ["--max-tokens", "1"]),
        ("perplexity", ["--text", "{tmp}/t.txt", "--threads", "-2"], ["--threads", "-2"]),
        ("build", ["--accuracy-level", "7"], ["--accuracy-level", "0..4", "7"]),
        ("build", ["--accuracy-level", "-1"], ["--accuracy-level", "-1"]),
        ("bench", ["--tokens", "0"], ["--tokens", "0"]),
        ("bench", ["--threads", "100000"], ["--threads 100000", "core"]),
        ("bench", ["--max-new", "0"], ["--max-new", "0"]),
        ("bench", ["--time-limit", "nan"], ["--time-limit", "nan"]),
        ("bench", ["--plot", "{tmp}/missing/p.png"], ["--plot", "does not exist"]),
    ],
)
def test_a_bad_option_is_refused_before_the_model_loads(tmp_path, command, args, needles):
    p = cabinlm(command, tmp_path / "no-artifact", *(a.format(tmp=tmp_path) for a in args))
    assert_clean_error(p, *needles)
    assert p.returncode == 2 and "no such folder" not in p.stderr
    assert not (tmp_path / "no-artifact").exists()  # build wrote nothing


def flip_a_weight_byte(folder: Path) -> None:
    """The same size (the manifest still loads), another sha256: opening the model would fail."""
    data = folder / "decoder.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_chat_refuses_more_seats_than_the_memory_holds_before_loading(cli_artifact, tmp_path):
    """Seats are checked against the memory the OS reports, from the manifest alone: here a machine
    with room for the weights and one and a half seats, and an artifact whose weights would be
    refused if they were read (so the refusal comes before they are)."""
    broken = corrupt_copy(cli_artifact, tmp_path / "a", flip_a_weight_byte)
    code = (
        "import sys\n"
        "import cabinlm.runtime.limits as limits\n"
        "from cabinlm.contract.manifest import load_manifest\n"
        f"m = load_manifest({str(broken)!r})\n"
        "room = sum(f.bytes for f in m.files.values()) + limits.seat_bytes(m) * 3 // 2\n"
        "limits.available_bytes = lambda: room\n"
        f"sys.argv = ['cabinlm', 'chat', {str(broken)!r}, '--seats', sys.argv[1]]\n"
        "from cabinlm.cli import main; main()"
    )
    p = subprocess.run([sys.executable, "-c", code, "2"], capture_output=True, text=True, timeout=300, input="")
    assert_clean_error(p, "--seats 2", "1 seat fit", "MiB")
    p = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=300, input="")
    assert_clean_error(p, "fails its sha256 check")  # one seat fits: the model is opened, its flipped byte found


TURN_KEYS = ("seat", "turn", "reply", "prompt_tokens", "new_tokens", "cache_tokens", "evicted_tokens", "finish")


def test_the_seat_limit_is_what_memory_leaves_after_the_weights(cli_artifact):
    from cabinlm.contract.errors import OptionError
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.runtime.limits import MAX_SEATS, check_seats, seat_bytes, seat_limit

    m = load_manifest(cli_artifact)
    weights, per_seat = sum(f.bytes for f in m.files.values()), seat_bytes(m)
    assert per_seat >= 2 * m.cache.cache_bytes
    for k in (1, 2, 5):
        assert seat_limit(m, weights + k * per_seat + per_seat - 1).seats == k
        check_seats(k, m, weights + k * per_seat)
        with pytest.raises(OptionError, match=f"--seats {k + 1}: .* so {k} seat"):
            check_seats(k + 1, m, weights + k * per_seat)
    assert seat_limit(m, weights // 2).seats == 1  # whether the model itself fits, loading it finds out
    assert seat_limit(m, 1 << 50).seats == MAX_SEATS


def turns_of(p: subprocess.CompletedProcess) -> list[dict]:
    """What each turn said and did, without its timings."""
    return [{k: t[k] for k in TURN_KEYS if k in t} for t in map(json.loads, p.stdout.splitlines())]


@pytest.mark.parametrize("where", ["missing-folder", "file-as-folder", "proc", "read-only-folder"])
def test_a_session_that_cannot_be_saved_loses_no_reply_and_the_input_goes_on(cli_artifact, tmp_path, where):
    if where == "missing-folder":
        session = tmp_path / "nope" / "s"
    elif where == "file-as-folder":  # fails for root too: a regular file cannot hold a file
        (tmp_path / "f").write_text("not a folder")
        session = tmp_path / "f" / "s"
    elif where == "proc":  # a folder nobody, root included, can create files in
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc here")
        session = Path("/proc") / f"cabinlm-test-{os.getpid()}"
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable (file-as-folder fails for root)")
        session = folder / "s"
    lines = "hello there\ncheck the route\nthanks\n"
    expected = cabinlm("chat", cli_artifact, "--json", "--max-new-tokens", 4, stdin=lines)
    p = subprocess.run([sys.executable, "-m", "cabinlm", "chat", str(cli_artifact), "--json", "--max-new-tokens", "4",
                        "--session", str(session)], input=lines, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300)  # fmt: skip
    out = p.stdout.splitlines()
    assert p.returncode == 1 and "Traceback" not in p.stdout, p.stdout
    # Each turn: its save's one error line, then its JSON line all the same; every input line answered.
    assert [line.startswith("error: the session was not saved") for line in out] == [True, False] * 3, out
    replies = [json.loads(line)["reply"] for line in out[1::2]]
    assert replies == [json.loads(line)["reply"] for line in expected.stdout.splitlines()]
    assert not session.exists()


def test_a_failed_save_in_text_mode_prints_the_reply_first(cli_artifact, tmp_path):
    p = subprocess.run([sys.executable, "-m", "cabinlm", "chat", str(cli_artifact), "--max-new-tokens", "3",
                        "--session", str(tmp_path / "nope" / "s")], input="hello\nthe route\n",
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)  # fmt: skip
    out = p.stdout.splitlines()
    assert p.returncode == 1 and "Traceback" not in p.stdout, p.stdout
    assert [line.split(":")[0] for line in out] == ["user", "assistant", "error"] * 2, out


def test_chat_answers_every_seat_around_hostile_lines(cli_artifact):
    """Hostile lines among good ones, to a real chat process with two seats: each bad line is one
    error line; the good lines get exactly the turns (replies, prompt and cache tokens) that a run
    of the good lines alone gets, so nothing of a refused line reached any seat's dialogue."""
    good = ["hello", "@2 route please", '{"seat": 2, "text": "weather"}', "thanks"]
    bad = [
        '{"text": "\\ud800 hi", "seat": 2}',  # a lone surrogate, as a JSON escape
        "@" + "9" * 5000 + " hi",  # a seat of 5000 digits
        '{"text": ' + "[" * 5000 + "]" * 5000 + "}",  # nested 5000 deep (RecursionError)
        '{"seat": ' + "1" * 5000 + ', "text": "x"}',  # a number int() refuses to read
        "@3 nobody",  # a seat that does not exist (once: delivered to seat 1)
        '{"seat": 2, "text": "weather"',  # cut short (once: delivered to seat 1 as text)
        '{"text": "x", "seet": 2}',  # a misspelt key (once: delivered to seat 1)
        '{"a": ' * 100_000 + "1" + "}" * 100_000,  # the message itself nested 100000 deep
    ]
    hostile = [good[0], bad[0], good[1], bad[1], bad[2], good[2], bad[3], bad[4], bad[5], good[3], bad[6], bad[7]]
    args = ("chat", cli_artifact, "--json", "--seats", 2, "--max-new-tokens", 3)
    p = cabinlm(*args, stdin="\n".join(hostile) + "\n")
    clean = cabinlm(*args, stdin="\n".join(good) + "\n")
    assert clean.returncode == 0, clean.stderr
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == len(bad) == len(p.stderr.splitlines()), p.stderr
    assert all(len(e) < 300 for e in errors)
    assert [(t["seat"], t["turn"]) for t in turns_of(p)] == [(1, 1), (2, 1), (2, 2), (1, 2)]
    assert turns_of(p) == turns_of(clean)

