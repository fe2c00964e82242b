"""One runtime assembly (runtime/assembly.py) for `cabinlm chat`, `cabinlm serve` and `cabinlm bench`:
every value checked once (RuntimeConfig), everything that needs the artifact checked before its
weights load (open_runtime), and the three commands opened through it with the same checks.

The refusals run with the runtime's artifact loader replaced by one that fails the test: a check
that came after the weights were read cannot pass.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest

import cabinlm.runtime.artifact
from cabinlm.engines.build import build_artifact
from cabinlm.engines.ort_graph.backend import ExportedGraphBackend
from cabinlm.contract.errors import CabinlmError, OptionError
from cabinlm.profiles import load_profile
from cabinlm.runtime.assembly import RuntimeConfig, open_runtime
from cabinlm.runtime.dialogue import LongMessages
from cabinlm.runtime.speculative import PlainDecoding, PromptLookupDrafting

LAYOUT = dict(sink=4, pinned=12, window=40, chunk=8)  # room for a short system prompt only
LONG_SYSTEM = "check the mirrors and the route " * 20


@pytest.fixture(scope="module")
def artifacts(load, tiny_qwen2_dir, export_to, tmp_path_factory) -> dict[str, Path]:
    art = export_to(load(str(tiny_qwen2_dir)), kv="int8", **LAYOUT)
    fused = build_artifact(art, load_profile("cpu"), tmp_path_factory.mktemp("assembly") / "fused", attention="fused")
    return {"export": art, "fused": fused}


@contextlib.contextmanager
def weights_never_load():
    def refuse(*args, **kwargs):
        raise AssertionError("the artifact was opened before the options were checked")

    saved = cabinlm.runtime.artifact.open_artifact
    cabinlm.runtime.artifact.open_artifact = refuse
    try:
        yield
    finally:
        cabinlm.runtime.artifact.open_artifact = saved


# -- RuntimeConfig: every value, once ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, needles",
    [
        ("max_new_tokens", 0, ["--max-new-tokens", "0"]),
        ("seats", 0, ["--seats", "0"]),
        ("seats", 65, ["--seats 65", "at most 64"]),
        ("threads", 0, ["--threads", "0"]),
        ("threads", 10**6, ["--threads 1000000", "core"]),
        ("temperature", float("nan"), ["--temperature", "nan"]),
        ("temperature", -0.5, ["--temperature", "-0.5"]),
        ("top_p", 0, ["--top-p", "0"]),
        ("top_k", -1, ["--top-k", "-1"]),
        ("seed", -1, ["--seed", "-1"]),
        ("long_messages", "shout", ["--long-messages", "refuse, stream", "'shout'"]),
        ("speculative", "yes", ["--speculative", "'yes'"]),
        ("system", 7, ["--system", "text", "7"]),
    ],
)
def test_a_config_value_that_cannot_work_is_refused_naming_the_option_and_the_value(field, value, needles, tmp_path):
    with pytest.raises(OptionError) as e:
        RuntimeConfig(tmp_path / "no-artifact", **{field: value})
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_a_config_takes_the_values_as_the_command_line_gives_them(tmp_path):
    c = RuntimeConfig(str(tmp_path), long_messages="stream", speculative=False)
    assert c.artifact == tmp_path and c.long_messages is LongMessages.STREAM
    assert c.sampler() is not c.sampler()  # each seat its own random state


# -- open_runtime: what needs the artifact, before its weights ---------------------------------------


def test_a_system_prompt_too_long_is_refused_before_the_weights_load(artifacts):
    with weights_never_load(), pytest.raises(OptionError) as e:
        open_runtime(RuntimeConfig(artifacts["export"], system=LONG_SYSTEM))
    assert str(e.value).startswith("--system is ") and "pins at most 16" in str(e.value)
    assert "give a shorter --system, or re-export with --pinned" in str(e.value)


def test_a_system_prompt_no_option_gave_is_named_without_one(artifacts):
    """`cabinlm serve` (the model's default) and `cabinlm bench` (its script's prompt) have no
    --system: the message suggests only what the user can do, re-export."""
    with weights_never_load(), pytest.raises(OptionError) as e:
        open_runtime(RuntimeConfig(artifacts["export"], system=LONG_SYSTEM, system_option=None))
    message = str(e.value)
    assert message.startswith("the system prompt is ") and "--system" not in message
    assert "pins at most 16 (sink 4 + pinned 12); re-export with --pinned" in message


def test_the_assembly_counts_the_system_prompt_as_the_dialogue_pins_it(artifacts):
    """At the boundary, word by word: open_runtime refuses exactly the prompts whose Dialogue would
    not fit them (the same renderer), and a prompt it lets through is pinned whole."""
    words = "Keep a safe distance, check the mirrors, and take a break every two hours on a long drive.".split()
    refused = let_through = 0
    for end in range(1, len(words) + 1):
        system = " ".join(words[:end])
        try:
            runtime = open_runtime(RuntimeConfig(artifacts["export"], system=system, verify=False))
        except OptionError:
            refused += 1
            continue
        let_through += 1
        (d,) = runtime.dialogues()
        assert d.decoder.cache.seen == len(d.template.system(system)) <= LAYOUT["sink"] + LAYOUT["pinned"]
    assert refused and let_through


def test_images_for_a_text_model_are_refused_before_the_weights_load(artifacts):
    with weights_never_load(), pytest.raises(OptionError, match="--image: this model has no vision input"):
        open_runtime(RuntimeConfig(artifacts["export"], images=True))


def test_seats_share_one_loaded_backend_and_keep_their_own_caches(artifacts):
    runtime = open_runtime(RuntimeConfig(artifacts["fused"], seats=3, system="Hi", max_new_tokens=5))
    dialogues = runtime.dialogues()
    assert runtime.dialogues() is dialogues and len(dialogues) == 3
    backends = [d.decoder.backend for d in dialogues]
    assert len({id(b.graphs) for b in backends}) == 1  # the sessions and weights, held once
    assert len({b.keys.ctypes.data for b in backends}) == 3  # each seat its own cache
    dialogues[0].ask("check the route")
    assert dialogues[1].decoder.cache.seen == dialogues[2].decoder.cache.seen < dialogues[0].decoder.cache.seen
    assert all(d.max_new_tokens == 5 and d.system == "Hi" for d in dialogues)


def test_drafting_is_the_backends_default_unless_the_caller_chose(artifacts):
    fused = open_runtime(RuntimeConfig(artifacts["fused"], seats=2))
    assert fused.drafts and fused.why_not == "" and fused.drafting_notice is None
    drafting = [d.drafting for d in fused.dialogues()]
    assert all(isinstance(x, PromptLookupDrafting) for x in drafting) and drafting[0] is not drafting[1]
    export = open_runtime(RuntimeConfig(artifacts["export"], verify=False))
    assert not export.drafts and "rounding" in export.why_not
    assert export.drafting_notice is None  # an unbuilt export: --help says why
    assert isinstance(export.dialogues()[0].drafting, PlainDecoding)
    forced = open_runtime(RuntimeConfig(artifacts["export"], speculative=True, verify=False))
    assert forced.drafts and isinstance(forced.new_drafting(), PromptLookupDrafting)
    off = open_runtime(RuntimeConfig(artifacts["fused"], speculative=False))
    assert not off.drafts and isinstance(off.new_drafting(), PlainDecoding)


def test_a_fixed_chunk_build_says_why_it_does_not_draft(artifacts, monkeypatch):
    monkeypatch.setattr(ExportedGraphBackend, "fixed_chunk", property(lambda self: True))
    runtime = open_runtime(RuntimeConfig(artifacts["export"], verify=False))
    assert not runtime.drafts and "costs a whole chunk" in runtime.why_not
    assert runtime.drafting_notice == f"speculative decoding off: {runtime.why_not} (--speculative turns it on)"
    chosen = open_runtime(RuntimeConfig(artifacts["export"], speculative=False, verify=False))
    assert chosen.drafting_notice is None  # the user chose: nothing to say


def test_a_swapped_file_is_refused_unless_verification_is_off(artifacts, tmp_path):
    copy = Path(shutil.copytree(artifacts["export"], tmp_path / "a"))
    data = copy / "decoder.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CabinlmError, match="sha256"):
        open_runtime(RuntimeConfig(copy))
    open_runtime(RuntimeConfig(copy, verify=False))  # the bench's timed load skips it


# -- the three commands: the same checks -------------------------------------------------------------


def test_serve_is_configured_and_opened_by_the_same_assembly(artifacts):
    from cabinlm.serve import ChatService, ServeConfig

    config = ServeConfig(artifacts["fused"], seats=2, max_new_tokens=7, threads=1)
    assert config.runtime == RuntimeConfig(artifacts["fused"], seats=2, threads=1, system=None, system_option=None,
                                           max_new_tokens=7)  # fmt: skip
    with pytest.raises(OptionError, match="--max-new-tokens must be 1..32768"):
        ServeConfig(artifacts["fused"], max_new_tokens=40000)  # a request's bound, serve's own
    with pytest.raises(OptionError, match="--long-messages"):
        ServeConfig(artifacts["fused"], long_messages="shout")  # chat's checks, which serve lacked
    service = ChatService.open(config)
    try:
        assert [type(d.drafting) for d in service.dialogues] == [PromptLookupDrafting] * 2
        assert service.dialogues[0].decoder.backend.graphs is service.dialogues[1].decoder.backend.graphs
    finally:
        service.close()


def test_serve_refuses_a_default_system_prompt_too_long_before_the_weights_load(artifacts, tmp_path):
    """The model's own default system prompt, too long for the pins: serve has no --system, so the
    message says to re-export (it used to surface only as the first dialogue was made)."""
    from cabinlm.serve import ChatService, ServeConfig

    copy = Path(shutil.copytree(artifacts["export"], tmp_path / "a"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["chat"]["default_system"] = LONG_SYSTEM
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with weights_never_load(), pytest.raises(OptionError) as e:
        ChatService.open(ServeConfig(copy))
    assert str(e.value).startswith("the model's default system prompt is ") and "re-export with --pinned" in str(e.value)


def test_bench_refuses_a_cache_too_small_for_its_system_prompt_before_the_run(load, tiny_qwen2_dir, export_to):
    """The bench pins its script's system prompt as chat pins one; an artifact whose pins cannot
    hold it is refused at the start, not part-way through the first prompt."""
    from cabinlm.bench.runner import run_cabinlm

    small = export_to(load(str(tiny_qwen2_dir)), sink=2, pinned=2, window=40, chunk=8)
    with weights_never_load(), pytest.raises(OptionError, match="^the system prompt is .* re-export with --pinned"):
        run_cabinlm(small, tokens=50, threads=1)
