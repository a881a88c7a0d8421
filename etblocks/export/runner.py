"""`Runner`: generate with an exported etblocks program through the ExecuTorch Python runtime, from token ids or
text (`etblocks.export.chat.Chat` keeps a conversation going on one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy
import torch

from etblocks.adapters.files import read_adapter_file
from etblocks.errors import ConfigError, ContextOverflowError
from etblocks.export.adapters import ADAPTERS_METHOD, SET_ADAPTER_METHOD, AdapterTable
from etblocks.export.contract import CONTRACT_METHOD, StaticContract
from etblocks.export.feeders import DynamicFeeder, StaticFeeder
from etblocks.export.text import Message, encode, encode_chat, find_tokenizer, load_tokenizer, text_pieces
from etblocks.ops import load_kernels
from etblocks.program_files import load_program


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

    `adapters` (programs exported with LoRA adapters): `{name: adapter file}` or `{name: (file, scale)}`, read
    into host memory now; `set_adapter(name | None)` switches between them and the base model without reloading
    the program. The program starts as the base model.
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
        self.program = load_program(path, data_path)  # ProgramFileError for a file that is not a program
        load_kernels()  # before any method loads, after the file checks: a file that is no program fails first
        methods = set(self.program.method_names)
        self.eos_ids = [int(t) for t in self._constant("get_eos_ids", [])]
        self.contract: StaticContract | None = None
        self._unfed: list[int] = []  # the last generated token: part of the sequence, not yet in the caches
        if CONTRACT_METHOD in methods:
            self.contract = StaticContract.from_constant(self.program.load_method(CONTRACT_METHOD).execute([]))
            loaded = {name: self.program.load_method(name) for name in self.contract.methods}
            self._feeder = StaticFeeder(self.contract, lambda name, inputs: run_method(loaded[name], inputs), decode_tail)
        elif "forward" in methods and "get_max_seq_len" in methods:
            max_seq_len = int(self._constant("get_max_seq_len"))
            max_context_len = int(self._constant("get_max_context_len", max_seq_len))
            self._feeder = DynamicFeeder(self.program.load_method("forward"), max_seq_len, max_context_len, run_method)
        else:
            raise ConfigError(
                f"{path} has methods {sorted(methods)}; expected 'forward' with the LLM metadata methods, or an "
                f"etblocks static program ('prefill', 'decode', '{CONTRACT_METHOD}')"
            )
        self.adapter_table: AdapterTable | None = None
        if ADAPTERS_METHOD in methods:
            self.adapter_table = AdapterTable.from_constant(self.program.load_method(ADAPTERS_METHOD).execute([])[0])
            self._set_slots = self.program.load_method(SET_ADAPTER_METHOD)
        elif self.contract is not None and self.contract.adapters:
            self.adapter_table = self.contract.adapter_table  # passed with every call by the feeder
        self._adapters: dict[str, list[torch.Tensor]] = {}
        self._base_slots = self.adapter_table.inputs(None) if self.adapter_table is not None else []
        self.adapter: str | None = None
        for name, file in (adapters or {}).items():
            self.add_adapter(name, *(file if isinstance(file, tuple) else (file,)))
        self.last_ids: list[int] = []  # the tokens the last generate / stream / chat call produced
        self._tokenizer_source = tokenizer if tokenizer is not None else find_tokenizer(path)
        self._tokenizer: Any = None
        self.path = path

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
        """Read the adapter file at `path` (written by `etblocks.export`) as `name`, its update scaled by `scale`;
        checked against the program's LoRA slots first (`AdapterMismatchError` if it does not fit). Adding a
        name again replaces it (e.g. with another scale)."""
        if self.adapter_table is None:
            raise ConfigError(
                "this program has no LoRA slots; load adapters into the model (etblocks.load_adapter) before "
                "etblocks.export"
            )
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name={name!r} is not accepted; give a non-empty adapter name")
        self._adapters[name] = self.adapter_table.inputs(read_adapter_file(path), scale)

    @property
    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    def set_adapter(self, name: str | None) -> None:
        """Run with adapter `name` (None: the base model). Starts a new sequence: cached rows were computed
        under the previous adapter."""
        if name is not None and name not in self._adapters:
            raise ConfigError(f"name={name!r} is not an added adapter; added: {self.adapters}, or None for the base model")
        if self.adapter_table is not None:  # a program without slots is the base model already
            slots = self._adapters[name] if name is not None else self._base_slots
            if self.contract is None:
                self._set_slots.execute(slots)
            else:
                self._feeder.adapter_inputs = slots
        self.adapter = name
        self.reset()

    def _constant(self, name: str, default=None):
        if name not in self.program.method_names:
            return default
        value = self.program.load_method(name).execute([])
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
    ) -> str | list[int]:
        """What the program generates after `prompt`: text after a text prompt (encoded with the tokenizer's
        special tokens, decoded without them), new token ids after token ids. Stops after an EOS token (included
        in ids). `eos=None` uses the program's. `fresh=False` continues the current sequence instead of starting
        a new one."""
        tokens = self._tokens(self._ids(prompt), max_new_tokens, eos, temperature, top_p, seed, fresh)
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
    ) -> Iterator[str] | Iterator[int]:
        """`generate` one piece at a time, as each token comes: text pieces after a text prompt (they join to
        `generate`'s text), token ids after token ids."""
        tokens = self._tokens(self._ids(prompt), max_new_tokens, eos, temperature, top_p, seed, fresh)
        return text_pieces(self.tokenizer, tokens) if isinstance(prompt, str) else tokens

    def chat(self, messages: Sequence[Message], max_new_tokens: int = 256, **generation: Any) -> str:
        """The assistant's reply to `messages` (`[{"role": "user", "content": ...}, ...]`, rendered by the
        tokenizer's chat template with the generation prompt); a new sequence. `generation`: as `generate`.
        `Chat` keeps a conversation going turn by turn."""
        ids = encode_chat(self.tokenizer, messages)
        return self.tokenizer.decode(self.generate(ids, max_new_tokens, **generation), skip_special_tokens=True)

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode(self.tokenizer, prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt=[] is empty; give at least one token id, or text")
        return ids

    def _tokens(
        self, prompt_ids: list[int], max_new_tokens: int, eos: int | Iterable[int] | None, temperature: float,
        top_p: float, seed: int | None, fresh: bool,
    ) -> Iterator[int]:
        """Check everything, then (lazily) feed the prompt and yield each new token as it is chosen."""
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
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return self._sample(prompt_ids, max_new_tokens, stop, temperature, top_p, generator)

    def _sample(self, prompt_ids: list[int], max_new_tokens: int, stop: set[int], temperature: float, top_p: float,
                generator: torch.Generator | None) -> Iterator[int]:
        self.last_ids = []
        logits = self.forward(prompt_ids)
        for count in range(1, max_new_tokens + 1):
            token = sample(logits, temperature, top_p, generator)
            self.last_ids.append(token)
            if token in stop or count == max_new_tokens:
                self._unfed = [token]
                yield token
                return
            yield token
            logits = self.forward([token])


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


def greedy_token(logits: torch.Tensor) -> int:
    """Index of the largest logit (the first on ties), by numpy: torch.argmax over a vocabulary of tens of
    thousands is slower, most of all between decode steps."""
    return int(logits.detach().reshape(-1).float().numpy().argmax())  # .float() copies only non-fp32 logits


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling over `softmax(logits / temperature)`: the most likely
    tokens, each kept while the mass of those before it is below `top_p`, drawn in proportion to their
    probabilities by one uniform number from `generator` (torch's global one if None).

    numpy does the arithmetic, on this thread: torch's elementwise ops over a vocabulary this size run on its
    OpenMP threads, whose spinning slows the next decode step (see `run_method`).
    """
    if temperature == 0:
        return greedy_token(logits)
    scaled = logits.detach().reshape(-1).float().numpy() / numpy.float32(temperature)
    probs = numpy.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_p >= 1:
        return _draw(probs, generator)
    probs, tokens = _nucleus(probs, top_p)
    return int(tokens[_draw(probs, generator)])


NUCLEUS_FIRST_K = 256


def _nucleus(probs: numpy.ndarray, top_p: float) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The nucleus's probabilities and token ids. Most nuclei end inside the k most likely tokens, found by a
    partial sort; a larger one (flat logits) takes a sort of the probabilities' values, not of their indices
    (sorting token ids by probability is several times slower; `benchmarks/sampling.py` times the sampler). The
    draw does not depend on the order they come in."""
    k = min(NUCLEUS_FIRST_K, probs.size)
    top = numpy.sort(numpy.argpartition(probs, probs.size - k)[probs.size - k :])  # tied tokens in id order
    top = top[numpy.argsort(-probs[top], kind="stable")]
    kept = _kept(probs[top], top_p)
    if not kept[-1] or k == probs.size:
        return probs[top[kept]], top[kept]
    descending = numpy.sort(probs)[::-1]
    size = int(numpy.count_nonzero(_kept(descending, top_p)))
    smallest = descending[size - 1]
    above = numpy.flatnonzero(probs > smallest)
    ties = numpy.flatnonzero(probs == smallest)[: size - above.size]  # as many of the tied as the nucleus holds
    tokens = numpy.concatenate([above, ties])
    return probs[tokens], tokens


def _kept(descending: numpy.ndarray, top_p: float) -> numpy.ndarray:
    """Which of these probabilities (descending) the nucleus keeps: those with less than top_p before them."""
    return numpy.cumsum(descending, dtype=numpy.float64) - descending < top_p


def _draw(weights: numpy.ndarray, generator) -> int:
    """An index into `weights`, with probability proportional to its weight (inverse CDF of one uniform draw)."""
    cdf = numpy.cumsum(weights, dtype=numpy.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64).item() * cdf[-1]
    return int(numpy.searchsorted(cdf, u, side="right"))
