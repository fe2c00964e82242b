"""One way to write a build: the output folder checked and prepared, the export's files brought
over, and the built manifest derived through the same validation every load applies.

    output = BuildOutput.prepare(artifact, out)     refused in one line before anything is written when
                                                    `out` is the input, inside it, holds it, or is a file
    output.copy(FileRole.TOKENIZER)                 an export file, copied as it is
    output.add(FileRole.GRAPH, "decoder.opt.onnx")  a file the builder wrote into output.folder
    built = output.finish(spec, profile)            manifest.json: the export's facts + files + "build",
                                                    through Manifest.from_dict (never mutated after)

Nothing in the input folder is modified, moved or deleted. In the output folder, the manifest of
an earlier build is removed first, so a half-written build never looks finished.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from cabinlm.contract.files import FileRole
from cabinlm import __version__
from cabinlm.contract.buildspec import BuildSpec
from cabinlm.contract.errors import BuildError
from cabinlm.contract.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, ManifestError, Target, load_manifest

LEGACY_BUILD_RECORD = "build.json"  # the untyped build record of cabinlm before manifest format 4 (removed on rebuild)


def check_output(artifact: Path, out: Path) -> None:
    """Refuse an output that would write into the input (or over it): one line, nothing written."""
    a, o = artifact.resolve(), out.resolve()
    if o.exists() and not o.is_dir():
        raise BuildError(f"-o {out} is a file; pass a folder (new or empty, or an earlier build's) for the build")
    if o == a:
        raise BuildError(f"-o {out} is the export itself; a build never writes into its input: pass another folder, "
                         f"e.g. -o {artifact.parent / (artifact.name + '-build')}")
    if a in o.parents:
        raise BuildError(f"-o {out} is inside the export {artifact}; a build never writes into its input: pass a folder "
                         f"outside it, e.g. -o {artifact.parent / (artifact.name + '-' + o.name)}")
    if o in a.parents:
        raise BuildError(f"-o {out} holds the export {artifact}; pass a folder beside it, "
                         f"e.g. -o {artifact.parent / (artifact.name + '-build')}")
    if o.is_dir() and (o / MANIFEST_NAME).exists():  # an earlier build may be replaced, an export never
        try:
            earlier = load_manifest(o, check_files=False)
        except ManifestError as e:
            raise BuildError(f"-o {out} holds an artifact this cabinlm cannot read ({e}); pass a new or empty folder") from e
        if earlier.build is None:
            raise BuildError(f"-o {out} holds an export, not an earlier build; pass a new or empty folder")


def save_validated(draft: Manifest, folder: Path) -> Manifest:
    """Write a build's manifest as Manifest.from_dict reads it back: the draft is only serialized, the
    manifest saved and returned is the validated reading (no check of a load is bypassed)."""
    try:
        built = Manifest.from_dict(json.loads(json.dumps(draft.to_dict())), where=str(folder / MANIFEST_NAME))
    except ManifestError as e:
        raise BuildError(f"the build's manifest does not validate ({e}); this is a cabinlm bug, please report it") from e
    built.save(folder)
    return built


class BuildOutput:
    """The folder one build writes, and the files it lists (role -> path inside the folder)."""

    def __init__(self, artifact: Path, source: Manifest, folder: Path):
        self.artifact, self.source, self.folder = artifact, source, folder
        self.files: dict[str, str] = {}
        self.quality: dict[str, Any] = {}  # the build's own figures: manifest quality.build
        self.lora = source.lora  # the export's adapter inputs, with the adapters this build prepared (build.py)

    @classmethod
    def prepare(cls, artifact: Path, source: Manifest, out: Path) -> BuildOutput:
        check_output(artifact, out)
        out.mkdir(parents=True, exist_ok=True)
        for stale in (MANIFEST_NAME, LEGACY_BUILD_RECORD):
            (out / stale).unlink(missing_ok=True)
        return cls(artifact, source, out)

    def path(self, name: str) -> Path:
        return self.folder / name

    def add(self, role: str, name: str) -> None:
        """A file the builder wrote into the folder, listed under `role`."""
        if not (self.folder / name).is_file():
            raise BuildError(f"the build did not write {name} ({role}) into {self.folder}")
        self.files[role] = name

    def copy(self, role: str) -> None:
        """The export's file for `role`, copied as it is. (A copy, not a hard link: `cabinlm export` into
        the same folder again would rewrite a linked file under the build's checksum.)"""
        name = self.source.files[role].path
        dst = self.folder / name
        dst.unlink(missing_ok=True)
        shutil.copy2(self.artifact / name, dst)
        self.files[role] = name

    def copy_if_present(self, *roles: str) -> None:
        for role in roles:
            if role in self.source.files:
                self.copy(role)

    def finish(self, spec: BuildSpec, profile_name: str) -> Manifest:
        """Write manifest.json: the export's facts, the build's files and spec, validated as a load validates
        (the draft is only serialized; the manifest returned is the one Manifest.from_dict reads back)."""
        src = self.source
        draft = dataclasses.replace(
            src,
            files={role: FileEntry.of(self.folder, name) for role, name in self.files.items()},
            build=spec,
            lora=self.lora,
            format_version=FORMAT_VERSION,
            target=Target(profile_name, src.target.plan if src.target is not None else None, str(self.artifact.resolve())),
            quality=dataclasses.replace(src.quality, build={"cabinlm_version": __version__,
                                        "source_graph_sha256": src.files[FileRole.GRAPH].sha256, **self.quality}),
        )  # fmt: skip
        return save_validated(draft, self.folder)

    def update_quality(self, built: Manifest, **figures: Any) -> Manifest:
        """Add figures measured on the finished build (its own check) to its manifest."""
        self.quality.update(figures)
        built.quality.build = {**(built.quality.build or {}), **figures}
        built.save(self.folder)
        return built

