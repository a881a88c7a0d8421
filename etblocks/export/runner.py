"""`Runner`: generate with an exported etblocks program through the ExecuTorch Python runtime, from token ids or
text (`etblocks.export.chat.Chat` keeps a conversation going on one)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy
import torch

from etblocks.adapters.files import read_adapter_file
from etblocks.errors import AdapterMismatchError, ConfigError, ContextOverflowError, EtblocksError
from etblocks.export.adapters import ADAPTERS_METHOD, SET_ADAPTER_METHOD, AdapterTable
from etblocks.export.contract import CONTRACT_METHOD, StaticContract
from etblocks.export.external import weights_file
from etblocks.export.accuracy import Perplexity
from etblocks.export.feeders import DynamicFeeder, StaticFeeder, check_room
from etblocks.export.weights import QUANTIZATION_METHOD, read_quantization
from etblocks.export.sampling import distribution, draw, sample
from etblocks.export.speculate import (
    DRAFT_PREFIX,
    MAX_VERIFY_METHOD,
    VERIFY_METHOD,
    Drafter,
    Proposer,
    SpeculationStats,
    accept,
    check_max_draft,
    lookup_drafter,
)
from etblocks.export.text import Message, encode, encode_chat, find_tokenizer, load_tokenizer, text_pieces
from etblocks.ops import load_kernels
from etblocks.program_files import is_program_file, load_program


class Runner:
    """Generates with an etblocks program through the ExecuTorch Python runtime.

    It reads the program's contract: a dynamic `forward(tokens[1, T], input_pos[1])`, or a static `prefill` /
    `decode` pair with caller-owned state, which the runner then owns (see `etblocks.export.contract`).
    `generate`, `stream` and `chat` take text (encoded by the program's tokenizer) or token ids, and start a new
    sequence unless `fresh=False`, which continues at `pos` (after `forward` or `restore`, say); `Chat` keeps a
    conversation's state between turns. `decode_tail` (static programs): a prompt remainder of at most this many
    tokens goes through `decode` token by token instead of a padded `prefill` (default: chunk // 8).

    `tokenizer`: a directory, a tokenizer.json or a transformers tokenizer; default: the one `etblocks.export`
    saved beside the program (`<stem>.tokenizer/`), loaded when text first needs it.

    `data_path`: the data file holding the program's weights when they were written apart (default: `<stem>.ptd`
    beside the program, if there is one).

    `adapters` (programs exported with LoRA adapters): `{name: adapter file}` or `{name: (file, scale)}`; the
    program starts as the base model and `set_adapter(name | None)` switches. Adapter files (`.ptd`) are read into
    host memory now and switched without reloading the program; adapter programs (`.pte`, exported with
    `adapter_mode="programs"`) are each loaded by the switch to them, in place of the program running, with the
    same data file.

    `draft`: the draft model exported into the same file (`export(..., draft=...)`), as a Runner of its methods
    over the loaded program (None: the file has none); `generate(..., speculate="draft")` proposes with it.
    """

    def __init__(
        self,
        path: str | Path,
        data_path: str | Path | None = None,
        decode_tail: int | None = None,
        adapters: Mapping[str, str | Path | tuple[str | Path, float]] | None = None,
        tokenizer: Any = None,
    ) -> None:
        path = Path(path)
        if data_path is None and weights_file(path).is_file():
            data_path = weights_file(path)
        self.data_path = None if data_path is None else Path(data_path)
        program = load_program(path, self.data_path)  # ProgramFileError for a file that is not a program
        load_kernels()  # before any method loads, after the file checks: a file that is no program fails first
        self.base_path = path
        self._decode_tail = decode_tail
        self._start(tokenizer if tokenizer is not None else find_tokenizer(path))
        self._adapter_programs: dict[str, Path] = {}
        self._open_with_draft(program, path)
        for name, file in (adapters or {}).items():
            self.add_adapter(name, *(file if isinstance(file, tuple) else (file,)))

    def _start(self, tokenizer_source: Any) -> None:
        """What the runner keeps whichever program it runs: the tokenizer, the adapters, the last outputs."""
        self._adapters: dict[str, list[torch.Tensor]] = {}
        self.adapter: str | None = None
        self.last_ids: list[int] = []  # the tokens the last generate / stream / chat call produced
        self.last_speculation: SpeculationStats | None = None  # what the last speculative generation did
        self._tokenizer_source = tokenizer_source
        self._tokenizer: Any = None

    def _open_with_draft(self, program: Any, path: Path) -> None:
        self._open(program, path, "", self._decode_tail)
        if DRAFT_PREFIX + "forward" in program.method_names:
            self.draft = Runner.__new__(Runner)
            self.draft._start(self._tokenizer_source)
            self.draft._open(program, path, DRAFT_PREFIX, None)

    def _open(self, program: Any, path: Path, prefix: str, decode_tail: int | None) -> None:
        """Take the methods of `program` whose names start with `prefix` (a draft model's: `DRAFT_PREFIX`)."""
        self.program, self.path, self._prefix = program, path, prefix
        self.draft: Runner | None = None
        methods = {name.removeprefix(prefix) for name in program.method_names if name.startswith(prefix)}
        self.eos_ids = [int(t) for t in self._constant("get_eos_ids", [])]
        self.contract: StaticContract | None = None
        self._unfed: list[int] = []  # the last generated token: part of the sequence, not yet in the caches
        if CONTRACT_METHOD in methods:
            self.contract = StaticContract.from_constant(self._load(CONTRACT_METHOD).execute([]))
            loaded = {name: self._load(name) for name in self.contract.methods}
            self._feeder = StaticFeeder(self.contract, lambda name, inputs: run_method(loaded[name], inputs), decode_tail)
        elif "forward" in methods and "get_max_seq_len" in methods:
            max_seq_len = int(self._constant("get_max_seq_len"))
            max_context_len = int(self._constant("get_max_context_len", max_seq_len))
            verify = self._load(VERIFY_METHOD) if VERIFY_METHOD in methods else None
            self._feeder = DynamicFeeder(
                self._load("forward"), max_seq_len, max_context_len, run_method, verify,
                int(self._constant(MAX_VERIFY_METHOD, 0)),
            )
        else:
            raise ConfigError(
                f"{path} has methods {sorted(methods)}; expected 'forward' with the LLM metadata methods, or an "
                f"etblocks static program ('prefill', 'decode', '{CONTRACT_METHOD}')"
            )
        self.adapter_table: AdapterTable | None = None
        if ADAPTERS_METHOD in methods:
            self.adapter_table = AdapterTable.from_constant(self._load(ADAPTERS_METHOD).execute([])[0])
            self._set_slots = self._load(SET_ADAPTER_METHOD)
        elif self.contract is not None and self.contract.adapters:
            self.adapter_table = self.contract.adapter_table  # passed with every call by the feeder
        self._base_slots = self.adapter_table.inputs(None) if self.adapter_table is not None else []

    def _switch_program(self, path: Path) -> None:
        """Run the program at `path` (an adapter program or the base) instead of the current one, which is let go
        first so that one copy of the packed weights is held at a time; the current one again if `path` fails."""
        current = self.path
        self.program = self._feeder = self.draft = None
        gc.collect()
        try:
            self._open_with_draft(load_program(path, self.data_path), path)
        except EtblocksError as exc:
            self._open_with_draft(load_program(current, self.data_path), current)
            raise AdapterMismatchError(
                f"{path} could not run with the weights of {self.data_path} ({exc}); is it an adapter program exported "
                f"with {self.base_path}?"
            ) from None

    @property
    def tokenizer(self) -> Any:
        """The transformers tokenizer text goes through; `ConfigError` if the program has none."""
        if self._tokenizer is None:
            if self._tokenizer_source is None:
                raise ConfigError(
                    f"{self.path} has no tokenizer beside it ({self.path.with_suffix('.tokenizer')}/ or tokenizer.json); "
                    "give tokenizer= (a directory or tokenizer.json), or token ids instead of text"
                )
            self._tokenizer = load_tokenizer(self._tokenizer_source)
        return self._tokenizer

    def add_adapter(self, name: str, path: str | Path, scale: float = 1.0) -> None:
        """Add adapter `name` from `path`, written by `etblocks.export`: an adapter file (`.ptd`), read now with
        its update scaled by `scale` and checked against the program's LoRA slots; or an adapter program
        (`adapter_mode="programs"`), checked against the base program now and loaded by `set_adapter`.
        `AdapterMismatchError` if it does not fit. Adding a name again replaces it (e.g. with another scale)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name={name!r} is not accepted; give a non-empty adapter name")
        if self.data_path is not None and is_program_file(path):  # adapter programs read the base's data file
            program = self._adapter_program(Path(path), scale)
            self._adapters.pop(name, None)
            self._adapter_programs[name] = program
            return
        if self.adapter_table is None:
            raise ConfigError(
                "this program has no LoRA slots; load adapters into the model (etblocks.load_adapter) before "
                "etblocks.export"
            )
        self._adapters[name] = self.adapter_table.inputs(read_adapter_file(path), scale)
        self._adapter_programs.pop(name, None)

    def _adapter_program(self, path: Path, scale: float) -> Path:
        """`path` once it is known to be an adapter program of the base this runner started with."""
        if scale != 1.0:
            raise ConfigError(
                f"scale={scale!r} for the adapter program {path}: its update is part of the program as exported; export "
                "it again after etblocks.load_adapter(..., scale=S), or export with adapter_mode='slots' to scale at run time"
            )
        program = load_program(path, self.data_path)
        mine, theirs = self.program.method_names, program.method_names
        differs = sorted(mine ^ theirs) or [
            name for name in sorted(mine)
            if name.startswith("get_") and self._metadata(self.program, name) != self._metadata(program, name)
        ]
        if differs:
            raise AdapterMismatchError(
                f"{path} is not an adapter program of {self.base_path}: their methods or metadata differ ({differs[:4]})"
            )
        return path

    @staticmethod
    def _metadata(program: Any, name: str) -> str:
        return str(program.load_method(name).execute([]))

    @property
    def adapters(self) -> list[str]:
        return sorted([*self._adapters, *self._adapter_programs])

    def set_adapter(self, name: str | None) -> None:
        """Run with adapter `name` (None: the base model): new slot values, or the adapter's program loaded in
        place of the current one. Starts a new sequence: cached rows were computed under the previous adapter."""
        if name is not None and name not in self.adapters:
            raise ConfigError(f"name={name!r} is not an added adapter; added: {self.adapters}, or None for the base model")
        program = self._adapter_programs.get(name, self.base_path)
        if program != self.path:
            self._switch_program(program)
        if self.adapter_table is not None:  # a program without slots is the base model already
            slots = self._adapters[name] if name in self._adapters else self._base_slots
            if self.contract is None:
                self._set_slots.execute(slots)
            else:
                self._feeder.adapter_inputs = slots
        self.adapter = name
        self.reset()

    def _load(self, name: str) -> Any:
        return self.program.load_method(self._prefix + name)

    def _constant(self, name: str, default=None):
        if self._prefix + name not in self.program.method_names:
            return default
        value = self._load(name).execute([])
        return value if len(value) > 1 or name == "get_eos_ids" else value[0]

    @property
    def pos(self) -> int:
        """Where the next tokens go: the positions of the current sequence so far, including the last generated
        token, which is fed (once) with whatever comes next."""
        return self._feeder.pos + len(self._unfed)

    @property
    def max_context_len(self) -> int:
        return self._feeder.max_context_len

    @property
    def quantization(self) -> dict | None:
        """What the program records of its weight quantization: `{"scheme": ..., "modules": {name: what it
        holds}}` (`"int4 groups, kept"` for a weight kept from the int4 groups it had); None: not quantized."""
        values = self._constant(QUANTIZATION_METHOD)
        return None if values is None else read_quantization(values)

    @property
    def vocab_size(self) -> int:
        return self.contract.vocab_size if self.contract is not None else int(self._constant("get_vocab_size"))

    @property
    def caches(self) -> list[torch.Tensor]:
        """A static program's caller-owned state, one tensor per contract entry (`contract.states`: K/V caches,
        convolution windows, recurrent states), copied: e.g. to save a prompt's state after `forward(prompt)`, with
        `pos`. After `generate` the last generated token is not in it yet (the next call feeds it)."""
        if self.contract is None or self.contract.cache != "io":
            raise ConfigError("this program keeps its state inside; only static programs with caller-owned state expose it")
        return [tensor.clone() for tensor in self._feeder.state]

    def restore(self, caches: Sequence[torch.Tensor], pos: int) -> None:
        """Continue a static program from saved state (`caches`) holding `pos` positions; `ConfigError` if the
        number of tensors, their shapes or dtypes do not match the program's."""
        if self.contract is None:
            raise ConfigError("restore() needs a static program with caller-owned state; this one is dynamic")
        self._feeder.restore(caches, pos)
        self._unfed = []

    def reset(self) -> None:
        """Start a new sequence."""
        self._feeder.reset()
        self._unfed = []

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed tokens at the current position; return the logits `[V]` after the last one."""
        logits = self._feeder.forward(self._unfed + list(tokens))
        self._unfed = []
        return logits

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        eos: int | Iterable[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        fresh: bool = True,
        speculate: str | Proposer | Runner | None = None,
        max_draft: int = 4,
    ) -> str | list[int]:
        """What the program generates after `prompt`: text after a text prompt (encoded with the tokenizer's
        special tokens, decoded without them), new token ids after token ids. Stops after an EOS token (included
        in ids). `eos=None` uses the program's. `fresh=False` continues the current sequence instead of starting
        a new one.

        `speculate="prompt_lookup"`: propose up to `max_draft` tokens that followed the latest earlier occurrence of
        the sequence's last tokens, and check them in one call (`etblocks.export.speculate`): the same tokens as
        without it at temperature 0, the same distribution when sampling; `last_speculation` says how many were
        kept. A callable `(tokens so far, max tokens) -> tokens` proposes instead; so does a `Runner` of a smaller
        program with the same tokenizer (a draft model, `DraftModel`), which then follows the sequence too, and
        `speculate="draft"` the draft model exported into this program's file (`draft`). Needs a
        program that checks several tokens per call: a dynamic one exported with `max_draft`, or a static one with
        caller-owned state."""
        tokens = self._tokens(self._ids(prompt), max_new_tokens, eos, temperature, top_p, seed, fresh, speculate,
                              max_draft)
        if isinstance(prompt, str):
            return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return list(tokens)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        eos: int | Iterable[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        fresh: bool = True,
        speculate: str | Proposer | Runner | None = None,
        max_draft: int = 4,
    ) -> Iterator[str] | Iterator[int]:
        """`generate` one piece at a time, as each token comes: text pieces after a text prompt (they join to
        `generate`'s text), token ids after token ids; `speculate` as in `generate` (pieces then come in bursts)."""
        tokens = self._tokens(self._ids(prompt), max_new_tokens, eos, temperature, top_p, seed, fresh, speculate,
                              max_draft)
        return text_pieces(self.tokenizer, tokens) if isinstance(prompt, str) else tokens

    def chat(self, messages: Sequence[Message], max_new_tokens: int = 256, **generation: Any) -> str:
        """The assistant's reply to `messages` (`[{"role": "user", "content": ...}, ...]`, rendered by the
        tokenizer's chat template with the generation prompt); a new sequence. `generation`: as `generate`.
        `Chat` keeps a conversation going turn by turn."""
        ids = encode_chat(self.tokenizer, messages)
        return self.tokenizer.decode(self.generate(ids, max_new_tokens, **generation), skip_special_tokens=True)

    def logits(self, text_or_ids: str | Sequence[int]) -> torch.Tensor:
        """`[len(ids), V]`: row i is the logits after the first i + 1 tokens of `text_or_ids` (text encoded as the
        tokenizer does, with its special tokens), every token fed as given (teacher forcing); a new sequence,
        left reset.

        In calls of as many tokens as the program checks at once: a dynamic program exported with `max_draft`
        (its `verify` method, `max_draft + 1` tokens per call), a static one with caller-owned state (a `prefill`
        chunk); other programs one token per call. `ContextOverflowError` beyond the context."""
        ids = self._ids(text_or_ids)
        check_room(0, len(ids), self.max_context_len)
        width = self._feeder.max_verify
        self.reset()
        try:
            rows = []
            for start in range(0, len(ids), max(width, 1)):
                chunk = ids[start : start + max(width, 1)]
                if width >= 2:
                    rows.append(self._feeder.verify(chunk))
                    self._feeder.keep(len(chunk))
                else:
                    rows.append(self._feeder.forward(chunk)[None])
            return torch.cat(rows)
        finally:
            self.reset()

    def score(self, text_or_ids: str | Sequence[int]) -> torch.Tensor:
        """`[len(ids) - 1]` float32: the log-probability of each token of `text_or_ids` given the tokens before
        it (from `logits`, whose calls it makes). `perplexity` scores longer text in windows."""
        ids = self._ids(text_or_ids)
        if len(ids) < 2:
            raise ConfigError(f"score takes at least 2 tokens (the first is scored by none); got {len(ids)}")
        log_probs = self.logits(ids[:-1]).float().log_softmax(-1)
        return log_probs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    def perplexity(self, text_or_ids: str | Sequence[int], window: int | None = None) -> Perplexity:
        """The perplexity of `text_or_ids` scored in consecutive windows of `window` tokens (default: the
        program's context), each a new sequence whose first token is scored by none (as `score`)."""
        ids = self._ids(text_or_ids)
        window = self.max_context_len if window is None else window
        if not isinstance(window, int) or not 2 <= window <= self.max_context_len:
            raise ConfigError(f"window={window!r} is not accepted; give 2 .. {self.max_context_len} (the program's context)")
        scored = [self.score(ids[start : start + window]) for start in range(0, len(ids) - 1, window) if len(ids) - start >= 2]
        return Perplexity.of(torch.cat(scored))

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode(self.tokenizer, prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt=[] is empty; give at least one token id, or text")
        return ids

    def _tokens(
        self, prompt_ids: list[int], max_new_tokens: int, eos: int | Iterable[int] | None, temperature: float,
        top_p: float, seed: int | None, fresh: bool, speculate: str | Proposer | Runner | None = None, max_draft: int = 4,
    ) -> Iterator[int]:
        """Check everything, then (lazily) feed the prompt and yield each new token as it is chosen."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        drafter = self._drafter(speculate, max_draft, temperature, top_p, generator) if speculate is not None else None
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens} is not accepted; give an integer >= 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ConfigError(f"temperature={temperature}, top_p={top_p}: accepted are temperature >= 0, 0 < top_p <= 1")
        start = 0 if fresh else self.pos
        needed = start + len(prompt_ids) + max_new_tokens - 1
        if needed > self.max_context_len:
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens at position {start} plus max_new_tokens={max_new_tokens} "
                f"needs {needed} positions; the program's context is {self.max_context_len}",
                fits=self.max_context_len - start - len(prompt_ids) + 1,
            )
        if fresh:
            self.reset()
        stop = set(self.eos_ids if eos is None else ([eos] if isinstance(eos, int) else eos))
        self.last_speculation = None
        if drafter is not None:
            draft_len = min(max_draft, self._feeder.max_verify - 1)
            return self._speculate(prompt_ids, max_new_tokens, stop, temperature, top_p, generator, drafter, draft_len)
        return self._sample(prompt_ids, max_new_tokens, stop, temperature, top_p, generator)

    def _drafter(self, speculate: str | Proposer | Runner, max_draft: int, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> Drafter:
        """The drafter `speculate` asks for, after checking it, `max_draft` and that this program can check
        proposals."""
        check_max_draft(max_draft)
        if isinstance(speculate, str) and speculate == "draft":
            if self.draft is None:
                raise ConfigError(
                    f"speculate='draft' needs a draft model in the program's file; {self.path.name} has none: export "
                    "with etblocks.export(..., max_draft=N, draft=smaller_model), or give speculate=Runner(draft.pte)"
                )
            speculate = self.draft
        if isinstance(speculate, Runner):
            if speculate is self:
                raise ConfigError("speculate= is this Runner itself; give the Runner of a smaller program as the draft")
            if speculate.vocab_size != self.vocab_size:
                raise ConfigError(
                    f"speculate=Runner({speculate.path.name}) has a vocabulary of {speculate.vocab_size} tokens, "
                    f"{self.path.name} {self.vocab_size}; a draft program must share the tokenizer"
                )
            if speculate.max_context_len < self.max_context_len:
                raise ConfigError(
                    f"speculate=Runner({speculate.path.name}) holds {speculate.max_context_len} positions, "
                    f"{self.path.name} {self.max_context_len}; export the draft with at least the target's max_seq_len"
                )
            drafter = DraftModel(speculate, temperature, top_p, generator)
        else:
            drafter = lookup_drafter(speculate)
        if self._feeder.max_verify < 2:
            raise ConfigError(
                f"speculate={speculate!r} needs a program that checks several tokens in one call; {self.path.name} "
                "has none: export a dynamic program with max_draft=N, or a static one with cache='io'"
            )
        return drafter

    def _sample(self, prompt_ids: list[int], max_new_tokens: int, stop: set[int], temperature: float, top_p: float,
                generator: torch.Generator | None) -> Iterator[int]:
        self.last_ids = []
        logits = self.forward(prompt_ids)
        while True:
            token = sample(logits, temperature, top_p, generator)
            last = self._chosen(token, stop, max_new_tokens)
            yield token
            if last:
                return
            logits = self.forward([token])

    def _chosen(self, token: int, stop: set[int], max_new_tokens: int) -> bool:
        """Record `token`, sampled from the program's logits, as generated; True when it ends the generation (a
        stop token, or the `max_new_tokens`-th), and then it is the one token the program has not been fed yet."""
        self.last_ids.append(token)
        if token in stop or len(self.last_ids) == max_new_tokens:
            self._unfed = [token]
            return True
        return False

    def _speculate(self, prompt_ids: list[int], max_new_tokens: int, stop: set[int], temperature: float, top_p: float,
                   generator: torch.Generator | None, drafter: Drafter, max_draft: int) -> Iterator[int]:
        """`_sample` with proposals: after each chosen token, the drafter's tokens are checked with it in one call,
        and the program keeps (and this yields) what `speculate.accept` keeps."""
        self.last_ids = []
        stats = self.last_speculation = SpeculationStats()
        history = list(prompt_ids)
        token = sample(self.forward(prompt_ids), temperature, top_p, generator)
        drafter.start(prompt_ids)
        while True:
            history.append(token)
            stats.tokens += 1
            last = self._chosen(token, stop, max_new_tokens)
            yield token
            if last:
                return
            limit = min(max_draft, max_new_tokens - len(self.last_ids))
            draft, draft_probs = drafter.propose(history, limit)
            stats.calls += 1
            if not draft:
                token = sample(self.forward([token]), temperature, top_p, generator)
                continue
            logits = self._feeder.verify([token, *draft])
            *kept, token = accept(logits, draft, temperature, top_p, generator, draft_probs)
            drafter.kept(len(kept))
            stats.verify_calls += 1
            stats.drafted += len(draft)
            stats.accepted += len(kept)
            for i, accepted in enumerate(kept):
                self.last_ids.append(accepted)
                history.append(accepted)
                stats.tokens += 1
                if accepted in stop or len(self.last_ids) == max_new_tokens:
                    self._feeder.keep(i + 2)  # the token before the draft and the drafts up to this one
                    yield accepted
                    return
                yield accepted
            self._feeder.keep(len(kept) + 1)


class DraftModel:
    """A drafter (`speculate.Drafter`) that is a smaller program sharing the tokenizer: it samples (greedy at
    temperature 0) up to `limit` tokens one by one after the sequence so far, and keeps its own state in step with
    the target's: after a check it holds exactly the kept tokens. A dynamic draft program drops the rest by moving
    its position back, so it must have been exported with `max_draft` (which checks its state allows that); a
    static one goes back to its state from before the proposal and runs the kept tokens again. It starts from each
    call's prompt (a `fresh=False` call's earlier turns are the target's only)."""

    def __init__(self, runner: Runner, temperature: float, top_p: float, generator: torch.Generator | None) -> None:
        if runner.contract is None and runner._feeder.max_verify == 0:
            raise ConfigError(
                f"speculate=Runner({runner.path.name}) is a dynamic program exported without max_draft; export the draft "
                "with max_draft=N too (that checks a rejected proposal can be dropped from its state)"
            )
        if runner.contract is not None and runner.contract.cache != "io":
            raise ConfigError(
                f"speculate=Runner({runner.path.name}) keeps its state inside a static program; export the draft with "
                "cache='io'"
            )
        self.runner, self.temperature, self.top_p, self.generator = runner, temperature, top_p, generator
        self._proposed: list[int] = []
        self._before: tuple[list[torch.Tensor] | None, int, list[int]] = (None, 0, [])

    def start(self, prompt_ids: list[int]) -> None:
        self.runner.reset()
        self.runner.forward(prompt_ids)

    def propose(self, history: Sequence[int], limit: int) -> tuple[list[int], list[numpy.ndarray] | None]:
        runner = self.runner
        caches = runner.caches if runner.contract is not None else None  # copies; static drafts own their state
        self._before = (caches, runner._feeder.pos, [*runner._unfed, history[-1]])  # and what the next call feeds first
        tokens, probs, fed = [], [], [history[-1]]
        for _ in range(limit):
            logits = runner.forward(fed)
            if self.temperature == 0:
                tokens.append(sample(logits))
            else:
                probs.append(distribution(logits, self.temperature, self.top_p))
                tokens.append(draw(probs[-1], self.generator))
            fed = tokens[-1:]
        runner._unfed = fed  # the last proposed token: fed with whatever comes next, if it is kept
        self._proposed = tokens
        return tokens, (probs if self.temperature else None)

    def kept(self, n: int) -> None:
        """Hold what came before the proposal and its first `n` tokens (the last proposed one stays unfed)."""
        if n == len(self._proposed):
            return
        runner = self.runner
        caches, pos, first = self._before
        keep = [*first, *self._proposed[:n]]
        if caches is None:  # dynamic: rows written past the kept tokens are never read, and get overwritten
            runner._feeder.pos = pos + len(keep)
            runner._unfed = []
        else:
            runner.restore(caches, pos)
            runner.forward(keep)


def run_method(method: Any, inputs: Sequence[Any]) -> list[Any]:
    """`method.execute(inputs)` (an `executorch.runtime.Method`) with its output tensors copied by numpy, on this
    thread.

    The runtime's own copy of the outputs is a torch clone, and torch copies more than 32768 elements (the logits
    of any real vocabulary) on its OpenMP threads, which then spin on the cores ExecuTorch's thread pool needs for
    the next call (measured by `benchmarks/quant.py`). The copy stays, since outputs live in memory the program
    reuses on its next call.
    """
    # workaround(executorch 1.5.1): `Method.execute` does not pass `clone_outputs` on, so the private `_method`
    # is called directly.
    outputs = method._method(inputs, clone_outputs=False)
    return [copy_tensor(out) if isinstance(out, torch.Tensor) else out for out in outputs]


def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` made by numpy on this thread, whatever its dtype (copied as bytes)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype)
    numpy.copyto(_bytes(copy), _bytes(tensor.detach().contiguous()))
    return copy


def _bytes(tensor: torch.Tensor):
    """The bytes of a contiguous tensor as a numpy array that shares its memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()
