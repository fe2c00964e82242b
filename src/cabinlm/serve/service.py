"""The chat service behind the HTTP app: the loaded model, its seats, the worker threads.

    request ─ ChatService.admit (a thread of its own: the body decoded and checked, what the seat's plan
              would feed measured, admission.py) ─ ChatService.start ─ seat claimed (503 when none is
              free) ─ seat lock (arrival order)
              └ worker thread: plan (history.plan_turn; measured again if the seat changed meanwhile) ─
                images loaded ─ turns.answer holding the model (ModelTurns; passed on between tokens and
                between the exchanges of a history fed again) ─ seat saved (--sessions) ─ "done"
    Turn: the worker's events for the handler, in order:
        ("started", None)        the prompt is in the cache; the reply's tokens follow
        ("delta", text)          a piece of the reply
        ("call", event)          a piece of a tool call: (kind, index, value), turns.answer's on_call
        ("scores", [TokenScore]) the log probabilities of the tokens the next delta or call piece holds
        ("done", TurnOutcome)    the turn is closed and, with --sessions, saved
        ("error", exception)     nothing more follows

The event loop never runs the model; a worker never touches the HTTP connection. A handler whose
client went away calls Turn.cancel(); the worker ends the reply at its next token and closes the turn
as usual (or, still feeding a history, stops after the exchange it is on: the seat holds the exchanges
fed so far), so the seat stays consistent. The seat is busy until its worker is done, whatever the
handler does. A request refused on a seat it claimed new gives the seat back: a refused request holds
no seat.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import CabinlmError, InputError
from cabinlm.runtime.assembly import RuntimeConfig, open_runtime
from cabinlm.runtime.dialogue import Dialogue, LongMessages
from cabinlm.runtime.grammar import Compiled, GrammarError, Grammars
from cabinlm.runtime.limits import check_count
from cabinlm.runtime.template import Template
from cabinlm.runtime.call_styles import style_of
from cabinlm.runtime.tools import json_reply_grammar, tools_system
from cabinlm.serve.admission import Admission, SharedTokenizer
from cabinlm.serve.history import SeatRecord, TurnPlan, plan_turn
from cabinlm.runtime.model_turns import ModelTurns, share_model
from cabinlm.serve.schema import MAX_TOKENS_LIMIT, ChatRequest, RequestError, parse_chat_request, served_models
from cabinlm.serve.seats import Seat, SeatManager
from cabinlm.serve.store import SeatStore
from cabinlm.serve.turns import Frames, HistoryStopped, Sampling, TurnOutcome, answer

log = logging.getLogger("cabinlm.serve")
MAX_PROMPT_TOKENS = 1 << 24  # --max-prompt-tokens: a bound a typo cannot pass, far above any cache
STOPPING = RequestError("the server is stopping: the reply was cut short (the seat keeps it as far as it went); send "
                        "the request again once the server is back", status=503, code="server_stopping",
                        type="unavailable_error")  # fmt: skip


@dataclass(frozen=True)
class ServeConfig:
    artifact: Path
    seats: int = 1
    sessions: Path | None = None  # None: seats live in memory only
    max_new_tokens: int = 256  # a request's reply limit when it names none
    threads: int | None = None  # ONNX Runtime intra-op threads (None: all cores)
    long_messages: LongMessages = LongMessages.REFUSE
    model_id: str | None = None  # the name clients send as "model"; None: the exported model's name
    verify: bool = True  # check the artifact's files against the manifest's sha256 at start
    speculative: bool | None = None  # prompt-lookup drafts; None: the backend's default, as chat
    max_prompt_tokens: int | None = None  # what one request may feed before its reply; None: 4 windows
    recall: bool = True  # each seat fills the artifact's recall region (False: StreamingLLM exactly)
    recall_archive_mb: float = 16.0  # each seat's archive of what left its window, at most
    runtime: RuntimeConfig = field(init=False)  # what chat and bench are checked and opened by too

    def __post_init__(self) -> None:
        # A request's max_tokens has the same bound (schema.py); the rest are `cabinlm chat`'s checks
        # (runtime/assembly.py). The seats against this machine's memory and the model's default
        # system prompt against the pinned slots need the manifest: ChatService.open checks them
        # (open_runtime) before the model loads.
        check_count("max-new-tokens", self.max_new_tokens, 1, MAX_TOKENS_LIMIT)
        check_count("max-prompt-tokens", self.max_prompt_tokens, 1, MAX_PROMPT_TOKENS)
        runtime = RuntimeConfig(self.artifact, seats=self.seats, threads=self.threads, system=None, system_option=None,
                                max_new_tokens=self.max_new_tokens, long_messages=self.long_messages,
                                speculative=self.speculative, verify=self.verify, recall=self.recall,
                                recall_archive_mb=self.recall_archive_mb)  # fmt: skip
        object.__setattr__(self, "runtime", runtime)
        if self.model_id is not None and not self.model_id.strip():
            raise CabinlmError("--model-name must not be empty")


class Turn:
    """One request's turn as the handler sees it: the worker's events, and a way to stop the reply."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seat: Seat, request: ChatRequest,
                 on_end: Callable[[bool], None]):  # fmt: skip
        self.loop, self.seat, self.request = loop, seat, request
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.client_gone = False  # set by the HTTP handler when the client disconnected
        self._on_end = on_end
        self._ended = False

    def post(self, kind: str, value: Any = None) -> None:
        """From the worker thread. "done" and "error" are its last word: it touches the seat no more."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, kind, value)
        except RuntimeError:  # the event loop is closed (the server is stopping): nobody listens
            self.cancelled.set()

    def _deliver(self, kind: str, value: Any) -> None:
        if kind in ("done", "error"):
            self.end(answered=kind == "done")  # the seat is free before the handler answers
        self.events.put_nowait((kind, value))

    def end(self, answered: bool = False) -> None:
        """In the event loop's thread, once: the worker is done with the seat (answered: it closed a turn)."""
        if not self._ended:
            self._ended = True
            self._on_end(answered)

    async def next(self) -> tuple[str, Any]:
        return await self.events.get()

    def cancel(self) -> None:
        """The client went away: end the reply at the next token (a no-op once the turn is done)."""
        self.cancelled.set()


@dataclass(frozen=True)
class Admitted:
    """A request that passed ChatService.admit: what it was measured against."""

    request: ChatRequest
    record: SeatRecord | None  # the seat's record when it was measured (None: a new seat)
    plan: TurnPlan
    fed: int  # tokens the plan feeds before the reply
    grammar: Compiled | None = None  # what the reply must follow, compiled for this model


def model_name(source: str) -> str:
    """What clients send as "model": the exported model's alias or folder / file name."""
    name = Path(source.rstrip("/")).name if source else ""
    return name.removesuffix(".gguf") or "cabinlm"


class ChatService:
    def __init__(self, dialogues: list[Dialogue], model_id: str, *, store: SeatStore | None = None,
                 max_new_tokens: int = 256, max_prompt_tokens: int | None = None) -> None:  # fmt: skip
        self.dialogues = dialogues
        first = dialogues[0].decoder
        self.model_id = model_id
        self.device = first.device
        self.manifest = first.manifest
        self.adapters = first.manifest.lora.names if first.manifest.lora is not None else ()
        self.served = served_models(model_id, self.adapters)  # model id -> adapter: BASE, BASE:NAME
        # One tokenizer for every seat and the admission thread, made safe across threads.
        shared = SharedTokenizer(dialogues[0].tok)
        for d in dialogues:
            d.tok, d.template = shared, Template(shared, d.chat)  # type: ignore[arg-type]
        self.admission = Admission(shared, first.manifest, dialogues[0].long_messages, max_prompt_tokens)
        self.default_system = dialogues[0].chat.default_system
        self.style = style_of(self.manifest.chat, shared.token_to_id)  # how the model writes its tool calls
        self.max_new_tokens = max_new_tokens
        self.seats = SeatManager(dialogues)
        self.store = store
        self.resumed = self.seats.resume(store) if store is not None else []
        # the seats' turns on the model (their steps ride together where the build's seats decode together)
        self.model: ModelTurns = share_model([d.decoder for d in dialogues])
        self.started = time.time()
        # One worker per seat: every seat can have a turn in flight (they take the model in turns).
        self._executor = concurrent.futures.ThreadPoolExecutor(len(dialogues), thread_name_prefix="cabinlm-seat")
        self._turns: set[Turn] = set()
        self.stopping = False
        self.answered = 0  # requests answered since the start (cut-short replies too): GET /metrics
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> Grammars:
        """llguidance's view of the model's vocabulary: made once, by the first request with a grammar."""
        with self._grammars_lock:
            if self._grammars is None:
                first = self.dialogues[0].decoder
                path = first.folder / self.manifest.files[FileRole.TOKENIZER].path
                self._grammars = Grammars(path, list(self.manifest.stop_ids), self.manifest.model.vocab_size)
            return self._grammars

    def token_bytes(self, token: int) -> tuple[str, bytes | None]:
        """A token as logprobs name it: (its text, its bytes). The bytes are its piece of the reply's
        text (part of a character's UTF-8 where a character spans tokens); a control token, which a
        reply's text never shows, has its name and no bytes (None)."""
        tok = self.grammars.tokenizer
        raw = tok.decode_bytes([int(token)])
        if tok.is_special_token(int(token)):
            return raw.decode("utf-8", "replace"), None
        return raw.decode("utf-8", "replace"), raw

    @classmethod
    def open(cls, config: ServeConfig) -> ChatService:
        """Load the artifact once and make config.seats dialogues on it (weights held once), as
        `cabinlm chat` does (runtime/assembly.open_runtime: every check before the weights load)."""
        runtime = open_runtime(config.runtime)
        store = SeatStore(config.sessions) if config.sessions is not None else None
        name = config.model_id or model_name(runtime.manifest.model.source)
        return cls(runtime.dialogues(), name, store=store, max_new_tokens=config.max_new_tokens,
                   max_prompt_tokens=config.max_prompt_tokens)

    @property
    def vision(self) -> bool:
        return self.manifest.vision is not None

    def health(self) -> dict[str, Any]:
        seats = self.seats.seats.values()
        return {
            "status": "ok",
            "model": self.model_id,
            "backend": self.device,
            "vision": self.vision,  # image_url parts are taken
            "seats": {"total": self.seats.total, "taken": len(self.seats.seats), "busy": sum(s.busy for s in seats)},
            "sessions": None if self.store is None else str(self.store.folder),
            "uptime_s": round(time.time() - self.started, 1),
        }

    def _conversation(self, request: ChatRequest):
        """The request's conversation with the system prompt its seat pins: the model's default for
        none, and the request's tools listed after it (runtime/tools.py)."""
        conv = request.conversation
        system = conv.system if conv.system is not None else self.default_system
        system = tools_system(system, request.tools, self.manifest.chat)
        return conv if system == conv.system else dataclasses.replace(conv, system=system)

    def admit(self, body: Any) -> Admitted:
        """A decoded JSON body, checked whole before it may take a seat or the model (in a thread of its
        own, never a seat's: tokenizing a long history must not hold anybody up). RequestError when the
        request is malformed or more than the model can take."""
        request = parse_chat_request(body, self.model_id, self.style, self.adapters)
        conv = request.conversation
        if not self.vision and (conv.prompt.image or any(u.image for u, _ in conv.exchanges)):
            raise RequestError("this model has no vision input; send text only, or serve a vision-language artifact",
                               param="messages", code="images_not_supported")  # fmt: skip
        seat = self.seats.seats.get(request.seat)  # read only: the event loop may change it, measure() copes
        record = seat.record if seat is not None else None  # a new seat feeds everything
        conv = self._conversation(request)
        plan = self._plan(seat, record, conv, request.adapter)
        fed = self.admission.measure(conv, plan, record)
        grammar = None
        if request.grammar is not None:  # compiled here, never in the seat's turn
            try:
                grammar = self.grammars.compile(request.grammar)
            except GrammarError as e:
                message, param = self._grammar_fault(request, e)
                raise RequestError(message, param=param, code="unsupported_schema") from None
        return Admitted(request, record, plan, fed, grammar)

    @staticmethod
    def _plan(seat: Seat | None, record: SeatRecord | None, conv, adapter: str | None) -> TurnPlan:
        """plan_turn, started over where the seat answers with another adapter than the request's model
        names: its kept exchanges fed again with the new adapter."""
        plan = plan_turn(record, conv)
        if seat is not None and seat.dialogue.adapter != adapter and not plan.rebuild:
            plan = dataclasses.replace(plan, rebuild=True)
        return plan

    def _grammar_fault(self, request: ChatRequest, e: GrammarError) -> tuple[str, str | None]:
        """(message, param) of a grammar that did not compile: the tool whose parameters cannot be
        enforced, where one is at fault, else the grammar as a whole."""
        if request.grammar is not None and request.grammar.param == "tools":
            for i, tool in enumerate(request.tools):
                try:
                    self.grammars.compile(json_reply_grammar(tool.parameters, f"tools[{i}].function.parameters"))
                except GrammarError as each:
                    return str(each), each.param
        return str(e), e.param

    async def start(self, admitted: Admitted) -> Turn:
        """Claim the request's seat, wait for it, and start the turn in a worker thread."""
        if self.stopping:
            raise STOPPING
        request = admitted.request
        seat = self.seats.claim(request.seat)
        seat.requests += 1
        try:
            await seat.lock.acquire()
        except BaseException:  # the handler was cancelled while it waited
            self._leave(seat, answered=False)
            raise
        if self.stopping:  # it stopped while this request waited for its seat
            seat.lock.release()
            self._leave(seat, answered=False)
            raise STOPPING
        loop = asyncio.get_running_loop()

        def free_seat(answered: bool) -> None:  # only at the worker's last word: a gone handler frees no seat in use
            self._turns.discard(turn)
            seat.lock.release()
            self._leave(seat, answered)

        turn = Turn(loop, seat, request, free_seat)
        try:
            future = loop.run_in_executor(self._executor, self._work, turn, admitted)
        except BaseException:
            seat.lock.release()
            self._leave(seat, answered=False)
            raise
        self._turns.add(turn)
        future.add_done_callback(lambda _: turn.end())  # in case the worker could not post its last word
        return turn

    def _leave(self, seat: Seat, answered: bool) -> None:
        """A request is done with its seat. A seat claimed new whose requests all ended unanswered (refused,
        failed, or cut short) goes back to the free seats: a refused request holds no seat."""
        seat.requests -= 1
        if answered:
            seat.new = False
            self.answered += 1
        if seat.new and seat.requests == 0:
            self.seats.give_back(seat)

    def _work(self, turn: Turn, admitted: Admitted) -> None:
        """The worker thread: the whole turn, then one "done" or "error" event."""
        seat, request = turn.seat, turn.request
        conv = self._conversation(request)
        try:
            plan = self._plan(seat, seat.record, conv, request.adapter)
            if plan.rebuild and seat.dialogue.adapter != request.adapter:
                # The cache's K/V came from the other adapter: reset with this one; the plan feeds the
                # history again (the seat's own exchanges exactly, as generated).
                seat.dialogue.decoder.set_adapter(request.adapter, replay=False)
            if seat.record is not admitted.record:  # another request changed the seat since this one was measured
                self.admission.measure(conv, plan, seat.record)
            frames = Frames.load(conv, plan)  # a bad image is refused before the seat changes
            constraint = None if admitted.grammar is None else self.grammars.constraint(admitted.grammar)
            sampling = Sampling(request.max_tokens or self.max_new_tokens, request.temperature, request.top_p,
                                request.seed, request.stop, constraint, request.calls_tools,
                                self.style, request.logprobs)  # fmt: skip
            outcome = answer(seat, conv, plan, frames, sampling, self.model,
                             on_text=(lambda t: turn.post("delta", t)) if request.stream else (lambda t: None),
                             stopped=turn.cancelled.is_set,
                             on_prefilled=lambda: turn.post("started"),
                             on_call=(lambda *e: turn.post("call", e)) if request.stream else None,
                             on_scores=(lambda s: turn.post("scores", s))
                             if request.stream and request.logprobs is not None else None)  # fmt: skip
            outcome.saved = self._save(seat)
            seat.last = summary(outcome)
            seat.answered += 1
            turn.post("done", outcome)
        except HistoryStopped:  # the client went away (or the server is stopping) while its history was fed
            turn.post("error", STOPPING)
        except InputError as e:  # a message the model cannot take (too long, ...): the client's to fix
            turn.post("error", RequestError(str(e), code="invalid_input"))
        except CabinlmError as e:
            turn.post("error", e)
        except Exception as e:  # a bug: logged with its traceback, a 500 for the client
            log.exception("seat %s: the turn failed", seat.name)
            turn.post("error", e)

    def _save(self, seat: Seat) -> bool:
        if self.store is None:
            return False
        try:
            self.store.save(seat.name, seat.dialogue, seat.record)
            return True
        except (OSError, CabinlmError) as e:
            log.error("seat %s: could not save its session in %s (%s); the conversation goes on in memory",
                      seat.name, self.store.folder, e)  # fmt: skip
            return False

    def free(self, name: str) -> None:
        """Forget a seat's conversation (and its saved files): the seat takes a new name."""
        self.seats.free(name)
        if self.store is not None:
            self.store.delete(name)

    def stop(self) -> None:
        """The server is stopping: refuse new turns, end every reply in flight at its next token (their
        clients get a "server_stopping" error; the seats close their turns and are saved). Safe from a
        signal handler: it only sets flags."""
        self.stopping = True
        for turn in list(self._turns):
            turn.cancel()

    def close(self) -> None:
        """Stop, then wait for the workers."""
        self.stop()
        self._executor.shutdown(wait=True)


def summary(outcome: TurnOutcome) -> dict[str, Any]:
    r = outcome.result
    return {
        "turn": r.turn,
        "history": outcome.plan.kind,
        "finish": "cancelled" if outcome.cancelled else r.finish,
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": r.new_tokens,
        "prefill_tok_s": r.prefill_tok_s,
        "decode_tok_s": r.decode_tok_s,
        "saved": outcome.saved,
    }
