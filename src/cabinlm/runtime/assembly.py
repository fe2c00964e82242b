"""One runtime assembly: artifact -> seats -> drafting default -> dialogues, for `cabinlm chat`,
`cabinlm serve` and `cabinlm bench` alike.

    RuntimeConfig(...)         every value checked once, in __post_init__ (OptionError naming the
                               option as the command line spells it, and the value)
    open_runtime(config)       manifest -> seats against this machine's memory -> images only to a
                               vision-language model -> the system prompt against the pinned slots
                               (the Dialogue's own renderer, the tokenizer alone) -> the model loaded
                               once (checksums) -> one Decoder per seat sharing its backend
                               (Decoder.seat) -> drafting: the caller's choice, or the backend's
                               default (speculative.drafting_by_default)
    Runtime.dialogues()        one Dialogue per seat (chat, serve); the bench drives runtime.decoders
                               itself, with runtime.new_drafting()

Everything that can be refused is refused before the weights load, so a bad option costs no load
and no option is checked in one command and not in another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cabinlm.contract.files import FileRole
from cabinlm.contract.errors import OptionError
from cabinlm.contract.manifest import Manifest, load_manifest
from cabinlm.runtime import artifact  # its open_artifact, looked up at call time (tests replace it)
from cabinlm.runtime.decoder import Decoder
from cabinlm.runtime.dialogue import Dialogue, LongMessages
from cabinlm.runtime.limits import (
    check_count,
    check_images,
    check_seat_count,
    check_seats,
    check_system_prompt,
    check_threads,
)
from cabinlm.runtime.recall import DEFAULT_ARCHIVE_MB, check_archive_mb
from cabinlm.runtime.sampler import Sampler
from cabinlm.runtime.speculative import Drafting, PlainDecoding, PromptLookupDrafting, drafting_by_default
from cabinlm.runtime.tokenizer import Tokenizer
from cabinlm.runtime.tools import tools_system


@dataclass(frozen=True)
class RuntimeConfig:
    """How to run an artifact: what every command that talks to the model shares."""

    artifact: Path  # a folder written by `cabinlm export` or `cabinlm build`
    seats: int = 1  # dialogues on the one loaded model (weights held once), 1..MAX_SEATS
    threads: int | None = None  # ONNX Runtime intra-op threads (None: every core)
    system: str | None = None  # the pinned system prompt (None: the model's default; "": none)
    system_option: str | None = "--system"  # the option that gives `system`, as messages name it (None: none does)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    max_new_tokens: int = 256  # the longest reply
    long_messages: LongMessages = LongMessages.REFUSE
    speculative: bool | None = None  # prompt-lookup drafting; None: the backend's default
    images: bool = False  # the caller will send camera frames (`cabinlm chat --image`)
    verify: bool = True  # check every file's sha256 against the manifest before loading
    tools: tuple = ()  # runtime.tools.Tool: listed after the system prompt (`cabinlm chat --tools`)
    recall: bool = True  # fill the artifact's recall region (False, --no-recall: StreamingLLM exactly)
    recall_archive_mb: float = DEFAULT_ARCHIVE_MB  # each seat's archive of what left the window, at most
    adapter: str | None = None  # every seat's switchable LoRA adapter, by the name its build gave it (None: the base model)

    def __post_init__(self) -> None:
        if not isinstance(self.artifact, (str, Path)):
            raise OptionError(f"the artifact must be a folder path, got {self.artifact!r}")
        object.__setattr__(self, "artifact", Path(self.artifact))
        check_count("max-new-tokens", self.max_new_tokens, 1)
        check_seat_count(self.seats)
        check_threads(self.threads)
        self.sampler()  # raises OptionError naming --temperature, --top-p, --top-k or --seed
        try:
            object.__setattr__(self, "long_messages", LongMessages(self.long_messages))
        except ValueError as e:
            choices = ", ".join(m.value for m in LongMessages)
            raise OptionError(f"--long-messages must be one of {choices}, got {self.long_messages!r}") from e
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise OptionError(f"--speculative must be on, off or unset, got {self.speculative!r}")
        if self.system is not None and not isinstance(self.system, str):
            raise OptionError(f"{self.system_option or 'the system prompt'} must be text, got {self.system!r}")
        check_archive_mb(self.recall_archive_mb)
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise OptionError(f"--adapter must be an adapter's name, got {self.adapter!r}")
        for name in ("images", "verify", "recall"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def sampler(self) -> Sampler:
        """A fresh sampler of these settings (each seat has its own random state)."""
        return Sampler(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)


@dataclass
class Runtime:
    """An opened artifact: one Decoder per seat over one loaded backend, the tokenizer, and whether
    the seats draft."""

    config: RuntimeConfig
    manifest: Manifest
    tokenizer: Tokenizer
    decoders: list[Decoder]  # seat 1 first; each its own cache, the backend's graphs and weights shared
    drafts: bool  # the seats draft by prompt lookup
    why_not: str  # why drafting is off by default on this build ("" when it is on, or the caller chose)
    system: str | None = None  # the system prompt the dialogues pin: config.system with config.tools listed
    _dialogues: list[Dialogue] | None = field(default=None, repr=False)

    @property
    def drafting_notice(self) -> str | None:
        """A line for the user when drafting is off by default on a target build (a fixed-chunk
        graph: a Snapdragon HTP build, a static pair), where the lever is easy to miss; None
        otherwise (an unbuilt export's reason is in --help)."""
        if self.config.speculative is not None or self.drafts or not self.decoders[0].backend.fixed_chunk:
            return None
        return f"speculative decoding off: {self.why_not} (--speculative turns it on)"

    def new_drafting(self) -> Drafting:
        """A fresh drafting strategy for one seat's reply loop."""
        return PromptLookupDrafting() if self.drafts else PlainDecoding()

    def dialogues(self) -> list[Dialogue]:
        """One Dialogue per seat (made on the first call: each pins the system prompt), with the
        config's system prompt, sampling, reply limit and drafting."""
        if self._dialogues is None:
            c = self.config
            self._dialogues = [Dialogue(d, self.tokenizer, system=self.system, sampler=c.sampler(),
                                        max_new_tokens=c.max_new_tokens, long_messages=c.long_messages,
                                        drafting=self.new_drafting(), recall=c.recall,
                                        archive_mb=c.recall_archive_mb)
                               for d in self.decoders]  # fmt: skip
        return self._dialogues


def check_adapter(name: str | None, manifest: Manifest) -> None:
    """--adapter NAME against the build's prepared adapters (OptionError: one line naming those there are)."""
    if name is None:
        return
    if manifest.lora is None:
        raise OptionError(f"--adapter {name}: this artifact takes no switchable adapters; export the model with "
                          "--lora-rank R and build it with --adapter NAME=DIR")  # fmt: skip
    if manifest.lora.adapter(name) is None:
        raise OptionError(f"--adapter {name}: no adapter of that name in this build (it holds: "
                          f"{', '.join(manifest.lora.names) or 'none'}); prepare it with `cabinlm build EXPORT "
                          f"--adapter {name}=DIR`")  # fmt: skip


def open_runtime(config: RuntimeConfig) -> Runtime:
    """Check what needs the manifest and the tokenizer (seats against memory, images, the system
    prompt), then load the model once and make config.seats decoders on it. Raises OptionError for
    a value that cannot work here, ManifestError / BackendError for an artifact that cannot run."""
    folder = config.artifact
    manifest = load_manifest(folder)
    check_seats(config.seats, manifest)
    check_images(config.images, manifest)
    check_adapter(config.adapter, manifest)
    tokenizer = Tokenizer(folder / manifest.files[FileRole.TOKENIZER].path)
    system, option = config.system, config.system_option
    if config.tools:
        system = tools_system(manifest.chat.default_system if system is None else system, config.tools, manifest.chat)
        option = f"{option or 'the system prompt'} with the --tools list"
    check_system_prompt(system, manifest, tokenizer, option)
    dec, tokenizer = artifact.open_artifact(folder, threads=config.threads, verify=config.verify, manifest=manifest,
                                           tokenizer=tokenizer)  # fmt: skip
    decoders = [dec] + [dec.seat() for _ in range(config.seats - 1)]
    for d in decoders:  # before any dialogue pins its system prompt
        d.set_adapter(config.adapter)
    if config.speculative is None:
        drafts, why_not = drafting_by_default(dec.backend)
    else:
        drafts, why_not = config.speculative, ""
    return Runtime(config, manifest, tokenizer, decoders, drafts, why_not, system)
