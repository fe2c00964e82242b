#!/usr/bin/env python3
"""Generate src/cabinlm/engines/ort_fused/kernels/ort_api_entries.h from ONNX Runtime's C API header.

cabinlm's kernels include no ONNX Runtime header: they call the dozen entries of OrtApi (a struct of
function pointers that ONNX Runtime only appends to) through the table OrtApiBase::GetApi returns.
What an entry is -- its slot in that table and its C signature -- is read here from the real
onnxruntime_c_api.h (third_party/onnxruntime/, the release named in HEADER_SOURCE), never typed by hand:

    kApiVersion             the header's ORT_API_VERSION: the version register.cc asks GetApi for
                            (every onnxruntime 1.N serves versions 1..N, the same table)
    enum Entry              kName = slot, for each name in ENTRIES
    Signature<kName>::type  the entry's function-pointer type, from its declaration in struct OrtApi
    OrtErrorCode, ONNXTensorElementDataType   the header's own enums, values as it defines them

Parsing (standard library only, no compiler, no preprocessor run): every `;`-terminated statement at
the top level of `struct OrtApi { ... }` is one slot. A statement that starts with a function-like
macro the header defines (ORT_API2_STATUS, ORT_CLASS_RELEASE, ...) is expanded by that macro's first
#define (`##` pasting and __VA_ARGS__ included), then read as `RET (ORT_API_CALL* Name)(PARAMS)`.
A preprocessor conditional inside the struct, a statement that is not a function pointer, or a
name seen twice is an error: the numbering would then be ambiguous.

    python tools/gen_ort_api.py            write the generated header
    python tools/gen_ort_api.py --check    exit 1 if the committed header differs from what this writes

Adapted from the survey of onnxruntime_c_api.h across releases 1.18-1.31 that checked every slot
used here against onnxruntime_c_api.cc's static_asserts and the released libraries.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "third_party" / "onnxruntime" / "onnxruntime_c_api.h"
OUT = ROOT / "src" / "cabinlm" / "engines" / "ort_fused" / "kernels" / "ort_api_entries.h"
# Where HEADER comes from. Its text is the v1.20.0 release's header (the oldest onnxruntime that
# pyproject.toml allows, so kApiVersion = 20 is served by every allowed release).
HEADER_SOURCE = ("microsoft/onnxruntime@b6e25c2add18adf61c47a2a8b3ed499ea62ea97a:"
                 "include/onnxruntime/core/session/onnxruntime_c_api.h (ONNX Runtime 1.20.0)")

# The OrtApi entries the kernels call (ort_api.h, register.cc), in the order they are emitted.
ENTRIES = (
    "CreateStatus",
    "CreateCustomOpDomain",
    "CustomOpDomain_Add",
    "AddCustomOpDomain",
    "GetTensorMutableData",
    "GetDimensionsCount",
    "GetDimensions",
    "GetTensorTypeAndShape",
    "KernelContext_GetInputCount",
    "KernelContext_GetInput",
    "KernelContext_GetOutput",
    "ReleaseTensorTypeAndShapeInfo",
    "KernelContext_ParallelFor",
)
ENUMS = ("OrtErrorCode", "ONNXTensorElementDataType")  # emitted with the header's values

# Annotations that mean nothing to the C++ type: SAL (_In_, _Outptr_, _In_reads_(n), ...) and the
# calling-convention / attribute macros (empty or attributes on the platforms cabinlm builds for).
_SAL = re.compile(r"\b_[A-Z][A-Za-z0-9_]*_\b(\s*\([^()]*\))?")
_NOISE = re.compile(r"\b(ORT_API_CALL|NO_EXCEPTION|ORT_MUST_USE_RESULT|ORT_ALL_ARGS_NONNULL)\b")


class ParseError(Exception):
    pass


@dataclass(frozen=True)
class Slot:
    index: int
    name: str
    declaration: str  # the statement as written in the header, whitespace collapsed
    signature: str  # "RET (*)(PARAMS)" with annotations removed
    since: str | None  # "1.17" where a \since comment says


def _blank(text: str) -> str:
    """text with comments and string literals blanked (same length and line breaks)."""

    def spaces(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', spaces, text, flags=re.S)


def _macros(text: str) -> dict[str, tuple[list[str], str]]:
    """The first #define of every function-like macro: name -> (parameters, body)."""
    out: dict[str, tuple[list[str], str]] = {}
    joined = re.sub(r"\\\n", " ", _blank(text))
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)(.*)$", joined, re.M):
        out.setdefault(m.group(1), ([p.strip() for p in m.group(2).split(",") if p.strip()], " ".join(m.group(3).split())))
    return out


def _split_args(s: str) -> list[str]:
    args, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*args, cur.strip()]


def _close(s: str, open_at: int, pair: str = "()") -> int:
    """Index of the bracket closing the one at open_at."""
    depth = 0
    for i in range(open_at, len(s)):
        depth += s[i] == pair[0]
        depth -= s[i] == pair[1]
        if depth == 0:
            return i
    raise ParseError(f"unbalanced {pair} in {s[open_at:open_at + 120]!r}")


def _cpp(entry: str) -> str:
    """The C++ name of an entry: KernelContext_GetInput -> kKernelContextGetInput."""
    return "k" + entry.replace("_", "")


def _expand(code: str, macros: dict[str, tuple[list[str], str]]) -> str:
    for _ in range(5):  # a macro's body may start with another macro
        m = re.match(r"(\w+)\s*\(", code)
        if not m or m.group(1) not in macros:
            return code
        params, body = macros[m.group(1)]
        end = _close(code, m.end() - 1)
        args = _split_args(code[m.end() : end])
        values = dict(zip([p for p in params if p != "..."], args))
        if params and params[-1] == "...":
            values["__VA_ARGS__"] = ", ".join(args[len(params) - 1 :])

        def sub(t: re.Match, values=values) -> str:
            if t.group(1):
                return "".join(values.get(part, part) for part in re.split(r"\s*##\s*", t.group(1)))
            return values.get(t.group(2), t.group(2))

        code = re.sub(r"(\w+(?:\s*##\s*\w+)+)|(\w+)", sub, body) + code[end + 1 :]
    return code


def _signature(code: str) -> tuple[str, str]:
    """(name, "RET (*)(PARAMS)") of a function-pointer member `RET (ORT_API_CALL* name)(PARAMS) ...`."""
    m = re.search(r"\(\s*(?:ORT_API_CALL\s*)?\*\s*(\w+)\s*\)\s*\(", code)
    if not m:
        raise ParseError(f"not a function-pointer member: {code[:160]!r}")
    params = code[m.end() : _close(code, m.end() - 1)]

    def clean(s: str) -> str:
        s = _NOISE.sub(" ", _SAL.sub(" ", s)).replace("OrtStatusPtr", "OrtStatus*")
        s = " ".join(s.split())
        s = re.sub(r"\s*\*\s*", "* ", s).replace("* *", "**").replace("* )", "*)").replace("* ,", "*,")
        return s.replace("(* ", "(*").strip()

    return m.group(1), f"{clean(code[: m.start()])} (*)({clean(params)})"


def parse_slots(text: str) -> list[Slot]:
    """Every slot of struct OrtApi, in table order."""
    code = _blank(text)
    m = re.search(r"\bstruct\s+OrtApi\s*\{", code)
    if not m:
        raise ParseError("no `struct OrtApi {` in the header")
    end = _close(code, m.end() - 1, "{}")
    macros = _macros(text)
    slots: list[Slot] = []
    start = m.end()
    for stmt_end in [i for i in range(m.end(), end) if code[i] == ";" and _depth(code, m.end(), i) == 0]:
        stmt = code[start:stmt_end]
        for line in stmt.splitlines():
            if re.match(r"\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b", line):
                raise ParseError(f"a preprocessor conditional inside struct OrtApi ({line.strip()!r}): "
                                 "the slots would depend on the build")
        stmt = re.sub(r"^\s*#.*$", " ", stmt, flags=re.M)
        declaration = " ".join(stmt.split())
        name, signature = _signature(_expand(declaration, macros))
        comments = text[start:stmt_end]
        since = re.findall(r"\\since\s+(?:[Vv]ersion\s+)?(\d+\.\d+)", comments)
        slots.append(Slot(len(slots), name, declaration, signature, since[-1] if since else None))
        start = stmt_end + 1
    if code[start:end].strip():
        raise ParseError(f"text after the last `;` of struct OrtApi: {code[start:end].strip()[:120]!r}")
    names = [s.name for s in slots]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ParseError(f"struct OrtApi names {twice} twice")
    return slots


def _depth(code: str, lo: int, hi: int) -> int:
    seg = code[lo:hi]
    return seg.count("(") - seg.count(")") + seg.count("{") - seg.count("}")


def parse_enum(text: str, name: str) -> list[tuple[str, int]]:
    """The values of `typedef enum NAME { A, B = 5, C, ... } NAME;` as the header defines them."""
    m = re.search(r"typedef\s+enum\s+" + name + r"\s*\{([^}]*)\}", _blank(text))
    if not m:
        raise ParseError(f"no `typedef enum {name}` in the header")
    out, value = [], -1
    for item in (i.strip() for i in m.group(1).split(",")):
        if not item:
            continue
        key, _, given = (p.strip() for p in item.partition("="))
        value = int(given, 0) if given else value + 1
        out.append((key, value))
    return out


def api_version(text: str) -> int:
    m = re.search(r"^\s*#\s*define\s+ORT_API_VERSION\s+(\d+)\b", text, re.M)
    if not m:
        raise ParseError("no `#define ORT_API_VERSION N` in the header")
    return int(m.group(1))


def generate(header: Path = HEADER) -> str:
    raw = header.read_bytes()
    text = raw.decode("utf-8-sig").replace("\r\n", "\n")
    slots = {s.name: s for s in parse_slots(text)}
    missing = [n for n in ENTRIES if n not in slots]
    if missing:
        raise ParseError(f"struct OrtApi of {header} has no {missing}")
    version = api_version(text)
    types = sorted({t for n in ENTRIES for t in re.findall(r"\bOrt[A-Z]\w*", slots[n].signature)} - set(ENUMS))
    lines = [
        "// Generated by tools/gen_ort_api.py from third_party/onnxruntime/onnxruntime_c_api.h: do not edit.",
        f"// Source: {HEADER_SOURCE}",
        f"// sha256 {hashlib.sha256(raw).hexdigest()}",
        f"// ORT_API_VERSION {version}; struct OrtApi has {len(slots)} entries.",
        "",
        "#pragma once",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        'extern "C" {  // opaque: the kernels hold these only by pointer',
        *(f"struct {t};" for t in types),
        "}",
        "",
        "namespace cabinlm_ort {",
        "",
        "// The C API version register.cc asks OrtApiBase::GetApi for: the header's ORT_API_VERSION.",
        "// onnxruntime 1.N serves versions 1..N (all the same table, which only grows at its end) and",
        "// returns nullptr for a later one.",
        f"constexpr uint32_t kApiVersion = {version};",
        "",
        "// An entry's slot in that table.",
        "enum Entry : size_t {",
    ]
    width = max(len(f"{_cpp(n)} = {slots[n].index},") for n in ENTRIES)
    for n in ENTRIES:
        since = f"  // \\since {slots[n].since}" if slots[n].since else ""
        lines.append(f"  {f'{_cpp(n)} = {slots[n].index},':<{width}}{since}".rstrip())
    lines.append("};")
    for enum in ENUMS:
        lines += ["", f"enum {enum} : int {{", *(f"  {k} = {v}," for k, v in parse_enum(text, enum)), "};"]
    lines += ["", "// An entry's function-pointer type, as struct OrtApi declares it.",
              "template <Entry E>", "struct Signature;"]
    for n in ENTRIES:
        lines += [f"// {slots[n].declaration}",
                  f"template <>\nstruct Signature<{_cpp(n)}> {{\n  using type = {slots[n].signature};\n}};"]
    lines += ["", "}  // namespace cabinlm_ort", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--header", type=Path, default=HEADER, help="onnxruntime_c_api.h to read")
    ap.add_argument("--out", type=Path, default=OUT, help="the header to write (or to compare with --check)")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    a = ap.parse_args(argv)
    try:
        text = generate(a.header)
    except (ParseError, OSError, UnicodeDecodeError) as e:
        print(f"gen_ort_api: {a.header}: {e}", file=sys.stderr)
        return 2
    if a.check:
        if not a.out.is_file() or a.out.read_text() != text:
            print(f"gen_ort_api: {a.out} is not what {a.header} generates; run `python tools/gen_ort_api.py`",
                  file=sys.stderr)
            return 1
        return 0
    a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
