"""Switchable adapters through the command line: a GGUF LoRA given to `cabinlm build --adapter` (held to
the PEFT adapter it was written from, logits bit for bit), and `cabinlm bench --adapter` for one seat
and for --seats N (an adapter per seat), their reports and records, and each refusal in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli import assert_clean_error, cabinlm
from test_equivalence import tokens
from test_lora import make_peft_adapter, write_gguf_lora
from test_lora_switch import export_switchable, llama_switch  # noqa: F401 (a fixture)

from cabinlm.contract.manifest import load_manifest
from cabinlm.runtime import Decoder


# -- a GGUF LoRA through build --adapter ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_lora_built_in_gives_the_logits_of_the_peft_adapter_it_was_written_from(arch, request, tmp_path,
                                                                                        long_text):  # fmt: skip
    """llama.cpp's adapter file (for "llama": q's and k's rows interleaved as its converter does) is
    prepared to the PEFT adapter's inputs exactly: the same padded arrays, the same logits bit for bit
    in chunks and in one-token steps, and not the base model's."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    folder, loaded = export_switchable(model_dir, tmp_path / "art", rank=8)
    peft = make_peft_adapter(model_dir, tmp_path / "peft", r=4, alpha=8, seed=31)
    gguf = write_gguf_lora(peft, tmp_path / "adapter.gguf", arch, (4, 2), alpha=8)
    out = tmp_path / "build"
    p = cabinlm("build", folder, "--profile", "cpu", "-o", out, "--adapter", f"p={peft}", "--adapter", f"g={gguf}",
                "--adapter", f"p2={peft}:0.5", "--adapter", f"g2={gguf}:0.5")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "prepared adapter g (gguf, rank 4" in p.stderr
    m = load_manifest(out)
    g = m.lora.adapter("g")
    assert (g.format, g.rank, g.scale) == ("gguf", 4, 1.0) and g.source == str(gguf)
    for peft_name, gguf_name in (("p", "g"), ("p2", "g2")):  # SCALE on top of the file's own alpha / r too
        with np.load(out / "adapters" / f"{peft_name}.npz") as a, np.load(out / "adapters" / f"{gguf_name}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for name in a.files:
                np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    with np.load(out / "adapters" / "g.npz") as one, np.load(out / "adapters" / "g2.npz") as half:
        b_name = next(n for n in one.files if n.startswith("lora_b.") and one[n].any())
        np.testing.assert_allclose(half[b_name], one[b_name] * 0.5, rtol=1e-6)
    ids = np.asarray(tokens(loaded, long_text, 100))
    got = {}
    for name in ("p", "g", None):
        dec = Decoder(out)
        dec.set_adapter(name)
        chunked = dec.feed(ids, all_logits=True)
        dec.reset()
        stepped = np.stack([dec.step(ids[i : i + 1])[0].copy() for i in range(40)])
        got[name] = (chunked, stepped)
    for x, y in zip(got["g"], got["p"]):
        np.testing.assert_array_equal(x, y)
    assert np.abs(got["g"][0] - got[None][0]).max() > 1e-2  # the adapter moves the model


def test_a_gguf_lora_for_another_architecture_is_refused_at_build(tiny_qwen2_dir, llama_switch, tmp_path):  # noqa: F811
    peft = make_peft_adapter(tiny_qwen2_dir, tmp_path / "peft", r=4, targets=["q_proj"])
    gguf = write_gguf_lora(peft, tmp_path / "qwen.gguf", "qwen2", (4, 2), alpha=8)
    p = cabinlm("build", llama_switch.folder, "--profile", "cpu", "-o", tmp_path / "never", "--adapter", f"q={gguf}")
    assert_clean_error(p, f"--adapter q={gguf}", "qwen2")
    assert not (tmp_path / "never").exists()


# -- bench --adapter ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_build(tiny_llama_dir, llama_switch, tmp_path_factory):  # noqa: F811
    """A switchable export whose pinned slots hold the bench's system prompt, built with adapters a and b."""
    root = tmp_path_factory.mktemp("lora-bench")
    folder, _ = export_switchable(tiny_llama_dir, root / "art", rank=8, pinned=60)
    p = cabinlm("build", folder, "--profile", "cpu", "-o", root / "build", "--adapter", f"a={llama_switch.a}",
                "--adapter", f"b={llama_switch.b}")  # fmt: skip
    assert p.returncode == 0, p.stderr
    return root / "build"


def bench(build, *args):
    return cabinlm("bench", build, "--tokens", 60, "--max-new", 8, "--threads", 1, "--no-speculative", *args)


def test_bench_runs_the_dialogue_with_the_adapter_and_records_it(bench_build, tmp_path):
    records = tmp_path / "r.jsonl"
    p = bench(bench_build, "--adapter", "a", "--records", records)
    assert p.returncode == 0, p.stderr
    assert "cabinlm (adapter a): " in p.stdout
    base = bench(bench_build, "--records", records, "--json")
    assert base.returncode == 0, base.stderr
    with_a = bench(bench_build, "--adapter", "a", "--json")
    assert json.loads(with_a.stdout)["config"]["adapter"] == "a" and "adapter" not in json.loads(base.stdout)["config"]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["params"].get("adapter") for r in rows] == ["a", None]


def test_bench_refuses_an_unknown_adapter_in_one_line(bench_build, tmp_path):
    p = bench(bench_build, "--adapter", "nope", "--records", tmp_path / "r.jsonl")
    assert_clean_error(p, "--adapter nope: no adapter of that name in this build (it holds: a, b)")
    assert not (tmp_path / "r.jsonl").exists()
    assert_clean_error(bench(bench_build, "--adapter", "a,b"),
                       "one seat takes one adapter; a name per seat goes with --seats N")  # fmt: skip


# -- bench --seats N with an adapter per seat -------------------------------------------------------------


def test_bench_seats_gives_each_seat_its_adapter(bench_build, tmp_path):
    """--adapter a,b,a with --seats 3: seat i the i-th adapter, in the report, the JSON and every record;
    the seats' replies are those seats alone with those adapters give (seat 0 and 2: a, seat 1: b)."""
    records = tmp_path / "r.jsonl"
    args = ["--seats", 3, "--tokens", 16, "--max-new", 4, "--threads", 1, "--no-speculative"]
    p = cabinlm("bench", bench_build, *args, "--adapter", "a,b,a", "--records", records, "--json")
    assert p.returncode == 0, p.stderr
    runs = json.loads(p.stdout)["seats"]
    assert [r["mode"] for r in runs] == ["together", "turns", "streams"]
    assert all(r["adapters"] == ["a", "b", "a"] for r in runs)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == 3 and {r["params"]["adapters"] for r in rows} == {"a,b,a"}
    text = cabinlm("bench", bench_build, *args, "--adapter", "b")
    assert text.returncode == 0, text.stderr
    assert "3 seats (adapters b, b, b)" in text.stdout and "seat adapters b, b, b" in text.stderr


def test_bench_seats_replies_are_each_adapters_own(bench_build):
    """run_seats with an adapter per seat: each seat's replies are those a run with that adapter on
    every seat gives it (each seat's script is its own, the adapter decides its tokens)."""
    from cabinlm.bench.seats import run_seats

    def replies(adapters) -> list[list]:
        run = run_seats(bench_build, 3, 2, 6, 1, 0, "together", speculative=False, adapters=adapters)
        return [run.replies[i::3] for i in range(3)]  # seat i's, round after round

    mixed, all_a, all_b = replies(("a", "b", "a")), replies(("a",) * 3), replies(("b",) * 3)
    assert mixed == [all_a[0], all_b[1], all_a[2]]
    assert all_a[1] != all_b[1]  # the adapters answer differently


def test_bench_seats_refuses_adapter_lists_that_do_not_fit(bench_build):
    args = ["--seats", 3, "--tokens", 16, "--max-new", 4, "--threads", 1]
    assert_clean_error(cabinlm("bench", bench_build, *args, "--adapter", "a,b"), "--adapter a,b: 2 names for 3 seats")
    assert_clean_error(cabinlm("bench", bench_build, *args, "--adapter", "a,nope,b"),
                       "--adapter nope: no adapter of that name")  # fmt: skip
    assert_clean_error(cabinlm("bench", bench_build, *args, "--adapter", "a", "--baseline", "llama.cpp"),
                       "the baselines run the base model")  # fmt: skip
