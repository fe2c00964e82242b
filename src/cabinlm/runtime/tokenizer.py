"""Tokenizer (the `tokenizers` file written at export) and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _Tokenizer

from cabinlm.contract.errors import ManifestError


class Tokenizer:
    def __init__(self, path: str | Path):
        try:
            self._tk = _Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise ManifestError(f"{path}: cannot read the tokenizer ({e}); re-export") from e
        self._shown: frozenset[int] = frozenset()
        self._hidden: frozenset[int] = frozenset()

    def show(self, tokens: set[str]) -> None:
        """Control tokens whose text decode() keeps (a tool-call opener that is a control token,
        Mistral's [TOOL_CALLS]: the reply's text then says where its calls begin); every other one
        stays hidden."""
        added = {i: t for i, t in self._tk.get_added_tokens_decoder().items() if t.special}
        self._shown = frozenset(i for i, t in added.items() if t.content in tokens)
        self._hidden = frozenset(added) - self._shown

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`, special-token strings (e.g. "<|im_end|>") becoming control tokens.
        For the chat template's pieces, which hold them; never for what a user typed."""
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of user text: a special-token string in it stays plain text, so a message that
        contains "<|im_end|>" cannot end its turn or forge another role's turn."""
        self._tk.encode_special_tokens = True
        try:
            return self._tk.encode(text, add_special_tokens=False).ids
        finally:
            self._tk.encode_special_tokens = False

    def decode(self, ids: list[int]) -> str:
        if self._shown and any(i in self._shown for i in ids):
            return self._tk.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False)
        return self._tk.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas.

    Decoding a token alone breaks multi-byte characters and word-joining spaces, so each delta is
    the difference between decoding a short tail of ids with and without the newest ones; a tail that
    ends in an incomplete character (U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the tail we decode
        self.read = 0  # ids already turned into text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        now = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""
