"""The `etblocks` command: `export`, `run`, `chat` and `backends`.

    etblocks export --model demo|PATH --backend xnnpack --out model.pte [options]
    etblocks run --pte model.pte (--prompt TEXT | --prompt-ids 1,2,3) [options]
    etblocks chat --pte model.pte [--system TEXT] [options]
    etblocks backends [NAME ...]

Every flag comes from one declaration (`etblocks.options`, and each backend's own options), which also gives
the YAML config file its keys (`--config`, see `etblocks.config`); flags override the file. Errors etblocks
expects (bad options, unsupported models, missing backends) print `error: <message>` and exit with code 2.
Progress goes to stderr as `[  1.2s] message` lines (`etblocks.progress`); the dependencies' known noise stays
out of the terminal unless -v (`etblocks.noise`). `--help`, and refusing a value the options declare no place
for (an unknown backend, a bad choice), import no torch: they answer at once.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

from etblocks.config import Resolved, all_options, load_config, read_calibration, resolve
from etblocks.errors import ConfigError, ContextOverflowError, EtblocksError, ProgramFileError, exception_summary
from etblocks.noise import quiet
from etblocks.options import RECIPE_KEYS, Option
from etblocks.progress import LOGGER, shown, steps
from etblocks.threads import prefer_single_threaded_blas

EXIT_ERROR = 2
DEMO = "demo"
CHECKPOINT_NEEDED = ("give 'demo', a local Hugging Face checkpoint directory containing config.json and *.safetensors "
                     "weights, or a .gguf file")


# ----------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="etblocks",
        description="Export transformer LLMs to ExecuTorch .pte programs, run them, and see which backends work here.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_command(
        commands, "export", cmd_export,
        help="swap a model's attention for a backend and export it to a .pte",
        description="Load a model, swap its attention for the backend's blocks (verified against the original), "
        "export, lower and write a .pte. Flags override the --config file.",
    )

    _add_command(
        commands, "run", cmd_run,
        help="generate with an exported .pte, from text or token ids",
        description="Generate with a .pte written by `etblocks export`, through the ExecuTorch runtime: --prompt TEXT "
        "(encoded with the tokenizer saved beside the .pte; the reply streams as it is generated) or --prompt-ids. "
        "Flags override the --config file.",
    )

    _add_command(
        commands, "chat", cmd_chat,
        help="talk with an exported .pte, turn by turn",
        description="An interactive conversation with a .pte whose tokenizer has a chat template (saved beside it by "
        "`etblocks export`, or --tokenizer). Replies stream as they are generated; the program's state is kept "
        "between turns, so each turn prefills only its own tokens. /reset starts over; /exit or Ctrl-D ends.",
    )

    _add_command(
        commands, "eval", cmd_eval,
        help="score a text file with an exported .pte: perplexity",
        description="The perplexity of a .pte on a text file (encoded with the tokenizer beside the .pte, or "
        "--tokenizer), scored in windows of --window tokens, each a new sequence: every token but a window's first "
        "is scored given the tokens before it. Prints perplexity, tokens scored and time.",
    )

    backends = commands.add_parser(
        "backends",
        help="which backends are installed, lower and run here",
        description="Try every known backend on a tiny nn.Linear: import, lower, run and compare with eager.",
    )
    backends.add_argument("names", nargs="*", metavar="NAME", help="backends to probe (default: all)")
    backends.add_argument("-v", "--verbose", action="store_true", help="show the backends' own logs and warnings")
    backends.set_defaults(handler=cmd_backends)
    return parser


def _add_command(commands: Any, name: str, handler: Callable[[argparse.Namespace], int], **texts: str) -> None:
    """The subcommand `name` with a flag per declared option of its (`_add_options`), run by `handler`."""
    parser = commands.add_parser(name, **texts)
    _add_options(parser, name)
    parser.set_defaults(handler=handler)


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """A flag per declared option of `command`, plus --config and --verbose."""
    for option in all_options().values():
        if command not in option.commands:
            continue
        kwargs: dict[str, Any] = dict(dest=option.name, default=None, help=option.describe())
        if option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.kind == "switch":
            kwargs["action"] = "store_true"
        elif option.kind == "append":
            kwargs.update(action="append", metavar=option.placeholder())
        else:
            kwargs.update(type=option.kind, metavar=_placeholder(option))
        parser.add_argument(option.flags[0], **kwargs)
    parser.add_argument("--config", metavar="YAML", help="YAML file with the same options (keys as the flags, with _)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show library warnings and logs")


def _placeholder(option: Option) -> str:
    if option.name != "backend":
        return option.placeholder()
    from etblocks.backends import backends  # the backend option's choices are the registered backends

    return "{" + ",".join(b.name for b in backends()) + "}"


def _options(command: str, args: argparse.Namespace) -> Resolved:
    config = load_config(args.config) if args.config else None
    flags = {name: value for name, value in vars(args).items() if name in all_options()}
    return resolve(command, flags, config)


# ----------------------------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    options = _options("export", args)
    say = _progress()
    model_name = options["model"]
    if model_name is None:
        raise ConfigError(f"model is not set; give --model {DEMO} or --model PATH (a local HF checkpoint directory or a .gguf "
                          "file), or `model:` in a config file")
    if model_name != DEMO:
        _checkpoint_dir(model_name)  # before the backend checks, which import torch
    if options["draft_model"] is not None:
        _checkpoint_dir(options["draft_model"])
        if options["max_draft"] is None:
            raise ConfigError("draft_model is set without max_draft; give --max-draft N (tokens the draft proposes per call)")
    backend, overrides, backend_options, dtype = _check_backend(options, lower=not options["check"])
    _check_quantization(options, backend)
    calibration = read_calibration(options["calibration"]) if options["calibration"] else None
    out = Path(options["out"])
    tokenizer = _export_tokenizer(options)

    import etblocks

    if model_name == DEMO:
        from etblocks.demo import DEMO_DESCRIPTION, demo_model

        say("loading the demo model: RANDOM weights, for demonstration only")
        model = demo_model()
        print(f"NOTE: {DEMO_DESCRIPTION}", flush=True)
    else:
        say(f"loading {model_name}")
        model, file_tokenizer = load_model(model_name, dtype=dtype)
        tokenizer = file_tokenizer if tokenizer is None else tokenizer

    max_seq_len = options["max_seq_len"]
    verify = options["verify"]
    say(f"swapping attention for {backend}" + (" and verifying each layer against the original" if verify else " (verification off)"))
    start = time.perf_counter()
    etblocks.swap(model, backend=backend, max_seq_len=max_seq_len, verify=verify, **overrides)
    swap_seconds = time.perf_counter() - start
    info = model.etblocks_swap
    from etblocks.moe import MoE

    moe_blocks = sum(isinstance(m, MoE) for m in model.modules())
    moe = f" and {moe_blocks} MoE blocks (moe={info.recipe.moe})" if moe_blocks else ""
    say(f"swapped {len(info.converted)} attention modules{moe} (sdpa={info.recipe.sdpa}, max_seq_len={info.max_seq_len})")
    for name, directory in (options["adapters"] or {}).items():
        layers = etblocks.load_adapter(model, directory, name=name)
        say(f"loaded adapter {name!r} from {directory} ({len(layers)} layers)")

    if options["check"]:
        from etblocks.export.driver import check_readiness

        report = check_readiness(
            model, backend, quantize_activations=options["quantize_activations"], calibration=calibration
        )
        print(report, flush=True)
        return 0 if report.ready else 1
    draft = None
    if options["draft_model"] is not None:
        say(f"loading the draft model {options['draft_model']} and swapping it for {backend}")
        draft, _ = load_model(options["draft_model"], dtype=dtype)
        etblocks.swap(draft, backend=backend, max_seq_len=info.max_seq_len, verify=verify, **overrides)
    result = etblocks.export(
        model, backend=backend, out=out, max_seq_len=info.max_seq_len, bos_id=options["bos_id"],
        eos_ids=options["eos_ids"], quantize_weights=options["quantize_weights"], group_size=options["group_size"],
        quantize_embedding=options["quantize_embedding"], quantize_activations=options["quantize_activations"],
        calibration=calibration, backend_options=backend_options, tokenizer=tokenizer, max_draft=options["max_draft"],
        draft=draft, adapter_mode=options["adapter_mode"], check_accuracy=options["check_accuracy"],
        max_perplexity_increase=options["max_perplexity_increase"],
    )
    seconds = {"swap": swap_seconds, **result.seconds}
    print(_export_summary(result, model_name, seconds), flush=True)
    return 0


def _export_tokenizer(options: Resolved) -> Any:
    """--tokenizer, loaded before any model is (without it, `export` saves the checkpoint directory's own tokenizer,
    if it has one)."""
    if options["tokenizer"] is None:
        return None
    from etblocks.export.text import load_tokenizer

    try:
        return load_tokenizer(str(options["tokenizer"]))
    except ConfigError as exc:
        raise ConfigError(f"{options.where('tokenizer')}: {exc}") from None


def _check_backend(options: Resolved, lower: bool = True) -> tuple[str, dict, dict, Any]:
    """Backend, recipe overrides, backend options and the recipe's dtype, checked before any model is loaded
    (`lower=False`: the backend need not be usable here, e.g. a readiness check of QNN without its SDK)."""
    from etblocks.backends import backends, get_backend

    try:
        spec = get_backend(options["backend"])
    except ConfigError as exc:
        raise ConfigError(f"{options.where('backend')}: {exc}") from None
    if options["check"] and not spec.has_readiness:
        offered = sorted(b.name for b in backends() if b.has_readiness)
        raise ConfigError(
            f"{options.where('check')}: check is the readiness report of a backend that offers one ({offered}), not "
            f"backend={spec.name!r}"
        )
    backend_options, foreign = {}, []
    for backend in backends():
        for option in backend.options:
            key = f"{backend.name}_{option.name}"
            if options.where(key) == "default":
                continue
            if backend is spec:
                backend_options[option.name] = options[key]
            else:
                foreign.append(key)
    if foreign:
        raise ConfigError(f"{options.where(foreign[0])}: {foreign[0]} is an option of another backend, not of {spec.name!r}")
    try:
        if lower:
            spec.usable_partitioners(backend_options)  # typed errors now rather than after minutes of work
    except ConfigError as exc:
        raise ConfigError(f"{options.where('backend')}: {exc}") from None
    overrides = {key: options[key] for key in RECIPE_KEYS if options[key] is not None}
    from etblocks.swap.recipes import resolve_recipe  # imports torch: after the checks that need none

    try:
        recipe = resolve_recipe(spec.name, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"{', '.join(options.where(key) for key in overrides) or options.where('backend')}: {exc}") from None
    return spec.name, overrides, backend_options, recipe.dtype


def _check_quantization(options: Resolved, backend: str) -> None:
    """torchao weight quantization options checked before any model is loaded."""
    from etblocks.backends import get_backend
    from etblocks.export.weights import weight_quantization

    keys = [key for key in ("quantize_weights", "group_size", "quantize_embedding") if options.where(key) != "default"]
    try:
        weight_quantization(get_backend(backend), options["quantize_weights"], options["group_size"], options["quantize_embedding"])
    except ConfigError as exc:
        raise ConfigError(f"{', '.join(options.where(key) for key in keys) or options.where('backend')}: {exc}") from None


def load_model(path: str | Path, dtype=None) -> tuple[Any, Any]:
    """`(model, tokenizer)` of a GGUF file (`etblocks.load_gguf`, the file's tokenizer), else of a checkpoint
    directory (`load_checkpoint`; None: `export` finds the checkpoint's tokenizer itself)."""
    from etblocks.gguf import is_gguf, load_gguf

    if is_gguf(path):
        return load_gguf(path, dtype=dtype)
    return load_checkpoint(path, dtype=dtype), None


def load_checkpoint(path: str | Path, dtype=None):
    """`AutoModelForCausalLM.from_pretrained(path, local_files_only=True)` for a local checkpoint directory;
    `ConfigError` naming the path and what it must contain otherwise."""
    path = _checkpoint_dir(path)
    from transformers import AutoModelForCausalLM

    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as exc:  # transformers raises many types here (OSError, ValueError, KeyError, ...)
        raise ConfigError(
            f"model={str(path)!r} could not be loaded with AutoModelForCausalLM.from_pretrained: "
            f"{exception_summary(exc)}; {CHECKPOINT_NEEDED}"
        ) from exc
    return model.eval()


def _checkpoint_dir(path: str | Path) -> Path:
    """`path`, checked to be a GGUF file or a directory `load_checkpoint` can load (without importing transformers)."""
    from etblocks.gguf import is_gguf

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"model={str(path)!r} does not exist; {CHECKPOINT_NEEDED}")
    if is_gguf(path):
        return path
    if not path.is_dir():
        raise ConfigError(f"model={str(path)!r} is a file but not a GGUF file, nor a directory; {CHECKPOINT_NEEDED}")
    missing = [
        what
        for what, present in (("config.json", (path / "config.json").is_file()), ("*.safetensors", any(path.glob("*.safetensors"))))
        if not present
    ]
    if missing:
        found = sorted(p.name for p in path.iterdir())
        listing = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "") if found else "nothing"
        raise ConfigError(f"model={str(path)!r} has no {' and no '.join(missing)} (it holds: {listing}); {CHECKPOINT_NEEDED}")
    return path


def _export_summary(result, model_name: str, seconds: dict[str, float]) -> str:
    from etblocks.export.adapters import ADAPTERS_METHOD
    from etblocks.export.contract import CONTRACT_METHOD, StaticContract

    from etblocks.export.weights import QUANTIZATION_METHOD

    hidden = (CONTRACT_METHOD, ADAPTERS_METHOD, QUANTIZATION_METHOD)
    metadata = ", ".join(f"{k}={v}" for k, v in result.metadata.items() if k not in hidden)
    timings = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
    weights = "RANDOM weights (demo model, for demonstration only)" if model_name == DEMO else f"from {model_name}"
    lines = [
        f"exported {result.path}",
        f"  size        {result.size_mb:.2f} MB",
        f"  backend     {result.backend}",
        f"  model       {weights}",
        f"  methods     {', '.join(result.methods)}",
        f"  delegation  {result.delegation}",
        f"  quantized   {result.quantize or 'none'}",
        f"  metadata    {metadata}",
        f"  time        {timings}",
        f"next: etblocks run --pte {result.path} "
        + ("--prompt 'Once upon a time'" if result.tokenizer else "--prompt-ids 1,2,3") + " --max-new-tokens 16",
    ]
    if result.accuracy is not None:
        lines.insert(-1, f"  accuracy    {result.accuracy}")
    if result.quantized:
        lines.insert(-1, f"  modules     {_held(result.quantized)}")
    if result.tokenizer:
        lines.insert(-1, f"  tokenizer   {result.tokenizer} (from {result.tokenizer_source})")
    if result.data_path:
        lines.insert(-1, f"  weights     {result.data_path} ({result.data_path.stat().st_size / 1e6:.2f} MB)")
    for name, file in result.adapters.items():
        lines.insert(-1, f"  adapter     {name}: {file} ({file.stat().st_size / 1e6:.3f} MB)")
    if result.adapters:
        lines[-1] += f" --adapter {next(iter(result.adapters))}"
    if CONTRACT_METHOD in result.metadata:
        lines.insert(-2, f"  contract    {StaticContract.from_constant(result.metadata[CONTRACT_METHOD])}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    prefer_single_threaded_blas()
    options = _options("run", args)
    if options["prompt_ids"] is not None and options["prompt"] is not None:
        raise ConfigError(
            f"both prompt_ids ({options.where('prompt_ids')}) and prompt ({options.where('prompt')}) are set; give one"
        )
    if options["prompt_ids"] is None and options["prompt"] is None:
        raise ConfigError("no prompt; give --prompt TEXT or --prompt-ids 1,2,3")
    say = _progress()
    runner = _generating_runner(options, say)
    text = options["prompt"] is not None
    prompt = options["prompt"] if text else options["prompt_ids"]
    try:
        stream = runner.stream(prompt, **_generation(options))
    except ContextOverflowError as exc:
        raise _overflow(exc, options) from None
    start = time.perf_counter()
    if text:
        for piece in stream:
            print(piece, end="", flush=True)
        print(flush=True)
        new_ids = runner.last_ids
    else:
        new_ids = list(stream)
        print(f"prompt ids: {','.join(map(str, prompt))}")
        print(f"generated ids: {','.join(map(str, new_ids))}")
    elapsed = time.perf_counter() - start
    eos_ids = options["eos_ids"] or runner.eos_ids
    stopped = "EOS" if new_ids and new_ids[-1] in eos_ids else "max_new_tokens"
    summary = (f"{len(new_ids)} tokens in {elapsed:.2f} s ({len(new_ids) / max(elapsed, 1e-9):.1f} tok/s incl. "
               f"prefill); stopped at {stopped}")
    if runner.last_speculation is not None:
        summary += _speculation_summary(runner.last_speculation)
    print(summary, file=sys.stderr if text else sys.stdout, flush=True)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    prefer_single_threaded_blas()
    options = _options("eval", args)
    if options["text"] is None:
        raise ConfigError("no text; give --text FILE (the text to score)")
    try:
        text = Path(options["text"]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"text={str(options['text'])!r} ({options.where('text')}) cannot be read as UTF-8 text: {exc}") from None
    runner = _generating_runner(options, _progress())
    quantization = runner.quantization
    if quantization is not None:
        print(f"weights: {quantization['scheme']}; {_held(quantization['modules'])}", flush=True)
    start = time.perf_counter()
    result = runner.perplexity(text, window=options["window"])
    elapsed = time.perf_counter() - start
    print(f"{result}; {elapsed:.2f} s ({result.tokens / max(elapsed, 1e-9):.1f} tokens/s scored)", flush=True)
    return 0


def _held(modules: dict[str, str]) -> str:
    """What quantized modules hold, counted: "210 int4 groups, kept, 1 int8 rows (output layer), ..."."""
    return ", ".join(f"{count} {how}" for how, count in Counter(modules.values()).items())


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive conversation: each line typed is a user turn; the reply streams as it is generated. The
    program's state is kept between turns, so a turn prefills only its own tokens. Ends at EOF (Ctrl-D) or /exit;
    /reset starts over."""
    prefer_single_threaded_blas()
    from etblocks.export.chat import Chat

    options = _options("chat", args)
    runner = _generating_runner(options, _progress())
    generation = _generation(options)
    chat = Chat(runner, system=options["system"], **generation)
    chat.check()
    print("chat: type a message and press Enter; /reset starts over, /exit or Ctrl-D ends", flush=True)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(flush=True)
            return 0
        if line == "/exit":
            return 0
        if line == "/reset":
            chat = Chat(runner, system=options["system"], **generation)
            print("(new conversation)", flush=True)
            continue
        if not line:
            continue
        start = time.perf_counter()
        try:
            for piece in chat.stream(line):
                print(piece, end="", flush=True)
        except ContextOverflowError as exc:
            print(flush=True)
            raise _overflow(exc, options, chat=True) from None
        print(flush=True)
        print(f"[prefilled {chat.prefilled} tokens, generated {chat.generated} in {time.perf_counter() - start:.2f} s; "
              f"{runner.pos} of {runner.max_context_len} positions used]", file=sys.stderr, flush=True)


def _generating_runner(options: Resolved, say: Callable[[str], None]):
    """The runner of `run`, `chat` and `eval`: the program, its tokenizer (--tokenizer or the one beside it) and adapter."""
    if options["pte"] is None:
        raise ConfigError("pte is not set; give --pte model.pte (or `pte:` in a config file)")
    say(f"loading {options['pte']}")
    runner = load_runner(options["pte"], data_path=options["data_path"], decode_tail=options["decode_tail"],
                         tokenizer=options["tokenizer"])
    if options["adapter"] is not None:
        name, file = options["adapter"]
        file = _adapter_file(options, runner, name, file)
        scale = 1.0 if options["adapter_scale"] is None else options["adapter_scale"]
        say(f"adapter {name!r} from {file} (scale {scale:g})")
        runner.add_adapter(name, file, scale)
        runner.set_adapter(name)
    elif options["adapter_scale"] is not None:
        raise ConfigError(f"adapter_scale ({options.where('adapter_scale')}) needs an adapter; give --adapter NAME")
    return runner


def _adapter_file(options: Resolved, runner, name: str, file: str | None) -> Path:
    """The file of `--adapter NAME[=FILE]`, once the program is known to take it: FILE, else what was exported beside
    the program as NAME, the adapter's tensors (.ptd) for a program with LoRA slots or its program (.pte) for a base
    program whose weights are apart."""
    from etblocks.export.adapters import adapter_file, adapter_program_file, exported_adapters

    where, pte = options.where("adapter"), options["pte"]
    if runner.adapter_table is None and runner.data_path is None:  # neither slots nor weights that programs share
        raise ConfigError(
            f"adapter={name!r} ({where}): {pte} was exported without adapters, so it has no LoRA slots; export it "
            f"with --adapter {name}=DIR (a PEFT or torchtune adapter directory) to run it with {name!r}"
        )
    if file:
        return Path(file)
    expected = adapter_file(pte, name) if runner.adapter_table is not None else adapter_program_file(pte, name)
    if not expected.is_file():
        raise ConfigError(
            f"adapter={name!r} ({where}): {expected} does not exist; adapters exported beside {pte}: "
            f"{list(exported_adapters(pte)) or 'none'} (or give --adapter {name}=FILE)"
        )
    return expected


def _generation(options: Resolved) -> dict[str, Any]:
    generation = {"max_new_tokens": options["max_new_tokens"], "temperature": options["temperature"],
                  "top_p": options["top_p"], "seed": options["seed"], "eos": options["eos_ids"],
                  "speculate": options["speculate"]}
    if options["max_draft"] is not None:
        generation["max_draft"] = options["max_draft"]
    return generation


def _speculation_summary(stats) -> str:
    return (f"; speculation: {stats.accepted} of {stats.drafted} proposed tokens kept ({stats.acceptance_rate:.0%}), "
            f"{stats.tokens_per_call:.2f} tokens per call")


def _overflow(exc: ContextOverflowError, options: Resolved, chat: bool = False) -> ConfigError:
    """The context overflow said in the command's terms."""
    fix = (f"give --max-new-tokens {exc.fits} or less" if exc.fits and exc.fits > 0
           else "give a shorter prompt, or export with a larger --max-seq-len")
    if chat:
        fix += "; /reset starts a new conversation"
    return ConfigError(f"{exc}; {fix} (max_new_tokens is {options['max_new_tokens']}, {options.where('max_new_tokens')})")


def load_runner(path: str | Path, data_path: str | Path | None = None, decode_tail: int | None = None,
                tokenizer: str | Path | None = None):
    from etblocks.export.runner import Runner

    try:  # files the runtime refuses are the Runner's own ProgramFileError (etblocks/program_files.py)
        return Runner(path, data_path=data_path, decode_tail=decode_tail, tokenizer=tokenizer)
    except EtblocksError:
        raise
    except Exception as exc:  # anything else a foreign program makes the Runner hit while reading it
        raise ProgramFileError(
            f"pte={str(path)!r} could not be loaded by the ExecuTorch runtime ({exception_summary(exc)}); "
            "give a .pte written by `etblocks export`"
        ) from None


# ----------------------------------------------------------------------------------------------- backends


def cmd_backends(args: argparse.Namespace) -> int:
    from etblocks.backends import get_backend
    from etblocks.backends.probe import format_table, probe_backends

    for name in args.names:
        get_backend(name)  # ConfigError listing the accepted names
    with steps() as say:
        reports = probe_backends(args.names or None, quiet=not args.verbose, on_start=lambda name: say(f"probing {name}"))
    print(format_table(reports), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------- main


def _progress() -> Callable[[str], None]:
    """`say(message)`: a progress message of the command itself, logged on "etblocks" (shown by `main`)."""
    return LOGGER.info


@contextmanager
def _terminal(verbose: bool) -> Iterator[None]:
    """etblocks' progress on stderr; unless `verbose`, the known dependency noise kept out (`etblocks.quiet`, which
    lets a terminal's progress line count a long step's seconds), and other packages' deprecation warnings, which
    concern the code calling them, not the command's user."""
    with nullcontext() if verbose else quiet(), shown():
        if not verbose:
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=r"(?!etblocks)")
        yield


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with _terminal(args.verbose):
        try:
            return args.handler(args)
        except EtblocksError as exc:
            sys.stdout.flush()
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
