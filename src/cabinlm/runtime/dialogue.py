"""Multi-turn dialogue on the fixed-size cache: pinned system prompt, rolling turns, streamed replies.

The cache after some turns (slots are fixed; only the window ring turns over):

    | sink | system prompt (pinned) | recalled text | ... older turns evicted ... | recent turns in the window |

With a recall region (an artifact exported with --recall R, recall not switched off), every message
that leaves the window is archived (runtime/recall.py), and before each user turn the region is
refilled with what the archive holds that is relevant to the new message: one prefill of at most R
tokens, skipped when the region's text would not change. Without it, StreamingLLM exactly.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from cabinlm.contract.errors import InputError
from cabinlm.runtime.interrupts import defer_sigint
from cabinlm.runtime.memory import rss_mb
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.recall import DEFAULT_ARCHIVE_MB, EMPTY, Archive, Choice, Message, Recaller, check_archive_mb
from cabinlm.runtime.reply import Reply, decode_reply
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.speculative import Drafting, PlainDecoding
from cabinlm.runtime.stops import StopStrings, cut_at_stop
from cabinlm.runtime.template import Template, system_overflow
from cabinlm.runtime.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from cabinlm.runtime.grammar import Constraint


class LongMessages(str, enum.Enum):
    """What a user message longer than the window gets."""

    REFUSE = "refuse"  # an InputError, nothing fed
    STREAM = "stream"  # fed in chunks like any other; its start leaves the window before the reply


@dataclass
class TurnResult:
    turn: int
    reply: str
    prompt_tokens: int
    new_tokens: int
    cache_tokens: int
    cache_bytes: int  # the cache buffers' real size (K, V and scales), read from the arrays
    evicted_tokens: int
    decode_tok_s: float
    prefill_tok_s: float
    rss_mb: float
    finish: str  # "stop" (a stop id or stop string), "length" (max_new_tokens), "interrupted" (Ctrl-C or should_stop)
    backend: str  # what the decoder ran on (Decoder.device), e.g. "onnxruntime-cpu"
    drafted_tokens: int = 0  # speculative decoding: tokens drafted by prompt lookup in this reply
    accepted_tokens: int = 0  # and how many of them the model accepted
    # what the recall region held for this turn: {"turns", "tokens", "refreshed", "prefill_ms",
    # "retrieval_ms"}; None without a recall region (or with recall switched off)
    recall: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class Dialogue:
    def __init__(
        self,
        decoder: Decoder,
        tokenizer: Tokenizer,
        system: str | None = None,
        sampler: Sampler | None = None,
        max_new_tokens: int = 256,
        long_messages: LongMessages = LongMessages.REFUSE,
        drafting: Drafting | None = None,
        recall: bool = True,
        archive_mb: float = DEFAULT_ARCHIVE_MB,
    ):
        """drafting: what the reply loop verifies after each token (runtime/speculative.py); None:
        plain decoding. PromptLookupDrafting gives the same tokens as plain decoding, greedy or
        sampled in distribution, in fewer steps. runtime/assembly.py makes dialogues with the
        artifact's default."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.long_messages = LongMessages(long_messages)
        self.decoder = decoder
        self.tok = tokenizer
        self.chat = decoder.manifest.chat
        self.template = Template(tokenizer, self.chat)
        self.stop_ids = set(decoder.manifest.stop_ids)
        self.system = system if system is not None else self.chat.default_system
        self.sampler = sampler or Sampler()
        self.max_new_tokens = max_new_tokens
        self.drafting = drafting if drafting is not None else PlainDecoding()
        # recall: the artifact's recall region in use (False: StreamingLLM exactly, the region left empty)
        self.recall = bool(recall) and decoder.layout.recall > 0
        self.archive = Archive(int(check_archive_mb(archive_mb) * 2**20))
        self.recaller = Recaller(tokenizer, self.chat, decoder.layout.recall) if decoder.layout.recall else None
        self.prompt_logits: np.ndarray | None = None  # the last prompt's last token's logits (vocab,)
        self.region: Choice = EMPTY  # what the recall region holds now
        self.reset()

    def reset(self) -> None:
        """Start over: empty cache, system prompt pinned again."""
        self.decoder.reset()
        self.drafting.reset()
        self.turns = 0
        self._pending: list[int] = []  # tokens that close the previous turn, fed with the next prompt
        self.archive.clear()
        self.region = EMPTY
        ids = self.template.start(self.system)  # the BOS a model may need, and the system prompt
        if ids:
            why = system_overflow(len(ids), self.decoder.layout, "shorten it")
            if why is not None:
                raise InputError(f"the system prompt is {why}")
            self.decoder.feed(ids, pin=True)

    @property
    def adapter(self) -> str | None:
        """The seat's switchable LoRA adapter (None: the base model)."""
        return self.decoder.adapter

    def set_adapter(self, name: str | None) -> None:
        """Answer with another adapter from now on. The cache is rebuilt from the seat's history with the
        new adapter (its K/V came from the old one), so the next reply is the one a fresh seat with this
        adapter, fed the same history, gives (Decoder.set_adapter)."""
        self.decoder.set_adapter(name)

    def render_user(self, text: str, tool: bool = False) -> list[int]:
        return self.template.user(text, tool)

    def state(self) -> dict:
        """The dialogue's own state beyond the cache (for session files): JSON-able."""
        return {
            "turns": self.turns,
            "pending": list(self._pending),
            "system": self.system,
            "rng": self.sampler.rng.bit_generator.state,
            "recall": {"region": list(self.region.ids), "turns": list(self.region.turns)},
        }

    def archive_state(self) -> dict:
        """The archive (runtime/recall.py), JSON-able: a session file keeps it beside state()'s header."""
        return self.archive.state()

    def restore(self, state: dict, archive: dict | None = None) -> None:
        """state(): the dialogue's own; archive: archive_state() (None: an empty archive)."""
        self.turns = int(state["turns"])
        self._pending = [int(t) for t in state["pending"]]
        self.system = state["system"]
        self.sampler.rng.bit_generator.state = state["rng"]
        recall = state.get("recall")  # absent in a session file written before the recall region existed
        self.region = EMPTY if recall is None else Choice(tuple(int(t) for t in recall["region"]),
                                                          tuple(int(t) for t in recall["turns"]))  # fmt: skip
        if archive is not None:
            self.archive.restore(archive)
        else:
            self.archive.clear()

    def _refresh_region(self, text: str) -> dict | None:
        """Before a user turn (Ctrl-C held by the caller): the region refilled for `text` when what it
        should hold changed; one prefill of at most R tokens that never touches the window's K/V."""
        if not self.recall:
            return None
        t0 = time.perf_counter()
        choice = self.recaller.choose(self.archive, text)
        chose = (time.perf_counter() - t0) * 1e3  # BM25 over the archive's pieces, on the host
        if choice.ids == self.region.ids:
            return choice.report(False, 0.0, chose)
        t0 = time.perf_counter()
        dec = self.decoder
        dec.begin_recall()
        self.region = EMPTY  # the region is empty from here until the feed below completes
        if choice.ids:
            dec.feed(choice.ids, pin="recall")
        self.region = choice
        return choice.report(True, (time.perf_counter() - t0) * 1e3, chose)

    def _archive_user(self, text: str) -> None:
        """The user's message joins the archive, from the stream index its first token is fed at."""
        if self.recall:
            self.archive.add(Message("user", self.tok.encode_text(text), self.turns, self.decoder.cache.seen))

    def _feed_frame(self, text: str, head: list[int], embeds: np.ndarray, tail: list[int]) -> dict | None:
        """A user turn's new camera frame, and its head (the template's user head, the image's prefix
        tokens), before the tail the caller feeds (Ctrl-C held by the caller). Without a recall region in
        the layout: head, frame, in stream order. With one the frame ranks before the window and a new
        frame empties the region (contract/slots.py): the frame, then the region refilled for `text`,
        then the head, so the turn's tokens are fed in the order of their ranks (docs/design.md, "The
        recall region"); a frame that comes before the sink is full keeps the head first.
        Returns the region's report (_refresh_region), None without one."""
        dec = self.decoder
        first = bool(dec.layout.recall) and dec.cache.sink_fill == dec.layout.sink
        if head and not first:
            dec.feed(head)
        dec.cache.begin_frame()
        if dec.layout.recall:
            self.region = EMPTY  # begin_frame emptied it
        image_ids = np.full(len(embeds), dec.manifest.vision.image_token_id, dtype=np.int64)
        dec.feed(image_ids, pin="image", embeds=embeds)
        recalled = self._refresh_region(text)
        self._archive_user(text)
        if head and first:
            dec.feed(head)
        return recalled

    def _archive_left(self) -> None:
        """Messages whose first token left the window join the archive."""
        if not self.recall:
            return
        c = self.decoder.cache
        if not c.evicted:
            return
        window = c.slot_token[self.decoder.layout.window_start :]
        held = window[window >= 0]
        self.archive.left_window(int(held.min()) if len(held) else c.seen, self.tok)

    def ask(self, text: str, on_text: Callable[[str], None] | None = None, image=None, *,
            should_stop: Callable[[], bool] | None = None, stop: Sequence[str] = (),
            constraint: Constraint | None = None, tool: bool = False,
            on_token: Callable[[int], None] | None = None) -> TurnResult:
        """One user turn: feed the prompt, stream the reply through on_text, return the turn's numbers.

        image (a path or PIL image; vision-language models): a new camera frame. Its tokens replace the
        previous frame's in the cache's pinned image region and sit at the start of this user turn:
            user_prefix | <image> x image_tokens (pinned region) | text + user_suffix + assistant_prefix
        (Qwen2-VL: <|vision_start|> before the image tokens, <|vision_end|> after, as its processor lays
        out one image: VisionSpec.image_prefix / image_suffix; LLaVA has neither).

        should_stop: called before each reply token is chosen (the prompt is in the cache by then, and
        every token chosen so far); True ends the reply there as Ctrl-C does (finish "interrupted"), the
        turn closed as usual. A server stops the reply of a client that went away with it.

        stop: stop strings (runtime/stops.py): the reply ends at the first one, which it does not
        show; on_text never sees text that could still turn out to be one. The cache holds every token
        chosen (the stop string's included), as after any reply.

        constraint: what this reply's tokens must follow (runtime/grammar.py), through the sampler:
        drafting stays lossless under it.

        tool: `text` is tool results (runtime/tools.CallStyle.results), fed as the template's tool
        turn where it has one, else as a user turn.

        on_token: each reply token as it joins the reply, before on_text gets the text it adds.
        """
        dec = self.decoder
        frame = None
        if image is not None and tool:
            raise InputError("a tool result carries no camera frame")
        if image is not None:
            if dec.vision is None:
                raise InputError("this model has no vision input; export a vision-language model to send images")
            embeds = dec.vision.encode(image)  # an unreadable image is refused here, before anything is fed
            vision = dec.manifest.vision  # the tokens its processor puts around an image (Qwen2-VL: <|vision_start|> ...)
            head = self._pending + self.template.user_head(image=True) + list(vision.image_prefix)
            tail = list(vision.image_suffix) + self.template.user_tail(text)
            frame = (head, embeds, tail)
            prompt = head + [dec.manifest.vision.image_token_id] * len(embeds) + tail
            text_tokens = len(head) + len(tail)
        else:
            prompt = self._pending + self.render_user(text, tool)
            text_tokens = len(prompt)
        W = dec.layout.window
        if text_tokens > W and self.long_messages == LongMessages.REFUSE:
            raise InputError(
                f"this message is {text_tokens} tokens but the window holds {W}; the start of it would be "
                f"evicted before the reply. Shorten it, or re-export with --window {text_tokens} or more"
            )
        self.turns += 1
        stream = StreamDecoder(self.tok)
        stops = StopStrings(stop)
        self.sampler.constraint = constraint
        reply = Reply()
        prefilled = False
        recalled = None
        reply_start = dec.cache.seen
        t_prefill = time.perf_counter()
        t_decode = t_prefill

        def emit(token: int) -> None:
            if on_token is not None:
                on_token(token)
            delta = stops.push(stream.push(token))
            if delta and on_text:
                on_text(delta)

        def ended() -> bool:
            return stops.stopped or (should_stop is not None and should_stop())

        try:
            # The prompt joins the cache whole: its chunks run with Ctrl-C held (an interrupt then ends
            # the turn before any reply token), so the cache never holds half a turn.
            with defer_sigint():
                if frame is None:
                    if not tool:
                        recalled = self._refresh_region(text)
                    self._archive_user(text)
                    logits = dec.feed(prompt)
                else:
                    recalled = self._feed_frame(text, *frame)
                    logits = dec.feed(frame[2])
                prefilled = True
                self.prompt_logits = logits
                self._pending = []
                self.drafting.observe(prompt)
            t_decode = time.perf_counter()
            reply_start = dec.cache.seen
            reply = decode_reply(dec, self.sampler, logits, self.max_new_tokens, self.stop_ids, emit, self.drafting,
                                 ended)  # fmt: skip
        except KeyboardInterrupt:
            reply.finish = "interrupted"
        finally:
            self.sampler.constraint = None
        t_end = time.perf_counter()
        reply_ids, finish = reply.ids, reply.finish
        tail = stops.push(stream.flush()) + stops.flush()
        if tail and on_text:
            on_text(tail)
        reply_text = self.tok.decode(reply_ids)
        if stops.stops:
            reply_text, found = cut_at_stop(reply_text, stops.stops)
            if found:
                finish = "stop"
        if prefilled:
            # Close the assistant turn in the cache as the template would have rendered it.
            self._pending = reply.unfed + self.template.closing()
            if self.recall and reply_ids:
                self.archive.add(Message("assistant", list(reply_ids), self.turns, reply_start))
            self._archive_left()
        decode_s = t_end - t_decode
        return TurnResult(
            turn=self.turns,
            reply=reply_text,
            prompt_tokens=len(prompt),
            new_tokens=len(reply_ids),
            cache_tokens=dec.cache.length,
            cache_bytes=dec.backend.nbytes(),
            evicted_tokens=dec.cache.evicted,
            decode_tok_s=round(len(reply_ids) / decode_s, 2) if decode_s > 0 and reply_ids else 0.0,
            prefill_tok_s=round(len(prompt) / (t_decode - t_prefill), 2) if prefilled and t_decode > t_prefill else 0.0,
            rss_mb=round(rss_mb(), 1),
            finish=finish,
            backend=dec.device,
            drafted_tokens=reply.drafted,
            accepted_tokens=reply.accepted,
            recall=recalled,
        )

    def add_turn(self, text: str, reply: str, image=None, tool: bool = False) -> TurnResult:
        """A past exchange fed into the cache without generating (a history a client sends): the user
        turn exactly as ask() feeds it, then `reply` as the assistant's answer (its text encoded as
        plain text, fed in chunks), the turn closed as a generated reply's is."""
        result = self.ask(text, image=image, should_stop=lambda: True, tool=tool)  # the prompt only; no token chosen
        ids = self.template.text(reply)
        if ids:
            if self.recall:
                self.archive.add(Message("assistant", list(ids), self.turns, self.decoder.cache.seen))
            self.decoder.feed(ids)
            self.drafting.observe(ids)  # the reply is text later turns may repeat
            self._archive_left()
        return result
