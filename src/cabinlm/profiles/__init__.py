"""Device profiles: one TOML file per target chip (builtin/*.toml), or a user's own file.

    list_profiles()                 -> ["cpu", "jetson-agx-orin-64gb", ...]
    load_profile("orin-x")          -> DeviceProfile (a built-in)
    load_profile("./my-board.toml") -> DeviceProfile (a user's file, same fields)

Standard library only. The built-in files ship as package data and are found through
importlib.resources, so they work from a wheel as well as from a source checkout.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

from cabinlm.profiles.schema import CPU_ENGINE_FIELDS, DeviceProfile, Engine, ProfileError, parse_profile, read_profile_file

__all__ = [
    "DeviceProfile",
    "Engine",
    "ProfileError",
    "builtin_profile_text",
    "cpu_engine",
    "list_profiles",
    "load_profile",
]

_BUILTIN = "builtin"
_SUFFIX = ".toml"


def _builtin_dir():
    return resources.files(__name__) / _BUILTIN


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(
        entry.name[: -len(_SUFFIX)] for entry in _builtin_dir().iterdir() if entry.name.endswith(_SUFFIX)
    )


def builtin_profile_text(name: str) -> str:
    """The TOML text of a built-in profile (with its source comments), e.g. to copy and edit."""
    if name not in list_profiles():
        raise _unknown(name)
    return (_builtin_dir() / f"{name}{_SUFFIX}").read_text(encoding="utf-8")


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A built-in profile by name, or a profile TOML file by path."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    text = str(name_or_path)
    if text in list_profiles():
        profile = parse_profile(builtin_profile_text(text), f"<builtin profile {text}>")
        if profile.name != text:
            raise ProfileError(f"built-in profile file {text}{_SUFFIX} declares name {profile.name!r}; they must match")
        return profile
    path = Path(text).expanduser()
    if path.suffix == _SUFFIX or path.exists() or "/" in text or "\\" in text:
        if not path.is_file():
            known = ", ".join(list_profiles())
            raise ProfileError(f"{text}: no such profile file; pass a .toml file or one of: {known}")
        return read_profile_file(path)
    raise _unknown(text)


def _unknown(name: str) -> ProfileError:
    return ProfileError(
        f"{name!r} is not a built-in profile ({', '.join(list_profiles())}) and not a .toml file; "
        "pass one of those names or the path of your own profile file"
    )


def cpu_engine(profile: DeviceProfile) -> DeviceProfile:
    """This chip run by its CPU (`cabinlm build --engine cpu`): ONNX Runtime's CPU provider and what
    it runs, as the built-in cpu profile says (CPU_ENGINE_FIELDS), with the chip's memory, budget,
    bandwidth (the CPU reads the same DRAM) and CPU (cabinlm's kernels compiled for cpu_arch /
    cpu_march). Named NAME-cpu. A dynamic-shape CPU profile is its own CPU engine."""
    if profile.execution_provider == "CPUExecutionProvider" and not profile.static_shapes:
        return profile
    if profile.cpu_arch is None:
        raise ProfileError(f"{profile.source}: profile {profile.name} does not name its CPU (cpu_arch, cpu_march), which "
                           "--engine cpu compiles cabinlm's kernels for; add them to a copy of the profile (see the "
                           "built-in sa8775p profile)")  # fmt: skip
    host = load_profile("cpu")
    return dataclasses.replace(profile, name=f"{profile.name}-cpu", description=f"{profile.name}'s CPU ({profile.cpu or profile.cpu_arch}) "
                               "through ONNX Runtime's CPU execution provider", htp_arch=None, soc_model=None,
                               htp_process_limit_bytes=None, tensorrt_workspace_mib=None,
                               **{name: getattr(host, name) for name in CPU_ENGINE_FIELDS})  # fmt: skip
