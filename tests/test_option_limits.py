"""Size options beyond what the model allows are one line, exit 2, before any weights load.

`cabinlm export` (with and without --profile) and `cabinlm plan` check --sink, --pinned, --window and
--chunk against the model's config.json (its max_position_embeddings) before torch or transformers
read a weight; `cabinlm chat` checks --system against the artifact's pinned slots with the tokenizer
alone; `cabinlm serve` checks --seats, --threads and --max-new-tokens with chat's functions
(runtime.limits) before it opens the artifact.

The commands run in this process, through cabinlm.cli.main as a user's shell runs it (its exit code,
its stderr), with the loaders replaced by functions that fail the test if called: a refusal that
came after the weights (or the artifact's graphs) were read cannot pass. The earlier tests in
test_cli.py pass a model that does not exist, which shows an option is checked before the model is
looked up, but cannot show that a check needing the model's config comes before its weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cabinlm.export
import cabinlm.export.models
import cabinlm.runtime.artifact
from cabinlm.contract.errors import InputError, OptionError
from cabinlm.runtime import Dialogue, Tokenizer, load_manifest, open_artifact
from cabinlm.runtime.limits import check_system_prompt

POSITIONS = 512  # the tiny models' max_position_embeddings (tests/conftest.py)
CONFIGS = Path(__file__).parent / "data" / "configs"
LEAST = {"sink": 0, "pinned": 0, "window": 1, "chunk": 1}


def run_cli(*args) -> tuple[int, str]:
    """`cabinlm ARGS` in this process: (exit code, stderr)."""
    from cabinlm.cli import main

    out, errs = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["cabinlm", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
            main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return code, errs.getvalue()


def one_error_line(code: int, stderr: str, *needles: str) -> str:
    """Exit 2 and a stderr of exactly one line, "error: ...", that holds every needle."""
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, stderr)
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _no_weights(*args, **kwargs):
    raise AssertionError("the weights were loaded before the options were checked")


@contextlib.contextmanager
def weights_never_load():
    """cabinlm.export's loader and the runtime's artifact loader fail the test if called."""
    saved = (cabinlm.export.load_model, cabinlm.export.models.load_model, cabinlm.runtime.artifact.open_artifact)
    cabinlm.export.load_model = cabinlm.export.models.load_model = cabinlm.runtime.artifact.open_artifact = _no_weights
    try:
        yield
    finally:
        cabinlm.export.load_model, cabinlm.export.models.load_model, cabinlm.runtime.artifact.open_artifact = saved


# -- export and plan: the cache geometry against the model's positions --------------------------------


def hostile(option: str):
    """Values no tiny model holds: below the option's least, or beyond its 512 positions (up to 10**40:
    Python's ints, past int64 and every C type a careless conversion would wrap into)."""
    return st.integers(max_value=LEAST[option] - 1) | st.integers(POSITIONS + 1, 10**40) | st.sampled_from(
        [2**31, 2**32, 2**63, 2**64, 10**30, -(2**63)]
    )


EXAMPLES = 180  # generated (option, value) pairs; each runs through export, export --profile cpu and plan


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_sizes_are_one_line_naming_the_option_before_the_weights_load(tiny_llama_dir, tmp_path_factory, data):
    """Each of export, export --profile cpu and plan: exit 2, one line naming the option, no
    weights read, no artifact folder created."""
    option = data.draw(st.sampled_from(sorted(LEAST)), label="option")
    value = data.draw(hostile(option), label="value")
    out = tmp_path_factory.getbasetemp() / "never-written"
    with weights_never_load():
        for command in (["export", tiny_llama_dir, "-o", out],
                        ["export", tiny_llama_dir, "-o", out, "--profile", "cpu"],
                        ["plan", tiny_llama_dir, "--profile", "cpu"]):  # fmt: skip
            code, stderr = run_cli(*command, f"--{option}", value)
            one_error_line(code, stderr, f"--{option}")
    assert not out.exists()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--window", "600"], ["--window 600", "only 512", "use --window 320 or less"]),
        (["--sink", "600"], ["--sink 600", "only 512", "give --sink 260 or less"]),
        (["--pinned", "500"], ["--pinned 500", "give --pinned 380 or less"]),
        (["--sink", "400", "--window", "64"], ["--sink 400", "give --sink 260 or less"]),
        (["--chunk", "200", "--window", "300"], ["--chunk 200", "give --chunk 84 or less"]),  # the window kept
        (["--chunk", "300", "--window", "400"], ["--chunk 300", "give --chunk 192 or less"]),  # a window of 1 chunk
        (["--sink", "250", "--pinned", "250", "--chunk", "250", "--window", "250"],
         ["lower --sink, --pinned and --chunk"]),
        (["--sink", str(10**30)], ["--sink 1" + "0" * 30, "at most 16777216"]),
        (["--window", str(2**64)], [f"--window {2**64}"]),
        (["--sink", "-1"], ["--sink must be >= 0, got -1"]),
    ],
    ids=["window", "sink", "pinned", "sink-with-window", "chunk-keeps-window", "chunk-least-window", "all-three",
         "huge-sink", "window-2**64", "negative"],  # fmt: skip
)
def test_a_geometry_the_model_cannot_hold_says_which_value_fits(tiny_llama_dir, tmp_path, args, needles):
    with weights_never_load():
        one_error_line(*run_cli("export", tiny_llama_dir, "-o", tmp_path / "o", *args), *needles)
        one_error_line(*run_cli("plan", tiny_llama_dir, *args), *needles)  # the cpu profile's sink 4, chunk 64
    assert not (tmp_path / "o").exists()


def test_what_fits_is_exported_and_planned(tiny_llama_dir, tmp_path):
    """The suggested values are accepted: the largest geometry the 512 positions hold."""
    code, stderr = run_cli("plan", tiny_llama_dir, "--sink", "4", "--pinned", "124", "--window", "320", "--chunk", "64")
    assert code == 0, stderr
    code, stderr = run_cli("plan", tiny_llama_dir, "--sink", "4", "--pinned", "124", "--window", "321", "--chunk", "64")
    one_error_line(code, stderr, "use --window 320 or less")


def test_a_vision_language_config_counts_its_image_tokens(tmp_path):
    """LLaVA-1.5 (4096 positions, 576 image tokens per frame): the image region takes positions too."""
    config = CONFIGS / "llava-1.5-7b.json"
    code, stderr = run_cli("plan", config, "--profile", "orin-x", "--sink", "4", "--pinned", "124", "--chunk", "64",
                           "--window", "3400")  # fmt: skip
    one_error_line(code, stderr, "image 576", "use --window 3328 or less")
    code, stderr = run_cli("plan", config, "--profile", "orin-x", "--pinned", "4000")
    one_error_line(code, stderr, "--pinned 4000", "image 576")


def test_a_profile_export_is_refused_from_the_config_alone(tiny_llama_dir, tmp_path):
    """With --profile, the window is the planner's: --pinned beyond the positions is refused before it."""
    with weights_never_load():
        code, stderr = run_cli("export", tiny_llama_dir, "-o", tmp_path / "o", "--profile", "cpu", "--pinned", "480")
    one_error_line(code, stderr, "--pinned 480", "leave no room for a window")


# -- chat: a system prompt longer than the pinned slots ------------------------------------------------


@pytest.fixture(scope="module")
def small_pins(load, tiny_qwen2_dir, export_to) -> Path:
    """sink 4 + pinned 12: room for a short system prompt only."""
    return export_to(load(str(tiny_qwen2_dir)), sink=4, pinned=12, window=40, chunk=8)


def test_a_system_prompt_too_long_for_the_pins_is_refused_before_the_model_loads(small_pins):
    with weights_never_load():
        code, stderr = run_cli("chat", small_pins, "--system", "check the mirrors and the route " * 20)
    one_error_line(code, stderr, "--system is", "pins at most 16", "--pinned")


def test_the_early_check_refuses_exactly_what_the_dialogue_refuses(small_pins):
    """Around the boundary (sink + pinned tokens), character by character: the check made with the
    tokenizer alone and Dialogue's own (after the model loaded) agree on every prompt."""
    manifest = load_manifest(small_pins)
    tok = Tokenizer(small_pins / manifest.files["tokenizer"].path)
    dec, _ = open_artifact(small_pins)
    text = "Keep a safe distance, check the mirrors, and take a break every two hours on a long drive."
    room, both = manifest.cache.sink + manifest.cache.pinned, {True: 0, False: 0}
    for end in range(1, len(text) + 1):
        system = text[:end]
        try:
            check_system_prompt(system, manifest, tok)
            early = True
        except OptionError as e:
            assert "\n" not in str(e)
            early = False
        try:
            Dialogue(dec, tok, system=system)
            late = True
        except InputError:
            late = False
        assert early == late, (system, room)
        both[early] += 1
    assert both[True] and both[False]  # the boundary was crossed


def test_a_default_system_prompt_too_long_is_named_as_the_models(small_pins):
    manifest = load_manifest(small_pins)
    tok = Tokenizer(small_pins / manifest.files["tokenizer"].path)
    long_default = dataclasses.replace(manifest, chat=dataclasses.replace(manifest.chat, default_system="drive " * 40))
    with pytest.raises(OptionError, match="the model's default system prompt is .* give a shorter --system"):
        check_system_prompt(None, long_default, tok)
    check_system_prompt("", long_default, tok)  # --system "": no system prompt at all


# -- serve: the same checks as chat, before the artifact opens ----------------------------------------


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--seats", "0"], ["--seats", "0"]),
        (["--seats", "65"], ["--seats 65", "at most 64"]),
        (["--seats", str(10**30)], ["--seats", "at most 64"]),
        (["--threads", "0"], ["--threads", "0"]),
        (["--threads", "100000"], ["--threads 100000", "core"]),
        (["--max-new-tokens", str(10**30)], ["--max-new-tokens", "1..32768"]),
        (["--port", "70000"], ["--port", "0..65535"]),
    ],
)
def test_serve_refuses_bad_sizes_before_the_artifact_opens(small_pins, args, needles):
    pytest.importorskip("starlette")
    with weights_never_load():
        one_error_line(*run_cli("serve", small_pins, *args), *needles)


def test_serve_refuses_more_seats_than_the_memory_holds_as_chat_does(small_pins, monkeypatch):
    """A machine with room for the weights and one and a half seats (limits.seat_limit: one function
    for chat and serve): two seats are refused, one is let through to the artifact."""
    pytest.importorskip("starlette")
    import cabinlm.runtime.limits as limits

    m = load_manifest(small_pins)
    room = sum(f.bytes for f in m.files.values()) + limits.seat_bytes(m) * 3 // 2
    monkeypatch.setattr(limits, "available_bytes", lambda: room)

    class Opened(Exception):
        pass

    def opened(*args, **kwargs):
        raise Opened

    with weights_never_load():
        one_error_line(*run_cli("serve", small_pins, "--seats", "2"), "--seats 2", "1 seat fit", "MiB")
        # a plain assignment: weights_never_load puts the real loader back on exit (monkeypatch would
        # put back _no_weights after it, and every later test in this process would find it)
        cabinlm.runtime.artifact.open_artifact = opened
        with pytest.raises(Opened):  # one seat fits: the artifact is opened next
            run_cli("serve", small_pins, "--seats", "1")
