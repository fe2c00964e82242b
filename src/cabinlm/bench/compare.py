"""Two sets of records side by side: `cabinlm bench compare A.jsonl B.jsonl` and the summary that
`cabinlm bench --alternate` ends with.

Records compare when they measured the same thing (equal `tool` and `params`, Record.key). For each
such group and each numeric figure both sides have: the median and range (min-max) of A's rounds and
of B's, and, where both sides hold exactly one record for each of the same rounds, the ratio B/A of
every round and their median. A ratio taken within a round is the figure to trust on a machine whose
speed drifts over minutes: both builds ran back to back, under the same load.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from cabinlm.bench.records import Record, RecordsError


class NoComparableRecords(RecordsError):
    """The two sides share no (tool, params) group: nothing can be compared."""


@dataclass(frozen=True)
class Figure:
    """One figure of one group: A's and B's values in round order, and B/A per round where paired."""

    name: str
    a: tuple[float, ...]
    b: tuple[float, ...]
    ratios: tuple[float, ...] | None  # None: the rounds do not pair (different rounds, or repeats of one)

    @property
    def median_a(self) -> float:
        return float(statistics.median(self.a))

    @property
    def median_b(self) -> float:
        return float(statistics.median(self.b))

    @property
    def median_ratio(self) -> float | None:
        """The median of the paired ratios; unpaired, the ratio of the medians (None over a zero)."""
        if self.ratios:
            return float(statistics.median(self.ratios))
        return self.median_b / self.median_a if self.median_a else None


@dataclass(frozen=True)
class Group:
    """Records of A and of B with one tool and one set of parameters."""

    tool: str
    params: dict[str, Any]
    builds_a: tuple[str, ...]
    builds_b: tuple[str, ...]
    rounds_a: int
    rounds_b: int
    paired: bool
    figures: tuple[Figure, ...]


@dataclass(frozen=True)
class Comparison:
    groups: tuple[Group, ...]
    only_a: int  # groups only A has (not compared)
    only_b: int


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _pairs(a: list[Record], b: list[Record]) -> bool:
    """Each side has one record for each round, and the same rounds."""
    ra, rb = [r.round for r in a], [r.round for r in b]
    return len(set(ra)) == len(ra) and len(set(rb)) == len(rb) and set(ra) == set(rb)


def _group(a: list[Record], b: list[Record]) -> Group:
    a, b = sorted(a, key=lambda r: r.round), sorted(b, key=lambda r: r.round)
    paired = _pairs(a, b)
    names = [k for k in a[0].figures if all(_number(r.figures.get(k)) for r in a + b)]
    figures = []
    for k in names:
        va = tuple(float(r.figures[k]) for r in a)
        vb = tuple(float(r.figures[k]) for r in b)
        ratios = tuple(y / x for x, y in zip(va, vb)) if paired and all(va) else None
        figures.append(Figure(k, va, vb, ratios))
    return Group(tool=a[0].tool, params=dict(a[0].params), builds_a=tuple(dict.fromkeys(r.build for r in a)),
                 builds_b=tuple(dict.fromkeys(r.build for r in b)), rounds_a=len(a), rounds_b=len(b), paired=paired,
                 figures=tuple(figures))  # fmt: skip


def compare(a: list[Record], b: list[Record], what_a: str = "A", what_b: str = "B") -> Comparison:
    """A's records against B's, group by group (in A's order). Raises NoComparableRecords, naming
    WHAT_A and WHAT_B, when no group is on both sides."""
    by_a: dict[tuple[str, str], list[Record]] = {}
    by_b: dict[tuple[str, str], list[Record]] = {}
    for r in a:
        by_a.setdefault(r.key, []).append(r)
    for r in b:
        by_b.setdefault(r.key, []).append(r)
    common = [k for k in by_a if k in by_b]
    if not common:
        if not a or not b:
            empty = what_a if not a else what_b
            raise NoComparableRecords(f"{empty}: no records to compare")
        raise NoComparableRecords(
            f"{what_a} and {what_b} have no records with the same tool and parameters "
            f"({len(by_a)} and {len(by_b)} groups); compare runs of one tool with the same options"
        )
    groups = tuple(_group(by_a[k], by_b[k]) for k in common)
    return Comparison(groups, only_a=len(by_a) - len(common), only_b=len(by_b) - len(common))


def split_by_build(records: list[Record], where: str) -> tuple[list[Record], list[Record]]:
    """The records of one file that holds two builds (as `cabinlm bench --alternate` writes them),
    split into the first build's and the second's, by manifest sha256 (else folder name)."""
    ident = lambda r: r.manifest_sha256 or r.artifact or r.engine  # noqa: E731
    order = list(dict.fromkeys(ident(r) for r in records))
    if len(order) != 2:
        raise NoComparableRecords(f"{where}: holds records of {len(order)} builds; one file compares when it holds "
                                  "exactly two (pass two files to compare any others)")  # fmt: skip
    return [r for r in records if ident(r) == order[0]], [r for r in records if ident(r) == order[1]]


def _num(x: float) -> str:
    a = abs(x)
    if float(x).is_integer() and a < 1e15:
        return f"{int(x)}"
    return f"{x:.0f}" if a >= 1000 else f"{x:.1f}" if a >= 100 else f"{x:.2f}" if a >= 1 else f"{x:.3g}"


def lines(c: Comparison, what_a: str = "A", what_b: str = "B") -> list[str]:
    """The comparison as text: per group a heading (tool and parameters, the builds and rounds), then
    a row per figure (A's median and range, B's, B/A per round and its median)."""
    out: list[str] = []
    for g in c.groups:
        params = " ".join(f"{k}={v}" for k, v in g.params.items())
        out.append(f"{g.tool}: {params}")
        out.append(f"  {what_a}: {', '.join(g.builds_a)}, {g.rounds_a} round{'s' * (g.rounds_a != 1)}   "
                   f"{what_b}: {', '.join(g.builds_b)}, {g.rounds_b} round{'s' * (g.rounds_b != 1)}"
                   + ("" if g.paired else "   (rounds not paired: ratio of the medians)"))  # fmt: skip
        width = max([len(f.name) for f in g.figures] + [6])
        out.append(f"  {'figure':<{width}}  {what_a + ' median (min-max)':<26}{what_b + ' median (min-max)':<26}"
                   f"{'B/A per round' if g.paired else '':<24}median B/A")  # fmt: skip
        for f in g.figures:
            cell = lambda v: f"{_num(statistics.median(v))} ({_num(min(v))}-{_num(max(v))})"  # noqa: E731
            per_round = " ".join(f"{r:.3f}" for r in f.ratios) if f.ratios else ""
            ratio = "n/a" if f.median_ratio is None else f"{f.median_ratio:.3f}"
            out.append(f"  {f.name:<{width}}  {cell(f.a):<26}{cell(f.b):<26}{per_round:<24}{ratio}")
    if c.only_a or c.only_b:
        out.append(f"not compared: {c.only_a} group(s) only in {what_a}, {c.only_b} only in {what_b}")
    return out
