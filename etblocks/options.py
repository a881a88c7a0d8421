"""Every option of the `etblocks` command, declared once: its flag, YAML key, help, default and check.

The CLI builds its parser from these declarations, the YAML config validates its keys with them, and the Python
API checks its keyword arguments with the same checks (`check`), so a value is accepted or refused the same way,
with the same message, wherever it comes from. Backends declare their own options (`Backend.options`), which reach
the CLI as `--<backend>-<option>` and the YAML file as `<backend>_<option>`.

Imports nothing heavy: `etblocks --help` reads these without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from etblocks.errors import ConfigError

WEIGHT_RECIPES = ("4bit", "8bit")  # the weight quantization that keeps a real model (`etblocks.export.weights`)
WEIGHT_SCHEMES = (*WEIGHT_RECIPES, "8da4w", "8da8w")  # and torchao's schemes as ExecuTorch's LLM export applies them
EMBEDDING_SCHEMES = ("int8",)
DEFAULT_GROUP_SIZE = 32


class Rejected(Exception):
    """A value does not fit its option; the message says what is accepted."""


@dataclass(frozen=True)
class Option:
    """One option. `name` is the Python keyword and YAML key; the flag is `--name-with-dashes` unless `flag` says
    otherwise. `parse` checks a value (from a flag, a YAML file or Python) and returns it normalized, or raises
    `Rejected`. `kind` is what argparse turns the flag's text into (`bool`: a `--x/--no-x` pair; `"switch"`: a flag
    without value; `"append"`: a repeatable flag). `choices` are shown in usage lines; `choice()` declares an option
    that accepts exactly its choices."""

    name: str
    commands: tuple[str, ...]
    parse: Callable[[Any], Any]
    help: str
    default: Any = None
    kind: Any = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    flag: str | None = None

    @property
    def flags(self) -> tuple[str, ...]:
        """The command-line spellings: one, or the `--x`, `--no-x` pair of a boolean."""
        flag = self.flag or "--" + self.name.replace("_", "-")
        return (flag, "--no-" + flag[2:]) if self.kind is bool else (flag,)

    def renamed(self, name: str, help: str) -> Option:
        """The same option under another name and help (a backend's option as the CLI and YAML know it)."""
        return replace(self, name=name, help=help, flag=None)

    def describe(self) -> str:
        """The help text with its default."""
        if self.default is None or self.kind == "switch":
            return self.help
        return f"{self.help}; default: {str(self.default).lower() if isinstance(self.default, bool) else self.default}"

    def placeholder(self) -> str:
        """What the flag's value looks like in usage lines: its choices, argparse's way, or its metavar."""
        return "{" + ",".join(self.choices) + "}" if self.choices else self.metavar or self.name.upper()


def check(option: Option, value: Any, where: str | None = None) -> Any:
    """`value` normalized by `option`; `ConfigError` naming `where` (a flag, a file line; None: a Python argument),
    the option, the value and what is accepted."""
    try:
        return option.parse(value)
    except Rejected as exc:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{option.name}={value!r} ({type(value).__name__}) is not accepted; {exc}") from None


# ----------------------------------------------------------------------------------------------- value checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Rejected("give a non-empty string")
    return value


def path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Rejected("give a path (a non-empty string)")
    return value


def int_at_least(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if not _is_int(value) or value < minimum:
            raise Rejected(f"give an integer >= {minimum}")
        return value

    return parse


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Rejected("give true or false")
    return value


def one_of(*choices: str, none: bool = False) -> Callable[[Any], str | None]:
    """One of `choices`; with `none`, also None (Python) or "none" (flags, YAML), which mean "not applied"."""

    def parse(value: Any) -> str | None:
        if none and value in (None, "none"):
            return None
        if value not in choices:
            raise Rejected(f"choose one of {list(choices) + (['none'] if none else [])}")
        return value

    return parse


def number(value: Any) -> float:
    if not _is_number(value):
        raise Rejected("give a number")
    return float(value)


def temperature(value: Any) -> float:
    if not _is_number(value) or value < 0:
        raise Rejected("give a number >= 0 (0 is greedy)")
    return float(value)


def fraction_at_least_zero(value: Any) -> float:
    if not _is_number(value) or value < 0:
        raise Rejected("give a number >= 0 (a fraction: 0.03 allows 3 percent more perplexity)")
    return float(value)


def top_p(value: Any) -> float:
    if not _is_number(value) or not 0 < value <= 1:
        raise Rejected("give a number in (0, 1]")
    return float(value)


def float_dtype(value: Any):
    """A floating `torch.dtype`, given as one or by name ("float16")."""
    import torch

    if isinstance(value, str):
        value = getattr(torch, value, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise Rejected("give a floating dtype: float32, float16 or bfloat16 (a torch.dtype in Python)")
    return value


def token_ids(value: Any) -> list[int]:
    """Token ids from a list of integers or a comma-separated string such as "1,2,3"."""
    accepted = 'give a non-empty list of token ids >= 0, such as [1, 2, 3] or "1,2,3"'
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        if not all(part.isdigit() for part in parts):
            raise Rejected(accepted)
        value = [int(part) for part in parts]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not value or not all(_is_int(v) and v >= 0 for v in value):
        raise Rejected(accepted)
    return list(value)


def activation_scheme(value: Any) -> str | None:
    """A pt2e activation quantization scheme of the swap's backend ("16a8w", ...), "auto" or none; the backend
    checks the scheme itself."""
    if value in (None, "none"):
        return None
    if not isinstance(value, str) or not value.strip():
        raise Rejected("give a scheme the swap's backend quantizes with (e.g. 16a8w for qnn), auto or none")
    return value


def adapter_dirs(value: Any) -> dict[str, str]:
    """`{name: directory}` from a mapping or from "NAME=DIR" strings (the repeated flag)."""
    accepted = 'give NAME=DIR entries such as ["chat=adapters/chat"], or a mapping {chat: adapters/chat}'
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        pairs = [v.split("=", 1) if "=" in v else [v, ""] for v in value]
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise Rejected(accepted)
    if not pairs or not all(isinstance(n, str) and n.strip() and isinstance(d, str) and d.strip() for n, d in pairs):
        raise Rejected(accepted)
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise Rejected(f"adapter names must differ; got {names}")
    return dict(pairs)


def adapter_choice(value: Any) -> tuple[str, str | None]:
    """`(name, file or None)` from "NAME" (the file written next to the .pte) or "NAME=FILE" (.ptd or .pte)."""
    name, separator, file = text(value).partition("=")
    if not name.strip() or (separator and not file.strip()):
        raise Rejected("give an adapter name, or NAME=FILE (an adapter file .ptd or adapter program .pte)")
    return name, file or None


def choice(name: str, commands: tuple[str, ...], choices: tuple[str, ...], help: str, *, none: bool = False) -> Option:
    """An option whose value is one of `choices` (with `none`: or None / "none")."""
    return Option(name, commands, one_of(*choices, none=none), help, choices=choices)


# ----------------------------------------------------------------------------------------------- the options

ADAPTER_MODES = ("slots", "programs")  # `etblocks.export.adapters` says what each is

EXPORT, RUN, CHAT, EVAL = ("export",), ("run",), ("chat",), ("eval",)
GENERATE = RUN + CHAT  # options of every command that generates
PROGRAM = GENERATE + EVAL  # options of every command that runs a program

# The swap recipe's choices (`etblocks.swap.recipes.Recipe` documents what each means).
RECIPE_OPTIONS = (
    choice("sdpa", EXPORT, ("custom", "dynamic", "static"), "attention kernel: llama::custom_sdpa, plain torch masked "
           "from positions, or plain torch with the caller's mask; default: the backend's"),
    choice("cache_update", EXPORT, ("custom", "index_copy"), "how in-place caches are written: llama::update_cache "
           "(with_indices for rings) or index_copy_; default: the backend's"),
    choice("shapes", EXPORT, ("dynamic", "static"), "dynamic: one forward with T dynamic; static: prefill + decode with "
           "fixed shapes; default: the backend's"),
    choice("cache", EXPORT, ("inplace", "io"), "state kept in the program (inplace) or owned by its caller (io, static "
           "programs); default: the backend's"),
    Option("chunk", EXPORT, int_at_least(2), "tokens per prefill call of a static program (default: 32)", kind=int, metavar="N"),
    choice("attention", EXPORT, ("mha", "sha"), "heads in one tensor (mha) or one computation per head (sha, for "
           "Qualcomm HTP); default: the backend's"),
    choice("linear", EXPORT, ("linear", "conv2d"), "per-head projections as linears or 1x1 convolutions (conv2d, with "
           "attention sha); default: the backend's"),
    choice("partition", EXPORT, ("all", "hybrid"), "hybrid: delegate the fixed-shape parts of a static program and keep "
           "attention with its in-place cache on CPU; default: all"),
    choice("moe", EXPORT, ("dense", "gather"), "MoE experts: gather (only each token's top-k) or dense (every expert, "
           "no indexing); default: the backend's"),
    choice("delta_rule", EXPORT, ("fused", "chunked"), "gated DeltaNet recurrence: llama::gated_delta_rule (a CPU "
           "kernel) or the chunked form in matmuls (any backend); default: the backend's"),
    choice("kv_quantize", EXPORT, ("int8",), "KV caches in int8 with a scale and zero point per token and "
           "head; default: float", none=True),
    Option("dtype", EXPORT, float_dtype, "floating dtype of the swapped model and its state; default: float32",
           choices=("float32", "float16", "bfloat16")),
)

OPTIONS_LIST = (
    Option("model", EXPORT, text, "'demo' (a tiny Llama with random weights) or a local Hugging Face checkpoint directory"),
    Option("backend", EXPORT, text, "the ExecuTorch backend to export for (`etblocks backends` lists them)", default="xnnpack"),
    Option("out", EXPORT, path, "where to write the .pte", default="model.pte", metavar="PTE"),
    Option("max_seq_len", EXPORT, int_at_least(2), "context length (default: the model's, at most 2048)", kind=int, metavar="N"),
    Option("verify", EXPORT, boolean, "compare each swapped module with the original before changing the model",
           default=True, kind=bool),
    *RECIPE_OPTIONS,
    Option("bos_id", EXPORT, int_at_least(0), "BOS token id stored in the program (default: the model config's)", kind=int,
           metavar="ID"),
    Option("eos_ids", EXPORT + GENERATE, token_ids, "token ids that end generation (export: stored in the program, default the "
           "model config's; run: instead of the program's)", metavar="IDS"),
    choice("quantize_weights", EXPORT, WEIGHT_SCHEMES, "weight quantization, for a backend whose kernels run it "
           "(xnnpack): 4bit (the default 4-bit recipe: asymmetric int4 groups, kept as they are in a GGUF file, an int8 "
           "output layer and embedding), 8bit (int8 weights, int4 groups of a GGUF file kept), or torchao's 8da4w (int8 "
           "dynamic activations, symmetric int4 weights with a scale per --group-size inputs) and 8da8w (int8 weights, "
           "a scale per output channel)", none=True),
    Option("group_size", EXPORT, int_at_least(1), "4bit, 8bit, 8da4w: inputs per int4 weight scale, a multiple of 32 dividing every "
           "linear's input size", default=DEFAULT_GROUP_SIZE, kind=int, metavar="N"),
    choice("quantize_embedding", EXPORT, EMBEDDING_SCHEMES, "the token embedding as int8 rows with a "
           "scale per row", none=True),
    Option("quantize_activations", EXPORT, activation_scheme, "calibrated quantization of a static program's activations "
           "and weights by the quantizer of the backend it was swapped for (qnn: 16a8w, 16a4w, 8a8w), none, or auto: "
           "that backend's default when exporting to it", default="auto", metavar="SCHEME"),
    Option("calibration", EXPORT, path, "prompts to calibrate --quantize-activations with: one prompt of comma-separated "
           "token ids per line (default: seeded random ids, a rough calibration)", metavar="TXT"),
    Option("adapters", EXPORT, adapter_dirs, "a LoRA adapter (PEFT or torchtune directory) shipped as <out stem>.NAME.ptd "
           "(.pte with --adapter-mode programs); repeat for more", kind="append", metavar="NAME=DIR", flag="--adapter"),
    Option("adapter_mode", EXPORT, one_of(*ADAPTER_MODES), "how adapters ship: slots (one program, each adapter a "
           "<out stem>.NAME.ptd of its tensors, switched in milliseconds) or programs (the base weights in <out stem>.ptd, "
           "each adapter a small <out stem>.NAME.pte holding its tensors as constants: the base's decode speed, a "
           "switch loads that program; dynamic programs on xnnpack or portable)", default="slots",
           choices=ADAPTER_MODES, metavar="MODE"),
    Option("check_accuracy", EXPORT, path, "score the written program on this text file against the unquantized model "
           "(perplexity ratio, top-1, KL; dynamic programs) and report it", metavar="FILE"),
    Option("max_perplexity_increase", EXPORT, fraction_at_least_zero, "with --check-accuracy: a program whose perplexity "
           "exceeds the model's by more than this fraction (0.03: 3 percent) is an error (exit 2) and no file is kept",
           kind=float, metavar="F"),
    Option("check", EXPORT, boolean, "print the backend's readiness report of the program instead of lowering (qnn: every "
           "op against ExecuTorch's QNN op builders, no Qualcomm SDK needed); exit code 1 if not ready", kind="switch"),
    Option("pte", PROGRAM, path, "the .pte to run (default: the config's pte, else its out)"),
    Option("data_path", PROGRAM, path, "a .ptd file holding the program's weights, if they were written apart", metavar="PTD"),
    Option("prompt_ids", RUN, token_ids, "comma-separated prompt token ids, e.g. 1,2,3", metavar="IDS"),
    Option("prompt", RUN, text, "prompt text, encoded with the program's tokenizer (the one saved beside the .pte, "
           "or --tokenizer)", metavar="TEXT"),
    Option("text", EVAL, path, "the text file to score (encoded with the program's tokenizer)", metavar="FILE"),
    Option("window", EVAL, int_at_least(2), "tokens per scored window, each a new sequence (default: the program's "
           "context)", kind=int, metavar="N"),
    Option("system", CHAT, text, "a system message that starts the conversation", metavar="TEXT"),
    Option("tokenizer", EXPORT + PROGRAM, path, "export: the tokenizer saved beside the .pte as <stem>.tokenizer/ (a "
           "directory or tokenizer.json; default: the checkpoint's own); run, chat, eval: instead of the one beside the .pte",
           metavar="PATH"),
    Option("max_new_tokens", GENERATE, int_at_least(1), "tokens to generate at most (per turn in chat)", default=32,
           kind=int, metavar="N"),
    Option("temperature", GENERATE, temperature, "0 is greedy", default=0.0, kind=float, metavar="T"),
    Option("top_p", GENERATE, top_p, "nucleus sampling mass in (0, 1]", default=1.0, kind=float, metavar="P"),
    Option("seed", GENERATE, int_at_least(0), "random seed for sampling", kind=int, metavar="S"),
    Option("adapter", PROGRAM, adapter_choice, "run with this LoRA adapter: NAME (exported next to the .pte) or NAME=FILE "
           "(an adapter file, .ptd, or an adapter program, .pte)",
           metavar="NAME"),
    Option("adapter_scale", PROGRAM, number, "multiply the adapter's update by S (default: 1)", kind=float, metavar="S"),
    choice("speculate", GENERATE, ("prompt_lookup", "draft"), "speculative decoding: propose tokens and check them in "
           "one call (same tokens at temperature 0, same distribution when sampling); prompt_lookup: the tokens that "
           "followed the latest earlier occurrence of the text's end; draft: generated by the draft model exported into "
           "the .pte (export --draft-model)", none=True),
    Option("draft_model", EXPORT, text, "speculative decoding: a smaller local checkpoint directory with the same "
           "tokenizer, swapped like the model and exported into the same .pte as its draft (with --max-draft; run "
           "--speculate draft)", metavar="PATH"),
    Option("max_draft", EXPORT + GENERATE, int_at_least(1), "speculative decoding: export: a dynamic program also gets a "
           "verify method that checks up to N proposed tokens per call; run, chat: propose up to N per call with "
           "--speculate (default: 4)", kind=int, metavar="N"),
    Option("decode_tail", PROGRAM, int_at_least(1), "static programs: a prompt remainder of at most this many tokens goes "
           "through decode instead of a padded prefill (default: chunk // 8)", kind=int, metavar="N"),
)

OPTIONS: dict[str, Option] = {option.name: option for option in OPTIONS_LIST}
RECIPE_KEYS = tuple(option.name for option in RECIPE_OPTIONS)

