"""The `etblocks` command's YAML config file: one flat mapping holding the same options as the flags.

```yaml
# export
model: demo            # or a local Hugging Face checkpoint directory (config.json + *.safetensors)
backend: xnnpack
out: model.pte
max_seq_len: 256
verify: true
sdpa: custom           # or dynamic / static; omit for the backend recipe's choice
shapes: static         # static prefill + decode program (NPU backends have it by default)
chunk: 32              # the prefill method's fixed token count (static programs)
moe: gather            # MoE experts: gather (top-k only) or dense (every expert); omit for the recipe's choice
kv_quantize: int8      # int8 KV caches (a scale and zero point per token and head); omit for float caches
quantize: 16a8w        # QnnQuantizer precision for static programs (16a8w, 16a4w, 8a8w), torchao weight
                       # quantization for xnnpack (8da4w, 8da8w), or none; default: the recipe's
group_size: 32         # 8da4w: inputs per int4 weight scale (a multiple of 32)
quantize_embedding: int8  # xnnpack: the token embedding as int8 rows; omit for float
check: false           # qnn: print the readiness report instead of lowering (no Qualcomm SDK needed)
adapters:              # LoRA adapters (PEFT or torchtune directories) shipped as <out stem>.<name>.ptd files
  chat: adapters/chat  # or, as the flag takes them, a list: ["chat=adapters/chat"]
calibration: prompts.txt  # quantization calibration: one prompt of comma-separated token ids per line
# run
pte: model.pte         # defaults to `out` when only `out` is given
prompt_ids: [1, 2, 3]  # or "1,2,3"; or `prompt: text` with `tokenizer: tokenizer.json`
max_new_tokens: 32
temperature: 0.0
top_p: 1.0
seed: 0
adapter: chat          # run with this adapter: a name exported next to pte, or name=file.ptd
adapter_scale: 1.0     # multiplies the adapter's update
```

Flags given on the command line override the file. `null` (or an empty value) means "not set". Relative paths
are taken relative to the working directory. Every problem raises `ConfigError` naming the key, the value, the
line and what is accepted.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from etblocks.errors import ConfigError


class _Rejected(Exception):
    """A value does not fit its option; the message says what is accepted."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Rejected("give a non-empty string")
    return value


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Rejected("give a path (a non-empty string)")
    return value


def _int_at_least(minimum: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not _is_int(value) or value < minimum:
            raise _Rejected(f"give an integer >= {minimum}")
        return value

    return check


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Rejected("give true or false")
    return value


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise _Rejected(f"choose one of {list(choices)}")
        return value

    return check


def _number(value: Any) -> float:
    if not _is_number(value):
        raise _Rejected("give a number")
    return float(value)


def _temperature(value: Any) -> float:
    if not _is_number(value) or value < 0:
        raise _Rejected("give a number >= 0 (0 is greedy)")
    return float(value)


def _top_p(value: Any) -> float:
    if not _is_number(value) or not 0 < value <= 1:
        raise _Rejected("give a number in (0, 1]")
    return float(value)


def read_calibration(path: str | Path) -> list[list[int]]:
    """Calibration prompts from a text file: one prompt of comma-separated token ids per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"calibration={str(path)!r} is not a file; give a text file with one prompt of comma-separated token ids per line")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                prompts.append(parse_prompt_ids(line.strip()))
            except _Rejected as exc:
                raise ConfigError(f"calibration file {str(path)!r}, line {number}: {line.strip()!r} is not accepted; {exc}") from None
    if not prompts:
        raise ConfigError(f"calibration file {str(path)!r} holds no prompts; give one prompt of comma-separated token ids per line")
    return prompts


def _adapter_dirs(value: Any) -> dict[str, str]:
    """`{name: directory}` from a mapping or from "NAME=DIR" strings (the repeated flag)."""
    accepted = 'give NAME=DIR entries such as ["chat=adapters/chat"], or a mapping {chat: adapters/chat}'
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        pairs = [v.split("=", 1) if "=" in v else [v, ""] for v in value]
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise _Rejected(accepted)
    if not pairs or not all(isinstance(n, str) and n.strip() and isinstance(d, str) and d.strip() for n, d in pairs):
        raise _Rejected(accepted)
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise _Rejected(f"adapter names must differ; got {names}")
    return dict(pairs)


def _adapter_choice(value: Any) -> tuple[str, str | None]:
    """`(name, file or None)` from "NAME" (the file written next to the .pte) or "NAME=FILE.ptd"."""
    name, separator, file = _text(value).partition("=")
    if not name.strip() or (separator and not file.strip()):
        raise _Rejected("give an adapter name, or NAME=FILE.ptd")
    return name, file or None


def parse_prompt_ids(value: Any) -> list[int]:
    """Token ids from a list of integers or a comma-separated string such as "1,2,3"."""
    accepted = 'give a non-empty list of token ids >= 0, such as [1, 2, 3] or "1,2,3"'
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        if not all(part.isdigit() for part in parts):
            raise _Rejected(accepted)
        value = [int(part) for part in parts]
    if not isinstance(value, list) or not value or not all(_is_int(v) and v >= 0 for v in value):
        raise _Rejected(accepted)
    return list(value)


@dataclass(frozen=True)
class Option:
    """One option: its flag, the commands that use it, and its check (returns the normalized value)."""

    name: str
    flag: str
    commands: tuple[str, ...]
    check: Callable[[Any], Any]


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option("model", "--model", ("export",), _text),
        Option("backend", "--backend", ("export",), _text),
        Option("out", "--out", ("export",), _path),
        Option("max_seq_len", "--max-seq-len", ("export",), _int_at_least(2)),
        Option("verify", "--verify/--no-verify", ("export",), _bool),
        Option("sdpa", "--sdpa", ("export",), _choice("custom", "dynamic", "static")),
        Option("shapes", "--shapes", ("export",), _choice("dynamic", "static")),
        Option("chunk", "--chunk", ("export",), _int_at_least(2)),
        Option("moe", "--moe", ("export",), _choice("dense", "gather")),
        Option("kv_quantize", "--kv-quantize", ("export",), _choice("int8")),
        Option("quantize", "--quantize", ("export",), _choice("none", "16a8w", "16a4w", "8a8w", "8da4w", "8da8w")),
        Option("group_size", "--group-size", ("export",), _int_at_least(1)),
        Option("quantize_embedding", "--quantize-embedding", ("export",), _choice("int8")),
        Option("check", "--check", ("export",), _bool),
        Option("calibration", "--calibration", ("export",), _path),
        Option("adapters", "--adapter", ("export",), _adapter_dirs),
        Option("pte", "--pte", ("run",), _path),
        Option("prompt_ids", "--prompt-ids", ("run",), parse_prompt_ids),
        Option("prompt", "--prompt", ("run",), _text),
        Option("tokenizer", "--tokenizer", ("run",), _path),
        Option("max_new_tokens", "--max-new-tokens", ("run",), _int_at_least(1)),
        Option("temperature", "--temperature", ("run",), _temperature),
        Option("top_p", "--top-p", ("run",), _top_p),
        Option("seed", "--seed", ("run",), _int_at_least(0)),
        Option("adapter", "--adapter", ("run",), _adapter_choice),
        Option("adapter_scale", "--adapter-scale", ("run",), _number),
    )
}

DEFAULTS: dict[str, Any] = {
    "backend": "xnnpack",
    "out": "model.pte",
    "verify": True,
    "group_size": 32,
    "max_new_tokens": 32,
    "temperature": 0.0,
    "top_p": 1.0,
}


def check_option(name: str, value: Any, where: str) -> Any:
    """The normalized value of option `name`; `ConfigError` naming `where` (a flag or a file line) if rejected."""
    if name not in OPTIONS:
        raise ConfigError(f"{where}: unknown option {name!r}; accepted: {', '.join(sorted(OPTIONS))}")
    try:
        return OPTIONS[name].check(value)
    except _Rejected as exc:
        raise ConfigError(f"{where}: {name}={value!r} ({type(value).__name__}) is not accepted; {exc}") from None


@dataclass
class ConfigFile:
    """A loaded config file: validated `values` and the 1-based `lines` they were given on."""

    path: Path | None
    values: dict[str, Any] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)

    def where(self, key: str) -> str:
        name = f"config file {str(self.path)!r}" if self.path is not None else "config"
        return f"{name}, line {self.lines[key]}" if key in self.lines else name


def load_config(path: str | Path) -> ConfigFile:
    """Read and validate a YAML config file."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"config file {str(path)!r} {what}; give the path of a YAML file mapping options to values "
            f"(accepted keys: {', '.join(sorted(OPTIONS))})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read as UTF-8 text: {exc}") from None
    return parse_config(text, path)


def parse_config(text: str, path: str | Path | None = None) -> ConfigFile:
    """Validate the YAML `text` of a config file (`path` only names it in messages)."""
    import yaml

    config = ConfigFile(Path(path) if path is not None else None)
    name = config.where("")
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:  # an empty file (or only comments) sets nothing
            return config
        if not isinstance(root, yaml.MappingNode):
            got = "a list" if isinstance(root, yaml.SequenceNode) else f"the scalar {root.value!r}"
            raise ConfigError(
                f"{name}, line {root.start_mark.line + 1}: the file must hold a mapping of option: value "
                f"(such as `backend: xnnpack`); got {got}"
            )
        loader.flatten_mapping(root)  # resolves `<<:` merge keys
        for key_node, value_node in root.value:
            line = key_node.start_mark.line + 1
            key = loader.construct_object(key_node, deep=True)
            value = loader.construct_object(value_node, deep=True)
            if not isinstance(key, str) or key not in OPTIONS:
                close = difflib.get_close_matches(str(key), list(OPTIONS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"{name}, line {line}: unknown key {key!r}{hint}; accepted keys: {', '.join(sorted(OPTIONS))}"
                )
            if key in config.lines:
                raise ConfigError(f"{name}, line {line}: key {key!r} is given twice (first on line {config.lines[key]})")
            config.lines[key] = line
            if value is not None:
                config.values[key] = check_option(key, value, f"{name}, line {line}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{name} is not valid YAML{at}: {problem}") from None
    finally:
        loader.dispose()
    return config


@dataclass
class Resolved:
    """Options for one command after merging defaults, the config file and flags; `sources` says where each
    value came from (a flag, a config line, or "default"), for error messages."""

    values: dict[str, Any]
    sources: dict[str, str]

    def __getitem__(self, key: str) -> Any:
        return self.values.get(key)

    def where(self, key: str) -> str:
        return self.sources.get(key, "default")


def resolve(command: str, flags: dict[str, Any], config: ConfigFile | None = None) -> Resolved:
    """Merge for `command`: defaults < config file < flags. Flag values equal to None count as not given.

    For `run`, `pte` falls back to the config file's `out` (the file an `export` with the same config wrote).
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, option in OPTIONS.items():
        if command not in option.commands:
            continue
        if name in DEFAULTS:
            values[name], sources[name] = DEFAULTS[name], "default"
        if config is not None and name in config.values:
            values[name], sources[name] = config.values[name], config.where(name)
        if flags.get(name) is not None:
            flag = option.flag.split("/")[0] if flags[name] is not False else option.flag.split("/")[-1]
            values[name] = check_option(name, flags[name], flag)
            sources[name] = flag
    if command == "run" and "pte" not in values and config is not None and "out" in config.values:
        values["pte"], sources["pte"] = config.values["out"], config.where("out")
    return Resolved(values, sources)
