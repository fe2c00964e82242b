"""A request sized before it may take a seat or the model: what one request may make the model do.

    parsed request ─ Admission.measure (a worker of its own, not a seat's, never holding the model)
        characters   a text longer than its token limit could cover at the vocabulary's longest token
                     is refused without being tokenized (a 40 MB message costs a length, not 6 GB)
        tokens       every text tokenized by the template the seats use, on the seats' tokenizer made
                     safe across threads (SharedTokenizer): the system prompt against the pinned
                     slots, each user turn against the window (--long-messages refuse), what the
                     plan feeds against the request limit
    only what the seat's plan feeds is measured (the new messages, or the history fed again when the
    seat starts over): before the seat is claimed, and again by the seat's worker (before it takes
    the model) when the seat changed in between

A refusal is a RequestError (400, code "context_length_exceeded", OpenAI's code for a prompt that
does not fit): the request takes no seat and the model never sees it. The limit (--max-prompt-tokens,
default PROMPT_WINDOWS windows) bounds the work one request can queue for the other seats: a seat
that starts over from a history feeds all of it, and everything beyond a window of it is evicted
again before the reply.
"""

from __future__ import annotations

import threading

from cabinlm.contract.manifest import Manifest
from cabinlm.runtime.dialogue import LongMessages
from cabinlm.runtime.template import Template, system_overflow
from cabinlm.runtime.tokenizer import Tokenizer
from cabinlm.serve.history import SeatRecord, TurnPlan
from cabinlm.serve.conversation import Conversation
from cabinlm.serve.request_error import RequestError

PROMPT_WINDOWS = 4  # the default request limit, in windows


class SharedTokenizer:
    """The seats' tokenizer, safe to call from several threads: each call holds one lock. (The
    `tokenizers` object is not: Tokenizer.encode_text flips its special-token switch for the length of
    a call, and a second thread's call in between would read it flipped.) A seat's worker waits at
    most one message's tokenization of the admission thread; a second tokenizer would cost its
    memory again (290 MB for Gemma 3's)."""

    def __init__(self, inner: Tokenizer):
        self._inner = inner
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        with self._lock:
            return self._inner.encode(text, add_special_tokens)

    def encode_text(self, text: str) -> list[int]:
        with self._lock:
            return self._inner.encode_text(text)

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self._inner.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        with self._lock:
            return self._inner.token_to_id(token)

    def longest_entry(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry (a byte-level
        entry spells each byte as one character, a SentencePiece entry each character as one, a
        byte-fallback entry <0xNN> one byte as six), so a text of c characters is at least c / this
        many tokens."""
        with self._lock:
            vocab = self._inner._tk.get_vocab()  # runtime.tokenizer keeps the `tokenizers` object private
        return max(1, max((len(entry) for entry in vocab), default=1))


def _too_long(message: str) -> RequestError:
    return RequestError(message, param="messages", code="context_length_exceeded")


class Admission:
    """The checks of a request's size, on the seats' tokenizer (SharedTokenizer)."""

    def __init__(self, tokenizer: SharedTokenizer, manifest: Manifest, long_messages: LongMessages,
                 limit: int | None):  # fmt: skip
        self.template = Template(tokenizer, manifest.chat)  # type: ignore[arg-type]  # a Tokenizer, locked
        self.layout = manifest.cache
        self.image_tokens = manifest.vision.image_tokens if manifest.vision is not None else 0
        self.refuse_long = LongMessages(long_messages) is LongMessages.REFUSE
        self.limit = limit if limit is not None else PROMPT_WINDOWS * self.layout.window
        self.chars_per_token = tokenizer.longest_entry()

    def measure(self, conversation: Conversation, plan: TurnPlan, record: SeatRecord | None) -> int:
        """The tokens `plan` feeds before the reply on a seat holding `record` (conversation.system: the
        prompt the seat pins), or a RequestError: by characters before anything is tokenized, then by
        tokens. Only what the plan feeds is measured: a seat that holds a long history feeds its new
        messages, however long the history it was sent."""
        c, W, L = conversation, self.layout.window, self.chars_per_token
        first_given = len(c.exchanges) - len(plan.given)
        kept = record.exchanges[: plan.keep] if plan.rebuild and record is not None else []
        # (index, user message, reply text or None when fed as its recorded choices, choices fed)
        fed = [(i, c.exchanges[i][0], None if ex.choices is not None else c.exchanges[i][1].text,
                len(ex.choices or ())) for i, ex in enumerate(kept)]
        fed += [(i, c.exchanges[i][0], c.exchanges[i][1].text, 0) for i in range(first_given, len(c.exchanges))]
        fed.append((len(c.exchanges), c.prompt, None, 0))
        last = len(c.exchanges)
        # Characters first: a text of more than n x L characters is more than n tokens.
        if self.refuse_long:
            for i, user, _, _ in fed:
                if len(user.text) > W * L:
                    raise _too_long(self._long(i, last, f"{len(user.text)} characters, more than the {W} tokens of "
                                                        f"the window can hold (a token here covers at most {L})"))
        chars = sum(len(user.text) + len(reply or "") for _, user, reply, _ in fed)
        if chars > self.limit * L:
            raise _too_long(self._over(f"{chars} characters to feed before the reply, more than {self.limit} tokens can "
                                       f"hold (a token here covers at most {L})"))
        pinned = self.layout.sink + self.layout.pinned
        if plan.rebuild and c.system is not None and len(c.system) > pinned * L:
            raise _too_long(f"the system prompt is {len(c.system)} characters, more than the {pinned} pinned slots "
                            "can hold; shorten it")
        t = self.template  # each tokenization holds the tokenizer's lock: one text at a time
        if plan.rebuild and c.system is not None:
            why = system_overflow(len(t.start(c.system)), self.layout, "shorten it")
            if why is not None:
                raise _too_long(f"the system prompt is {why}")
        closing = len(t.closing())
        total = 0
        for i, user, reply, choices in fed:
            n = len(t.user(user.text))
            if self.refuse_long and n > W:
                raise _too_long(self._long(i, last, f"{n} tokens but the window holds {W}; the start of it would "
                                                    f"be evicted before the reply. Shorten it, or serve an export "
                                                    f"with --window {n} or more"))
            image = self.image_tokens if user.image is not None else 0
            total += n + image + closing + (len(t.text(reply)) if reply is not None else choices)
        if total > self.limit:
            raise _too_long(self._over(f"{total} tokens to feed before the reply, more than its limit of {self.limit}"))
        return total

    def _over(self, what: str) -> str:
        return (f"this request has {what}: one request may feed at most {self.limit} tokens (the seat starts over from "
                f"the history it is sent when it does not hold it; {self.layout.window} tokens fit in the window, the "
                "rest is evicted again before the reply). Send only the latest exchanges, or start the server with a "
                "larger --max-prompt-tokens")

    @staticmethod
    def _long(i: int, last: int, why: str) -> str:
        which = "this message" if i == last else f"the user message of exchange {i + 1}"
        return f"{which} is {why}"
