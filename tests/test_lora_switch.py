"""Switchable LoRA adapters (export --lora-rank, build --adapter, a seat's adapter at run time): tiny
random Llama / Qwen2 models and random PEFT adapters (test_lora.make_peft_adapter), held to PEFT's own
merge in transformers, to the streaming reference past the window, and to the base export bit for bit
with no adapter. Then the build's prepared files, seats, session files, serve, and each bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_cli import assert_clean_error, cabinlm
from test_equivalence import TOL, nll_of, reference_nll, tokens
from test_lora import DENSE, make_peft_adapter, merged_nll, peft_merged

from cabinlm.contract.adapters import TARGETS
from cabinlm.contract.errors import InputError, ModelError, OptionError
from cabinlm.export import ExportOptions, export_loaded
from cabinlm.export.adapter_files import AdapterRequest, prepare
from cabinlm.export.models import load_model
from cabinlm.runtime import Decoder


def export_switchable(model_dir: Path, out: Path, rank: int = 8, **opts) -> tuple[Path, object]:
    loaded = load_model(str(model_dir))
    export_loaded(loaded, out, ExportOptions(lora_rank=rank, verify=False, gate=False, **{**DENSE, **opts}))
    return out, loaded


def with_adapter(folder: Path, adapter: Path | None, scale: float = 1.0) -> Decoder:
    """A decoder of the export with the adapter's padded inputs fed (no build needed)."""
    dec = Decoder(folder)
    if adapter is not None:
        spec = f"{adapter}:{scale}" if scale != 1.0 else str(adapter)
        dec.backend.set_adapter(prepare(AdapterRequest.parse(f"a={spec}"), dec.manifest).arrays)
    return dec


@pytest.fixture(scope="module")
def llama_switch(tiny_llama_dir, tmp_path_factory):
    """One switchable export of the tiny Llama (rank 8, every target) and two adapters for it."""
    root = tmp_path_factory.mktemp("lora-switch")
    folder, loaded = export_switchable(tiny_llama_dir, root / "art")
    a = make_peft_adapter(tiny_llama_dir, root / "a", r=4, alpha=8, seed=11)
    b = make_peft_adapter(tiny_llama_dir, root / "b", r=8, alpha=16, seed=12, targets=["q_proj", "v_proj", "down_proj"])
    return SimpleNamespace(folder=folder, loaded=loaded, a=a, b=b, root=root)


# -- the graph: an adapter fed = PEFT's merge; none = the base export ------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_adapter_fed_to_the_switchable_graph_is_dense_equal_to_peft(arch, request, tmp_path, long_text):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", r=4, alpha=8, seed=3)
    folder, loaded = export_switchable(model_dir, tmp_path / "art", rank=8)
    ids = tokens(loaded, long_text, 128)
    dec = with_adapter(folder, adapter)
    ours = nll_of(dec.feed(ids, all_logits=True), ids)
    expected = merged_nll(peft_merged(model_dir, adapter), ids)
    np.testing.assert_allclose(ours, expected, atol=TOL)
    assert np.abs(merged_nll(loaded.model, ids) - expected).max() > 50 * TOL  # the adapter moved the model


def test_an_adapter_fed_follows_the_streaming_semantics_past_the_window(tiny_llama_dir, tmp_path, long_text):
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "adapter", r=4, alpha=8, seed=5)
    folder, loaded = export_switchable(tiny_llama_dir, tmp_path / "art", rank=4, window=24, chunk=8)
    ids = tokens(loaded, long_text, 150)  # five times the cache
    reference = SimpleNamespace(model=peft_merged(tiny_llama_dir, adapter))
    expected = reference_nll(reference, ids, sink=4, window=24, chunk=8)
    dec = with_adapter(folder, adapter)
    ours = nll_of(np.concatenate([dec.step(np.array(ids[i : i + 8])).copy() for i in range(0, len(ids), 8)]), ids)
    np.testing.assert_allclose(ours, expected, atol=TOL)
    assert np.abs(ours[40:] - merged_nll(reference.model, ids)[40:]).max() > 50 * TOL  # eviction happened


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_no_adapter_is_the_base_export_bit_for_bit(arch, request, tmp_path, long_text):
    """Zeros in A and B add exact zeros: the logits are the plain export's, bit for bit, in chunks and
    in one-token steps."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    folder, loaded = export_switchable(model_dir, tmp_path / "switch", rank=8)
    plain = tmp_path / "plain"
    export_loaded(loaded, plain, ExportOptions(verify=False, gate=False, **DENSE))
    ids = np.asarray(tokens(loaded, long_text, 100))
    for chunked in (True, False):
        got = []
        for f in (folder, plain):
            dec = Decoder(f)
            got.append(dec.feed(ids, all_logits=True) if chunked else np.stack([dec.step(ids[i : i + 1])[0].copy()
                                                                                 for i in range(len(ids))]))  # fmt: skip
        np.testing.assert_array_equal(got[0], got[1])


# -- the build: adapters prepared once, listed and checksummed ------------------------------------------


@pytest.fixture(scope="module")
def built(llama_switch):
    """The switchable export built for the cpu profile with both adapters (the fused decoder, which
    takes the adapter inputs: tests/test_lora_fused.py holds it to the exported graph)."""
    out = llama_switch.root / "build"
    p = cabinlm("build", llama_switch.folder, "--profile", "cpu", "-o", out, "--adapter", f"a={llama_switch.a}",
                "--adapter", f"b={llama_switch.b}:0.5")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "prepared adapter a" in p.stderr and "fused the decoder" in p.stderr
    return out


def test_the_build_lists_each_adapter_with_its_file_and_checksum(built, llama_switch):
    from cabinlm.contract.manifest import load_manifest, verify_checksums

    m = load_manifest(built)
    verify_checksums(built, m)  # the adapters' files included
    assert m.runtime_spec.backend.value == "onnxruntime-fused"
    assert (m.lora.rank, m.lora.targets, m.lora.names) == (8, TARGETS, ("a", "b"))
    b = m.lora.adapter("b")
    assert (b.rank, b.scale, b.targets, b.format) == (8, 0.5, ("down_proj", "q_proj", "v_proj"), "peft")
    assert m.files["adapter.a"].path == "adapters/a.npz" and (built / "adapters" / "b.npz").is_file()
    raw = json.loads((built / "manifest.json").read_text())
    assert [t["name"] for t in raw["io"]["inputs"]][-2:] == ["lora_a.1.down_proj", "lora_b.1.down_proj"]


def test_a_built_adapter_scores_as_the_merged_model(built, llama_switch, tmp_path, long_text):
    """perplexity --adapter b (scale 0.5) on the build = PEFT's merge with half of b's scaling."""
    ids = tokens(llama_switch.loaded, long_text, 100)
    text = tmp_path / "t.txt"
    text.write_text(llama_switch.loaded.tokenizer.decode(ids[1:]))
    p = cabinlm("perplexity", built, "--text", text, "--adapter", "b", "--json", "--nll-out", tmp_path / "nll.npy")
    assert p.returncode == 0, p.stderr
    plain = cabinlm("perplexity", built, "--text", text, "--json")
    assert json.loads(p.stdout)["ppl"] != json.loads(plain.stdout)["ppl"]
    dec = Decoder(built)
    dec.set_adapter("b")
    scored = np.load(tmp_path / "nll.npy")
    fed = tokens_of(dec, text)
    ours = nll_of(np.stack([dec.step(np.array([t]))[0].copy() for t in fed]), fed)
    np.testing.assert_allclose(scored, ours, atol=1e-6)
    half = shutil.copytree(llama_switch.b, tmp_path / "half")
    cfg = json.loads((half / "adapter_config.json").read_text())
    (half / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 0.5}))
    np.testing.assert_allclose(ours, merged_nll(peft_merged(llama_switch.loaded.folder, half), fed), atol=TOL)


def tokens_of(dec: Decoder, text: Path) -> list[int]:
    from cabinlm.runtime import Tokenizer

    return Tokenizer(dec.folder / dec.manifest.files["tokenizer"].path).encode(text.read_text(), add_special_tokens=True)


# -- seats: their own adapters, switching, session files ----------------------------------------------


def ask(d, text: str) -> str:
    return d.ask(text).reply


def test_seats_with_different_adapters_answer_as_each_would_alone(built):
    from cabinlm.runtime import RuntimeConfig, open_runtime

    rt = open_runtime(RuntimeConfig(built, seats=2, max_new_tokens=12, speculative=False))
    one, two = rt.dialogues()
    two.set_adapter("a")
    assert (one.adapter, two.adapter) == (None, "a")
    got = [ask(one, "hello there"), ask(two, "hello there")]
    alone = open_runtime(RuntimeConfig(built, adapter="a", max_new_tokens=12, speculative=False)).dialogues()[0]
    base = open_runtime(RuntimeConfig(built, max_new_tokens=12, speculative=False)).dialogues()[0]
    assert got == [ask(base, "hello there"), ask(alone, "hello there")]
    assert got[0] != got[1]  # the adapter changes the reply


def test_switching_adapter_gives_the_reply_a_fresh_seat_with_that_adapter_and_history_gets(built):
    from cabinlm.runtime import RuntimeConfig, open_runtime

    rt = open_runtime(RuntimeConfig(built, seats=2, max_new_tokens=10, speculative=False))
    seat, fresh = rt.dialogues()
    ask(seat, "first message")  # answered by the base model
    history = list(seat.decoder.history)
    seat.set_adapter("b")  # the cache rebuilt from the seat's history, with b
    state = seat.state()
    # A fresh seat with b, fed the same chunks (the base model's reply included), holds the same cache ...
    fresh.set_adapter("b")
    fresh.decoder.reset()
    for kind, ids in history:
        fresh.decoder.step(ids, pin=kind.pin)
    fresh.restore(state)
    for name, buf in seat.decoder.backend.buffers().items():
        np.testing.assert_array_equal(fresh.decoder.backend.buffers()[name], buf, err_msg=name)
    # ... and gives the same reply, which is not the base model's.
    replies = [ask(seat, "second message"), ask(fresh, "second message")]
    assert replies[0] == replies[1]
    base = open_runtime(RuntimeConfig(built, max_new_tokens=10, speculative=False)).dialogues()[0]
    ask(base, "first message")
    assert ask(base, "second message") != replies[0]


def test_a_seat_saved_with_its_adapter_resumes_with_it(built, tmp_path):
    from cabinlm.runtime import RuntimeConfig, open_runtime
    from cabinlm.runtime.persist import SessionError, load_session, save_session

    config = RuntimeConfig(built, max_new_tokens=10, speculative=False)
    d = open_runtime(dataclass_replace(config, adapter="a")).dialogues()[0]
    ask(d, "remember this")
    save_session(tmp_path / "s.bin", d)
    expected = ask(d, "and now?")
    resumed = open_runtime(config).dialogues()[0]  # opened without an adapter
    load_session(tmp_path / "s.bin", resumed)
    assert resumed.adapter == "a"
    assert ask(resumed, "and now?") == expected  # (a resumed seat switching: tests/test_lora_sessions.py)
    # A build that does not hold the adapter as it was refuses the file.
    other = dataclass_replace(config, artifact=rebuilt_without_a(built, tmp_path))
    with pytest.raises(SessionError, match="saved with adapter 'a', which this build does not hold"):
        load_session(tmp_path / "s.bin", open_runtime(other).dialogues()[0])


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def rebuilt_without_a(built: Path, tmp_path: Path) -> Path:
    """The same build with adapter a recorded at another scale (its session no longer fits)."""
    copy = shutil.copytree(built, tmp_path / "copy")
    raw = json.loads((copy / "manifest.json").read_text())
    raw["lora"]["adapters"][0]["scale"] = 0.25
    (copy / "manifest.json").write_text(json.dumps(raw))
    return copy


# -- what is refused, one line each ----------------------------------------------------------------------


def build_refusal(llama_switch, tmp_path, *adapters: str) -> str:
    args = [a for spec in adapters for a in ("--adapter", spec)]
    p = cabinlm("build", llama_switch.folder, "--profile", "cpu", "-o", tmp_path / "never", *args)
    assert p.returncode == 2, p.stderr
    assert not (tmp_path / "never").exists()  # refused before anything was built
    return next(line for line in p.stderr.splitlines() if line.startswith("error:"))


def test_an_adapter_for_another_base_model_is_refused(llama_switch, tmp_path):
    from conftest import make_tiny_model

    other = make_tiny_model(tmp_path / "wider", "llama", hidden_size=32, intermediate_size=64)
    adapter = make_peft_adapter(other, tmp_path / "adapter", targets=["q_proj"])
    line = build_refusal(llama_switch, tmp_path, f"x={adapter}")
    assert f"--adapter x={adapter}: layers.0.self_attn.q_proj" in line and "another base model" in line


def test_a_missing_or_corrupt_safetensors_file_is_refused(llama_switch, tmp_path):
    cut = shutil.copytree(llama_switch.a, tmp_path / "cut")
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "not a readable safetensors file" in build_refusal(llama_switch, tmp_path, f"cut={cut}")
    (cut / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in build_refusal(llama_switch, tmp_path, f"cut={cut}")


def test_a_rank_above_the_exports_maximum_is_refused(llama_switch, tiny_llama_dir, tmp_path):
    big = make_peft_adapter(tiny_llama_dir, tmp_path / "big", r=16, targets=["q_proj"])
    assert "rank 16, above the export's maximum 8; re-export with --lora-rank 16" in build_refusal(llama_switch, tmp_path,
                                                                                                   f"big={big}")  # fmt: skip


def test_a_target_the_export_takes_no_inputs_on_is_refused(tiny_llama_dir, llama_switch, tmp_path):
    folder, _ = export_switchable(tiny_llama_dir, tmp_path / "qv", rank=8, lora_targets=("q_proj", "v_proj"))
    with pytest.raises(ModelError, match="changes down_proj, but the export takes adapter inputs on q_proj, v_proj only"):
        prepare(AdapterRequest.parse(f"b={llama_switch.b}"), Decoder(folder).manifest)


def test_bad_adapter_names_and_options_are_refused(llama_switch, built, tmp_path):
    assert "give NAME=DIR[:SCALE]" in build_refusal(llama_switch, tmp_path, str(llama_switch.a))
    assert "the name '-x' must be letters" in build_refusal(llama_switch, tmp_path, f"-x={llama_switch.a}")
    assert "is given twice" in build_refusal(llama_switch, tmp_path, f"a={llama_switch.a}", f"a={llama_switch.b}")
    p = cabinlm("chat", built, "--adapter", "nope", stdin="hi\n")
    assert_clean_error(p, "--adapter nope: no adapter of that name in this build (it holds: a, b)")
    with pytest.raises(InputError, match="no adapter named 'nope'"):
        Decoder(built).set_adapter("nope")
    with pytest.raises(OptionError, match="--lora-rank must be a whole number"):
        ExportOptions(lora_rank=-1)


def test_an_export_without_adapter_inputs_refuses_adapters(tiny_qwen2_dir, llama_switch, tmp_path):
    plain = tmp_path / "plain"
    export_loaded(load_model(str(tiny_qwen2_dir)), plain, ExportOptions(verify=False, gate=False, **DENSE))
    p = cabinlm("build", plain, "--profile", "cpu", "--adapter", f"a={llama_switch.a}", "-o", tmp_path / "b")
    assert_clean_error(p, "this export has no adapter inputs; export the model with --lora-rank R")
    p = cabinlm("chat", plain, "--adapter", "a", stdin="hi\n")
    assert_clean_error(p, "--adapter a: this artifact takes no switchable adapters")


def test_htp_and_tensorrt_profiles_refuse_lora_rank_exports(tiny_llama_dir, llama_switch, tmp_path):
    for profile in ("sa8775p", "orin-x"):
        p = cabinlm("export", tiny_llama_dir, "-o", tmp_path / profile, "--profile", profile, "--lora-rank", 8)
        assert_clean_error(p, f"--lora-rank: switchable adapters run on the cpu profile's engines; profile {profile}",
                           "merge the adapter with --lora instead")  # fmt: skip
    p = cabinlm("build", llama_switch.folder, "--profile", "sa8775p", "-o", tmp_path / "htp")
    assert_clean_error(p, "has switchable LoRA adapter inputs (export --lora-rank), which profile sa8775p's engine does not take")


# -- serve: BASE and BASE:NAME ---------------------------------------------------------------------------


def test_serve_lists_an_adapter_per_model_and_refuses_an_unknown_one(built, tmp_path):
    pytest.importorskip("starlette")
    from test_serve import Server

    with Server(built, tmp_path / "log", "--seats", 2, model="tiny") as s:
        status, listed = s.request("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == ["tiny", "tiny:a", "tiny:b"]
        assert s.request("GET", "/v1/models/tiny:b")[0] == 200
        body = {"model": "tiny:nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, err = s.request("POST", "/v1/chat/completions", body)
        assert status == 404 and err["error"]["param"] == "model" and err["error"]["code"] == "model_not_found"
        assert "'tiny:a'" in err["error"]["message"]
        replies = {}
        # seat two answers with the base model, then (the same first message, a new conversation) with a:
        # its cache started over with a, the reply seat one's with a
        for model, user in (("tiny:a", "one"), ("tiny", "two"), ("tiny:a", "two")):
            body = {"model": model, "user": user, "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 8}  # fmt: skip
            status, out = s.request("POST", "/v1/chat/completions", body)
            assert status == 200, out
            replies.setdefault(model, []).append(out["choices"][0]["message"]["content"])
        assert replies["tiny:a"][0] == replies["tiny:a"][1] != replies["tiny"][0]
        assert s.seat("one")["turns"] >= 1


# -- the plan: each adapter's bytes --------------------------------------------------------------------


def test_the_plan_counts_each_adapter_once_and_the_zeros_of_none(built, llama_switch, tiny_llama_dir):
    from cabinlm.contract.manifest import load_manifest
    from cabinlm.profiles import load_profile
    from cabinlm.profiles.planner import plan_for_manifest

    m = load_manifest(built)
    one = m.lora.bytes_per_adapter(m.model.num_layers, m.lora_shapes)
    p = plan_for_manifest(m, load_profile("cpu"))
    assert (p.lora_rank, p.adapter_bytes, [n for n, _ in p.adapters]) == (8, one, ["a", "b"])
    assert p.adapter_activation_bytes > 0
    out = cabinlm("plan", tiny_llama_dir, "--adapter", llama_switch.a, "--adapter", llama_switch.b, "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["lora_rank"] == 8 and len(got["adapters"]) == 2  # the largest adapter's rank (b: 8)
    base = json.loads(cabinlm("plan", tiny_llama_dir, "--json").stdout)
    assert got["total_bytes"] - base["total_bytes"] == 3 * got["adapter_bytes"] + got["adapter_activation_bytes"]
    text = cabinlm("plan", tiny_llama_dir, "--lora-rank", "8", "--adapter", llama_switch.a).stdout
    assert "the zeros of no adapter" in text and "adapter a (its file" in text
    assert_clean_error(cabinlm("plan", tiny_llama_dir, "--lora-rank", "2", "--adapter", llama_switch.b),
                       "rank 8 is above --lora-rank 2")
    assert_clean_error(cabinlm("plan", built, "--lora-rank", "8"), "adapter inputs are fixed")
