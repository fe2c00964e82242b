"""`cabinlm chat`: the dialogue loop over an exported (or built) artifact.

    chat()      options -> the loaded model, one Dialogue per seat -> ChatLoop.run()
    ChatLoop    one input line at a time: a /command (interactive only) or one turn of one seat
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from cabinlm.cli.common import err, info
from cabinlm.contract.errors import CabinlmError, InputError
from cabinlm.runtime.dialogue import Dialogue, LongMessages
from cabinlm.runtime.inputs import parse_input_line
from cabinlm.runtime.persist import load_session, save_session

COMMANDS = "commands: /image PATH (a camera frame for the next message)  /reset  /stats  /quit"


def chat(
    artifact: Path = typer.Argument(..., help="Folder written by `cabinlm export` or `cabinlm build`."),
    system: Optional[str] = typer.Option(None, help="System prompt (pinned). Default: the model's own, if any."),
    max_new_tokens: int = typer.Option(256, help="Longest reply, in tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold (with --temperature > 0)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads (default: all cores)."),
    session: Optional[Path] = typer.Option(
        None, help="Session file: resumed at start if it exists, saved atomically after every turn."
    ),
    image: Optional[Path] = typer.Option(None, help="A camera frame for the first turn (vision-language models)."),
    seats: int = typer.Option(1, help="Independent conversations on one loaded model (weights held once)."),
    long_messages: LongMessages = typer.Option(
        LongMessages.REFUSE, help="A message longer than the window: 'refuse' it, or 'stream' it through the window."
    ),
    speculative: Optional[bool] = typer.Option(
        None, "--speculative/--no-speculative",
        help="Draft reply tokens from the dialogue's own text (prompt lookup) and check them in one step: "
        "the same replies, faster (docs/results.md, \"Drafting\"). Default: on for the fused cpu build "
        "(`make demo`'s), whose chunk rows are bit for bit its one-token steps; off where a check costs a whole "
        "fixed chunk (Snapdragon HTP, static pairs) or where rows match steps only to rounding (an unbuilt export)."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per turn on stdout instead of text "
                                  "(its \"recall\": the turns and tokens the recall region held)."),
    recall: bool = typer.Option(
        True, "--recall/--no-recall",
        help="With an artifact exported with --recall R: archive what leaves the window and recall what is relevant "
        "before each message (docs/design.md, \"The recall region\"). --no-recall: StreamingLLM exactly, bit for bit."),
    recall_archive_mb: float = typer.Option(
        16.0, help="Largest archive of what left the window, per seat, in MB: the oldest messages dropped first, "
        "the opening exchange kept."),
    tools: Optional[Path] = typer.Option(
        None, help="A JSON file with an OpenAI tool list ([{\"type\": \"function\", \"function\": {\"name\", "
        "\"description\", \"parameters\"}}]): the model may call them. Each call is printed as a JSON line "
        "{\"tool_call\": {\"id\", \"name\", \"arguments\"}}; answer with an input line {\"tool\": NAME, "
        "\"content\": ...} per call. The tool list joins the pinned system prompt (docs/tools.md)."),
    tool_choice: str = typer.Option(
        "auto", help="With --tools: 'auto' (the model decides; a grammar makes every call valid), 'required' "
        "(every reply is a call), 'none' (no calls), or a function's name (always that one)."),
    adapter: Optional[str] = typer.Option(
        None, "--adapter", metavar="NAME",
        help="A build with switchable LoRA adapters (`cabinlm build --adapter NAME=DIR`): answer with adapter NAME "
        "(default: the base model). A resumed session keeps the adapter it was saved with. docs/lora.md."),
) -> None:
    """Talk to an exported model. Interactive on a terminal; otherwise one user message per input line.

    A line may be a JSON object {"text": ..., "image": PATH, "seat": N}: the image is a new camera frame
    that replaces the previous one in the cache. With --seats N, "@2 text" goes to seat 2.
    In the interactive loop: /image PATH attaches a frame to your next message, /reset starts over,
    /stats shows the cache, /quit leaves. Ctrl-C stops a reply (the dialogue goes on); Ctrl-C or
    Ctrl-D at the prompt leaves.

    With --tools FILE the replies may call the tools (grammar-constrained: the arguments always
    validate against the tool's schema); the caller runs each call and sends its result as a line
    {"tool": NAME, "content": ...}, and the model answers once every call has its result.
    """
    from cabinlm.runtime.assembly import RuntimeConfig, open_runtime

    # Every option is checked before the model loads (each refusal an OptionError: one line, exit 2):
    # the values by RuntimeConfig; the seats against this machine's memory, --image against the
    # model and the system prompt against the pinned slots by open_runtime, from the manifest and
    # the tokenizer, before it loads the weights.
    tool_list = read_tools(tools) if tools is not None else ()
    config = RuntimeConfig(artifact, seats=seats, threads=threads, system=system, temperature=temperature, top_p=top_p,
                           seed=seed, max_new_tokens=max_new_tokens, long_messages=long_messages,
                           speculative=speculative, images=image is not None, tools=tool_list, recall=recall,
                           recall_archive_mb=recall_archive_mb, adapter=adapter)  # fmt: skip
    runtime = open_runtime(config)
    # Input a program cannot decode (invalid UTF-8) becomes U+FFFD instead of ending the session.
    sys.stdin.reconfigure(errors="replace")
    if runtime.drafting_notice:
        info(runtime.drafting_notice)
    if runtime.manifest.chat.source == "plain":  # a base model (Gemma 3 270M's GGUF, for one)
        info("this model has no chat template (a base model): turns are plain text, 'User: ...' then 'Assistant:', "
             "and replies are completions of that; an instruction-tuned model answers better")  # fmt: skip
    dialogues = runtime.dialogues()
    assistants = None
    if tool_list:
        from cabinlm.runtime.assistant import ToolDialogue, grammars_for

        choice = tool_choice if tool_choice in ("auto", "required", "none") else \
            {"type": "function", "function": {"name": tool_choice}}  # fmt: skip
        grammars = grammars_for(dialogues[0])
        assistants = [ToolDialogue(d, tool_list, choice, grammars=grammars, system_has_tools=True) for d in dialogues]
    loop = ChatLoop(dialogues, session_files(session, seats), interactive=sys.stdin.isatty() and not json_out,
                    json_out=json_out, image=image, assistants=assistants)  # fmt: skip
    loop.resume()
    loop.run()
    if loop.failures:
        raise typer.Exit(1)


def read_tools(path: Path):
    """--tools FILE: an OpenAI tool list, checked (OptionError naming the file and the fault)."""
    from cabinlm.contract.errors import OptionError
    from cabinlm.runtime.grammar import GrammarError
    from cabinlm.runtime.tools import parse_tools

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise OptionError(f"--tools {path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise OptionError(f"--tools {path}: not a JSON file ({e})") from None
    try:
        return parse_tools(value, "tools")
    except GrammarError as e:
        raise OptionError(f"--tools {path}: {e}") from None


def session_files(session: Path | None, seats: int) -> list[Path | None]:
    """The session file of each seat: FILE for one seat, FILE.seat1 .. FILE.seatN for several."""
    if session is None:
        return [None] * seats
    if seats == 1:
        return [session]
    return [session.with_name(f"{session.name}.seat{i + 1}") for i in range(seats)]


def show(delta: str) -> None:
    """A piece of a reply, on stdout as soon as it is decoded."""
    sys.stdout.write(delta)
    sys.stdout.flush()


class ChatLoop:
    """Reads one line at a time and answers it, until the input ends or the user leaves.

    interactive (a terminal, without --json): a "you> " prompt, /commands, replies streamed as they
    are decoded. Otherwise each line is a message (plain text, "@N text", or a JSON object: see
    runtime/inputs.py); text mode echoes "user: ..." and streams "assistant: ...", --json prints one
    object per turn. A turn that fails is reported on stderr and counted; the dialogue goes on.
    """

    def __init__(self, dialogues: list[Dialogue], files: list[Path | None], *, interactive: bool, json_out: bool,
                 image: Path | None = None, assistants: list | None = None) -> None:  # fmt: skip
        self.dialogues = dialogues  # one per seat; seat N is dialogues[N - 1]
        self.files = files  # each seat's session file, or None
        self.interactive = interactive
        self.json_out = json_out
        self.image = image  # a camera frame for the next message only (--image, or /image PATH)
        self.assistants = assistants  # one ToolDialogue per seat with --tools, else None
        self.failures = 0

    @property
    def seats(self) -> int:
        return len(self.dialogues)

    def resume(self) -> None:
        """Load every seat's session file that exists."""
        for d, f in zip(self.dialogues, self.files):
            if f is not None and f.exists():
                load_session(f, d)
                info(f"resumed {f}: {d.turns} turns, {d.decoder.cache.length} tokens cached")

    def run(self) -> None:
        if self.interactive:
            dec = self.dialogues[0].decoder
            lay = dec.layout
            info(
                f"cabinlm chat: {dec.manifest.model.source}; cache = sink {lay.sink} + pinned {lay.pinned} + "
                f"window {lay.window} ({lay.kv_dtype.value}). /help for commands."
            )
        while (line := self.read()) is not None:
            if not self.handle(line):
                break

    def read(self) -> str | None:
        """The next input line; None at the end of the input (or Ctrl-C / Ctrl-D at the prompt)."""
        try:
            return input("you> " if self.interactive else "")
        except (EOFError, KeyboardInterrupt):
            if self.interactive:
                typer.echo()
            return None

    def handle(self, line: str) -> bool:
        """One input line: a /command or a turn. False when the user leaves. A line that cannot be
        delivered as meant (a seat that does not exist, malformed JSON: runtime/inputs.py) is one
        error line and a failure; the other seats' dialogues go on."""
        try:
            parsed = parse_input_line(line, self.seats)
        except InputError as e:
            err(str(e))
            self.failures += 1
            return True
        if not parsed.text:
            return True
        if self.interactive and parsed.text.startswith("/"):
            return self.command(parsed.text, self.dialogues[parsed.seat - 1])
        if parsed.tool is not None:
            self.tool_result(parsed.seat, parsed.tool, parsed.text)
        else:
            self.turn(parsed.seat, parsed.text, parsed.image)
        return True

    def command(self, text: str, dialogue: Dialogue) -> bool:
        """/image PATH, /reset, /stats, /quit (or /exit); anything else lists them. False on /quit."""
        cmd, _, arg = text.partition(" ")
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/image":
            self.image = Path(arg.strip()) if arg.strip() else None
            info(f"(next message carries {self.image})" if self.image else "usage: /image PATH")
        elif cmd == "/reset":
            dialogue.reset()
            info("(dialogue reset; system prompt pinned again)")
        elif cmd == "/stats":
            c, slots = dialogue.decoder.cache, self.dialogues[0].decoder.layout.slots
            info(f"cached {c.length} tokens of {slots} slots; {c.seen} seen, {c.evicted} evicted")
        else:
            info(COMMANDS)
        return True

    def turn(self, seat: int, text: str, frame: Path | None) -> None:
        """One user message to one seat: the reply streamed (or one JSON object), the session saved.

        A save that fails (a missing folder, a full or read-only disk, another process holding the
        file) loses no reply: it is one error line and a failure, the previous session file stays as
        it was, and the next lines are answered. Text mode streams the reply before the save; --json
        prints its line after the save was tried (printed whatever happens to the save), so that a
        front end which reads a JSON line may count on the file holding that turn unless an error
        line said otherwise: killed before the line, the turn is in neither the output nor the file."""
        self.announce(seat, text)
        if frame is None and self.image is not None:  # --image, or /image: for the next message only
            frame, self.image = self.image, None
        dialogue = self.dialogues[seat - 1]
        on_text = None if self.json_out else show
        if self.assistants is not None and frame is not None:
            err("a camera frame with --tools is not supported: send the frame without --tools")
            self.failures += 1
            return
        self.reply(seat, lambda: self.assistants[seat - 1].ask(text, on_text) if self.assistants is not None
                   else dialogue.ask(text, on_text=on_text, image=frame))  # fmt: skip

    def tool_result(self, seat: int, name: str, content: str) -> None:
        """A {"tool": NAME, "content": ...} line: one call's result; the model answers once every call
        of its last reply has one."""
        if self.assistants is None:
            err('a tool result, but this chat has no tools: start it with --tools FILE')
            self.failures += 1
            return
        who = f"[seat {seat}] " if self.seats > 1 else ""
        if not self.interactive and not self.json_out:
            typer.echo(f"{who}tool {name}: {content}")
        assistant = self.assistants[seat - 1]
        if assistant.missing > 1 and any(c.name == name for c in assistant.pending):  # more results to come
            assistant.result(name, content)
            return
        if not self.interactive and not self.json_out:
            show(f"{who}assistant: ")
        self.reply(seat, lambda: assistant.result(name, content, None if self.json_out else show))

    def reply(self, seat: int, run) -> None:
        """Run one turn (run() -> TurnResult or ToolTurn), print it, save the seat."""
        try:
            turn = run()
        except CabinlmError as e:
            if not self.json_out:
                typer.echo()
            err(str(e))
            self.failures += 1
            return
        result = getattr(turn, "result", turn)
        calls = getattr(turn, "calls", [])
        if not self.json_out:
            typer.echo(" [interrupted]" if result.finish == "interrupted" else "")
            for c in calls:  # a call is a JSON line whatever the mode: a front end reads and answers it
                typer.echo(json.dumps({"tool_call": {"id": c.id, "name": c.name, "arguments": json.loads(c.arguments)}},
                                      ensure_ascii=False))  # fmt: skip
        try:
            self.save(seat)
        finally:
            if self.json_out:
                extra = {"content": turn.content, "tool_calls": [c.to_dict() for c in calls]} if calls else {}
                typer.echo(json.dumps({**result.to_dict(), **extra, "seat": seat}, ensure_ascii=False))

    def save(self, seat: int) -> None:
        """Save one seat's session file, if it has one; a failure is reported and counted."""
        path = self.files[seat - 1]
        if path is None:
            return
        try:
            save_session(path, self.dialogues[seat - 1])
        except CabinlmError as e:  # persist.SessionError: the message names the file and the cause
            err(f"the session was not saved: {e}")
            self.failures += 1
        except OSError as e:  # defensively: an OS error persist did not turn into a SessionError
            err(f"{path}: the session was not saved ({e.strerror or e})")
            self.failures += 1

    def announce(self, seat: int, text: str) -> None:
        """What precedes a streamed reply: the echoed message in text mode, the reply's prompt."""
        who = f"[seat {seat}] " if self.seats > 1 else ""
        if not self.interactive and not self.json_out:
            typer.echo(f"{who}user: {text}")
            show(f"{who}assistant: ")
        elif self.interactive:
            show(f"{who}assistant> ")
