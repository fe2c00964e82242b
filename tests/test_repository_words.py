"""What ships speaks of the software, its users and its measurements, never of how it was developed,
and its documentation holds together.

Scanned: the tracked text files under src/, tests/, docs/, benchmarks/ and README.md (the built-in
profiles are under src/). They must not hold development narration ("stop 43", "issue 35", "#35"),
folders or builds named after development steps ("seats/s43", "b48"), absolute paths of a machine
(/work/..., /root/..., /home/...; /tmp/... in prose), or references to files outside the repository
(a DESIGN.md, a research or shared folder). Every relative Markdown link in docs/ and README.md must
name a file that exists and, with a #fragment, a heading of that file. docs/results.md stays a results
page (under 550 lines) and docs/ stays small (under 1 MB).

Each rule was checked against the tree it was written for: every one of them failed there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("src", "tests", "docs", "benchmarks", "README.md")
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# (name, pattern, where): where None = every scanned file; else a tuple of path prefixes.
RULES = [
    ("development stop", re.compile(r"\bstops? \d+\b", re.I), None),
    ("issue number", re.compile(r"\bissues? \d+|\bissue #?\d+|(?<![\w&/])#\d{1,4}\b", re.I), None),
    ("step-named folder or build", re.compile(r"\b[sb]4\d\b|(?<=_)[sb]4\d(?=_)|seats/s\d+"), None),
    ("absolute machine path", re.compile(r"(?<![\w.~])/(?:work|root|home)/[\w.]"), None),
    ("absolute /tmp path in prose", re.compile(r"(?<![\w.~])/tmp/\w"), ("docs/", "README.md", "src/cabinlm/profiles/")),
    ("a file outside the repository", re.compile(r"DESIGN\.md|\bresearch/|\bshared/|\.\./shared"), None),
    ("a removed folder", re.compile(r"docs/data/|docs/benchmarks\.md"), None),
    ("a commit hash", re.compile(r"\bcommits? [0-9a-f]{7,40}\b|\b(?:at|before|after|from) [0-9a-f]{7,12}\b"), None),
]


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *SCANNED], cwd=ROOT, capture_output=True, check=True)
    files = []
    for name in out.stdout.decode().split("\0"):
        if not name or name == THIS:
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images)
        files.append(name)
    return files


def hits() -> list[str]:
    found = []
    for name in tracked_text_files():
        text = (ROOT / name).read_text(errors="replace")
        for rule, pattern, where in RULES:
            if where is not None and not name.startswith(where):
                continue
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{name}:{line}: {rule}: {m.group(0)!r}")
    return found


def test_what_ships_does_not_speak_of_how_it_was_developed():
    found = hits()
    assert not found, f"{len(found)} hits:\n" + "\n".join(found[:80])


def test_the_rules_catch_what_they_are_for():
    """Each rule finds the words it was written against, and passes plain ones."""
    bad = ["see stop 43", "(issue 35)", "fixed in #12", "seats/s43/x.json", "the b48 build", "bench_b49_plain_1",
           "/work/main/src", "/root/.cache/x", "DESIGN.md's table", "../shared/research/qnn.md",
           "docs/benchmarks.md section 20", "commit 7ceb3b4", "built at 00b44d5"]
    ok = ["a decode step of 4 seats", "the 8-bit blocks", "issue a licence", "0x7ceb3b40", "sha256 ade428af",
          "docs/design.md, \"The cache\"", "qai_hub_models/models/_shared/llm/export.py", "s4 = 4",
          "(stop tokens ignored)", "vq, s16, s32 = q"]
    for text in bad:
        assert any(p.search(text) for _, p, _ in RULES), text
    for text in ok:
        assert not any(p.search(text) for _, p, _ in RULES), text


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    out, seen = set(), {}
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_a_heading(md: Path):
    broken = []
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{md.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_section_the_code_cites_exists():
    """A comment that cites docs/design.md or docs/results.md by a section name cites a heading there."""
    cited = re.compile(r"docs/(design|results)\.md,? \(?\"([^\"]+)\"")
    titles = {page: {line.lstrip("#").strip() for line in (ROOT / f"docs/{page}.md").read_text().splitlines()
                     if line.startswith("#")} for page in ("design", "results")}  # fmt: skip
    missing = []
    for name in tracked_text_files():
        for m in cited.finditer((ROOT / name).read_text(errors="replace")):
            title = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", m.group(2))  # a title wrapped over comment lines
            if title not in titles[m.group(1)]:
                missing.append(f"{name}: docs/{m.group(1)}.md \"{title}\"")
    assert not missing, "\n".join(missing)


def test_the_results_page_is_a_page_and_docs_stay_small():
    lines = (ROOT / "docs/results.md").read_text().count("\n")
    assert lines < 550, f"docs/results.md has {lines} lines"
    size = sum(p.stat().st_size for p in (ROOT / "docs").rglob("*") if p.is_file())
    assert size < 1 << 20, f"docs/ holds {size / 2**20:.2f} MiB"


def test_every_benchmark_a_file_names_exists():
    """A script under benchmarks/ named in the docs, the code or the tests is there to run."""
    cited = re.compile(r"benchmarks/([\w.-]+\.(?:py|sh|cc))")
    missing = []
    for name in tracked_text_files():
        for m in cited.finditer((ROOT / name).read_text(errors="replace")):
            if not (ROOT / "benchmarks" / m.group(1)).exists():
                missing.append(f"{name}: benchmarks/{m.group(1)}")
    assert not missing, "\n".join(sorted(set(missing)))

