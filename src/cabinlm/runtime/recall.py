"""Memory beyond the window: the archive of what left it, and what the recall region holds for a turn
(docs/design.md, "The recall region").

    Archive    every message of the dialogue (role, exact token ids, turn) from the moment its first
               token leaves the window, on the host, bounded: the oldest dropped first, the opening
               exchange (turn 1) always kept. JSON-able, so a session file carries it.
    Recaller   before a user turn: the archived messages cut into pieces of at most PIECE_TOKENS, ranked
               against the new message with BM25 (bm25s), and the region filled with the conversation's
               opening request, then the best-scoring pieces in stream order, each rendered with the chat
               template's role pieces under a short header, up to R tokens. Nothing relevant: the
               opening request alone. Nothing archived yet: nothing (the region stays empty).
    TextRecall a text stream's region (`cabinlm perplexity`: no turns, no template): pieces of the
               evicted text ranked against the window's latest text, refilled every N tokens.

The Dialogue (runtime/dialogue.py) refreshes the region with one prefill of at most R tokens when its
content changes, and skips it when the chosen text is the region's already.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from cabinlm.contract.errors import OptionError
from cabinlm.contract.manifest import ChatTemplate
from cabinlm.runtime.tokenizer import Tokenizer

HEADER = "Earlier in this conversation:"
PIECE_TOKENS = 48  # a long message is cut into pieces of at most this many tokens, each ranked alone
DEFAULT_ARCHIVE_MB = 16.0
MESSAGE_OVERHEAD = 64  # bytes counted per archived message beside its ids (4 bytes each) and text
WORD = re.compile(r"\w+")


def check_archive_mb(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1 << 20):
        raise OptionError(f"--recall-archive-mb must be a positive number of MB (up to 1048576), got {value!r}")
    return float(value)


@dataclass
class Message:
    """One message of the dialogue: its role ("user" or "assistant"), its text's exact token ids (no
    template pieces), its turn (1 = the opening exchange) and the stream index of its turn's first
    token in the cache (it left the window when that token was evicted)."""

    role: str
    ids: list[int]
    turn: int
    start: int
    text: str = ""

    @property
    def nbytes(self) -> int:
        return 4 * len(self.ids) + len(self.text.encode()) + MESSAGE_OVERHEAD

    def to_dict(self) -> dict:
        return {"role": self.role, "ids": list(self.ids), "turn": self.turn, "start": self.start, "text": self.text}

    @classmethod
    def from_dict(cls, d: dict) -> Message:
        return cls(str(d["role"]), [int(t) for t in d["ids"]], int(d["turn"]), int(d["start"]), str(d.get("text", "")))


@dataclass
class Archive:
    """The messages that left the window (`kept`, in stream order) and those still in it (`live`)."""

    limit_bytes: int
    kept: list[Message] = field(default_factory=list)
    live: list[Message] = field(default_factory=list)
    dropped: int = 0  # messages dropped for the bound

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.kept)

    def add(self, message: Message) -> None:
        self.live.append(message)

    def left_window(self, oldest: int, tokenizer: Tokenizer) -> None:
        """Messages whose first token's stream index is below `oldest` (the window's oldest cached
        token) join the archive, their text decoded once; then the bound: oldest first, turn 1 kept."""
        moved = [m for m in self.live if m.start < oldest]
        if not moved:
            return
        self.live = [m for m in self.live if m.start >= oldest]
        for m in moved:
            m.text = tokenizer.decode(m.ids)
            self.kept.append(m)
        total = self.nbytes
        while total > self.limit_bytes:
            i = next((i for i, m in enumerate(self.kept) if m.turn > 1), None)
            if i is None:
                break
            total -= self.kept.pop(i).nbytes
            self.dropped += 1

    def clear(self) -> None:
        self.kept, self.live, self.dropped = [], [], 0

    def state(self) -> dict:
        return {"kept": [m.to_dict() for m in self.kept], "live": [m.to_dict() for m in self.live],
                "dropped": self.dropped}  # fmt: skip

    def restore(self, state: dict) -> None:
        self.kept = [Message.from_dict(d) for d in state["kept"]]
        self.live = [Message.from_dict(d) for d in state["live"]]
        self.dropped = int(state.get("dropped", 0))


@dataclass(frozen=True)
class Piece:
    role: str
    ids: tuple[int, ...]
    turn: int
    order: int  # position in stream order over every piece
    key: tuple[int, int, str, int] = (0, 0, "", 0)  # (its message's turn, start, role; its offset): what makes its terms


@dataclass(frozen=True)
class Choice:
    """What the region holds for a turn: its token ids, and the turns its pieces come from."""

    ids: tuple[int, ...]
    turns: tuple[int, ...]

    def report(self, refreshed: bool, ms: float, retrieval_ms: float = 0.0) -> dict:
        return {"turns": list(self.turns), "tokens": len(self.ids), "refreshed": refreshed, "prefill_ms": round(ms, 2),
                "retrieval_ms": round(retrieval_ms, 2)}  # fmt: skip


EMPTY = Choice((), ())


class Recaller:
    """Chooses and renders the region's text for a turn (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate, capacity: int):
        self.tok = tokenizer
        self.capacity = capacity
        enc = tokenizer.encode
        self.header = (enc(chat.system_prefix) + tokenizer.encode_text(HEADER) + enc(chat.system_suffix)
                       if chat.system_prefix else tokenizer.encode_text(HEADER + "\n"))  # fmt: skip
        self.roles = {"user": (enc(chat.user_prefix), enc(chat.user_suffix)),
                      "assistant": (enc(chat.assistant_prefix), enc(chat.assistant_suffix))}  # fmt: skip
        # each archived piece's BM25 terms, by Piece.key: an archived message never changes, so its
        # pieces' text is decoded and cut into words once (kept while the piece is in the archive)
        self._terms: dict[tuple[int, int, str, int], list[str]] = {}

    def render(self, role: str, ids) -> list[int]:
        head, tail = self.roles[role]
        return head + list(ids) + tail

    def pieces(self, archive: Archive) -> list[Piece]:
        out: list[Piece] = []
        for m in archive.kept:
            for a in range(0, max(len(m.ids), 1), PIECE_TOKENS):
                out.append(Piece(m.role, tuple(m.ids[a : a + PIECE_TOKENS]), m.turn, len(out), (m.turn, m.start, m.role, a)))
        return out

    def terms(self, pieces: list[Piece]) -> list[list[str]]:
        """Each piece's BM25 terms, made once per piece; those of pieces no longer archived are let go."""
        known = self._terms
        fresh = {p.key: known.get(p.key) or words(self.tok.decode(list(p.ids))) for p in pieces}
        self._terms = fresh
        return [fresh[p.key] for p in pieces]

    def choose(self, archive: Archive, query: str) -> Choice:
        """The region's text for a user turn whose message is `query` (module docstring)."""
        if not archive.kept:
            return EMPTY
        room = self.capacity - len(self.header)
        if room <= 0:
            return EMPTY
        opening = next((m for m in archive.kept if m.turn == 1 and m.role == "user"), None)
        chosen: list[tuple[int, list[int], int]] = []  # (stream order, rendered ids, turn)
        pieces = self.pieces(archive)
        skip = set()
        if opening is not None:  # the opening request first (cut to what fits), never ranked again
            first = self.render("user", opening.ids)
            overhead = len(first) - len(opening.ids)
            if len(first) > room:
                first = self.render("user", opening.ids[: max(room - overhead, 0)])
            if len(first) <= room and len(first) > overhead:
                chosen.append((-1, first, 1))
                room -= len(first)
            skip = {p.order for p in pieces if p.turn == 1 and p.role == "user"}
        ranked = [p for p in pieces if p.order not in skip]
        if ranked and room > 0:
            scores = bm25_scores(self.terms(ranked), words(query))
            for i in np.argsort(-scores, kind="stable"):
                if scores[i] <= 0:
                    break
                p = ranked[int(i)]
                ids = self.render(p.role, p.ids)
                if len(ids) <= room:
                    chosen.append((p.order, ids, p.turn))
                    room -= len(ids)
        if not chosen:
            return EMPTY
        chosen.sort(key=lambda c: c[0])  # stream order
        ids = list(self.header)
        for _, piece, _ in chosen:
            ids += piece
        return Choice(tuple(ids), tuple(sorted({t for _, _, t in chosen})))


def words(text: str) -> list[str]:
    """The terms BM25 ranks by: lowercase words, English stopwords left out, a few suffixes cut
    (parked, parking, parks -> park) so that a question matches the statement it asks about."""
    from bm25s.stopwords import STOPWORDS_EN

    out = []
    for w in WORD.findall(text.lower()):
        if w in STOPWORDS_EN:
            continue
        for suffix in ("ing", "ed", "es", "s"):
            if len(w) > len(suffix) + 2 and w.endswith(suffix):
                w = w[: -len(suffix)]
                break
        out.append(w)
    return out


def bm25_scores(documents: list[list[str]], query: list[str]) -> np.ndarray:
    """(documents,) float: BM25 scores (bm25s) of each document against `query`, both as their terms
    (words()); 0 for a document that shares no term with it."""
    import bm25s

    terms = query
    if not documents or not terms:
        return np.zeros(len(documents))
    corpus = [d or ["_"] for d in documents]  # "_": no document is empty (bm25s needs a vocabulary)
    index = bm25s.BM25()
    index.index(corpus, show_progress=False)
    return np.asarray(index.get_scores(terms), dtype=np.float64)


class TextRecall:
    """The region of a text stream with no turns (`cabinlm perplexity`): every `every` tokens, once text
    has left the window, the evicted text cut into pieces of PIECE_TOKENS (from the sink's end, so the
    pieces never move as more leaves), ranked with BM25 against the window's last QUERY_TOKENS, and the
    best that fit R joined in stream order: no header, no template pieces (the stream has none).
    Nothing relevant: the region is left empty. A piece's terms are made once."""

    QUERY_TOKENS = 64

    def __init__(self, tokenizer: Tokenizer, capacity: int, every: int):
        if every < 1:
            raise OptionError(f"--recall-every must be at least 1 token, got {every}")
        self.tok, self.capacity, self.every = tokenizer, capacity, every
        self._terms: list[list[str]] = []  # each whole piece's BM25 terms, in stream order (made once)

    def choose(self, evicted: np.ndarray, recent: np.ndarray) -> tuple[int, ...]:
        """The region's ids for the evicted text `evicted` (stream order) and the window's text `recent`."""
        whole = len(evicted) // PIECE_TOKENS  # only whole pieces: a piece's text never changes once made
        while len(self._terms) < whole:
            a = len(self._terms) * PIECE_TOKENS
            self._terms.append(words(self.tok.decode([int(t) for t in evicted[a : a + PIECE_TOKENS]])))
        if not whole or self.capacity < PIECE_TOKENS:
            return ()
        scores = bm25_scores(self._terms, words(self.tok.decode([int(t) for t in recent[-self.QUERY_TOKENS :]])))
        picked = []
        for i in np.argsort(-scores, kind="stable")[: self.capacity // PIECE_TOKENS]:
            if scores[i] <= 0:
                break
            picked.append(int(i))
        out: list[int] = []
        for i in sorted(picked):  # stream order
            out += [int(t) for t in evicted[i * PIECE_TOKENS : (i + 1) * PIECE_TOKENS]]
        return tuple(out)
