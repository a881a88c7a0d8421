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
quantize_weights: 8da4w   # torchao weight quantization for xnnpack (8da4w, 8da8w), or none
group_size: 32         # 8da4w: inputs per int4 weight scale (a multiple of 32)
quantize_embedding: int8  # xnnpack: the token embedding as int8 rows; omit for float
quantize_activations: 16a8w  # calibrated quantization of a static program by the swap backend's quantizer
                       # (qnn: 16a8w, 16a4w, 8a8w), or none; default: the backend's own when exporting to it
qnn_chipset: SM8650    # a backend's own option: <backend>_<option>
check: false           # qnn: print the readiness report instead of lowering (no Qualcomm SDK needed)
adapters:              # LoRA adapters (PEFT or torchtune directories) shipped as <out stem>.<name>.ptd files
  chat: adapters/chat  # or, as the flag takes them, a list: ["chat=adapters/chat"]
calibration: prompts.txt  # quantization calibration: one prompt of comma-separated token ids per line
# run
pte: model.pte         # defaults to `out` when only `out` is given
prompt_ids: [1, 2, 3]  # or "1,2,3"; or `prompt: text` (the tokenizer saved beside the .pte, or `tokenizer:`)
max_new_tokens: 32
temperature: 0.0
top_p: 1.0
seed: 0
adapter: chat          # run with this adapter: a name exported next to pte, or name=file.ptd
adapter_scale: 1.0     # multiplies the adapter's update
```

Every key is an option declared in `etblocks.options` (or a backend's own option), the same the flags are built
from; `etblocks export --help` lists them all. Flags given on the command line override the file. `null` (or an
empty value) means "not set". Relative paths are taken relative to the working directory. The problems of a file
(unknown keys, repeated keys, values refused) are reported together in one `ConfigError`, each naming the key, the
value, the line and what is accepted.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etblocks.errors import ConfigError
from etblocks.options import OPTIONS, PROGRAM, Option, Rejected, check, token_ids


def read_calibration(path: str | Path) -> list[list[int]]:
    """Calibration prompts from a text file: one prompt of comma-separated token ids per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"calibration={str(path)!r} is not a file; give a text file with one prompt of comma-separated token ids per line")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                prompts.append(token_ids(line.strip()))
            except Rejected as exc:
                raise ConfigError(f"calibration file {str(path)!r}, line {number}: {line.strip()!r} is not accepted; {exc}") from None
    if not prompts:
        raise ConfigError(f"calibration file {str(path)!r} holds no prompts; give one prompt of comma-separated token ids per line")
    return prompts


def all_options() -> dict[str, Option]:
    """Every option of the command: etblocks' own and each backend's (`<backend>_<option>`)."""
    from etblocks.backends import command_options

    return {**OPTIONS, **{option.name: option for option in command_options()}}


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
            f"(accepted keys: {', '.join(sorted(all_options()))})"
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
        options = all_options()
        problems, unknown = [], False  # every problem of the file, said at once
        for key_node, value_node in root.value:
            line = key_node.start_mark.line + 1
            key = loader.construct_object(key_node, deep=True)
            value = loader.construct_object(value_node, deep=True)
            if not isinstance(key, str) or key not in options:
                close = difflib.get_close_matches(str(key), list(options), n=1)
                problems.append(f"line {line}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
                unknown = True
            elif key in config.lines:
                problems.append(f"line {line}: key {key!r} is given twice (first on line {config.lines[key]})")
            else:
                config.lines[key] = line
                try:
                    if value is not None:
                        config.values[key] = check(options[key], value, f"line {line}")
                except ConfigError as exc:
                    problems.append(str(exc))
        if problems:
            accepted = f"; accepted keys: {', '.join(sorted(options))}" if unknown else ""
            raise ConfigError(f"{name}, {'; '.join(problems)}{accepted}")
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

    For `run` and `chat`, `pte` falls back to the config file's `out` (the file an `export` with the same config wrote).
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, option in all_options().items():
        if command not in option.commands:
            continue
        if option.default is not None:
            values[name], sources[name] = option.default, "default"
        if config is not None and name in config.values:
            values[name], sources[name] = config.values[name], config.where(name)
        if flags.get(name) is not None:
            flag = option.flags[-1] if flags[name] is False else option.flags[0]
            values[name] = check(option, flags[name], flag)
            sources[name] = flag
    if command in PROGRAM and "pte" not in values and config is not None and "out" in config.values:
        values["pte"], sources["pte"] = config.values["out"], config.where("out")
    return Resolved(values, sources)
