"""The package's layers: every module imports only from its own layer or the layers below, no import cycle
anywhere, and importing the package (or asking the command for help) loads nothing heavy.

Every import statement counts, also those inside functions and `TYPE_CHECKING` blocks: a lazy import is still a
dependency, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import etblocks

PACKAGE = Path(etblocks.__file__).parent

# Bottom to top. A module's layer is its first name under `etblocks` (its package, or its own file).
LAYERS = (
    ("errors", "options", "demo", "torchtune_compat", "program_files", "noise", "progress", "threads",
     "gguf"),
    ("ops",),
    ("state",),
    ("attention", "moe", "mixers"),
    ("adapters",),
    ("backends",),
    ("swap",),
    ("export",),
    ("config", "cli", "__main__", "__init__"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(module: str) -> set[str]:
    """The etblocks modules `module` imports anywhere in its file (a `from package import submodule` counts as the
    submodule)."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "etblocks")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "etblocks":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found - {module}


GRAPH = {module: imported(module) for module in MODULES}


def test_every_module_has_a_layer():
    assert {layer_of(m) for m in MODULES} <= set(RANK), sorted({layer_of(m) for m in MODULES} - set(RANK))
    assert all(target in MODULES for targets in GRAPH.values() for target in targets)


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if RANK[layer_of(target)] > RANK[layer_of(module)]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_and_help_load_no_torch_and_no_transformers_models():
    loaded = run_python(
        "import sys, contextlib, io\n"
        "import etblocks\n"
        "from etblocks.cli import main\n"
        "for argv in (['--help'], ['export', '--help'], ['run', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'executorch')))"
    )
    assert loaded == "[]"


def test_swapping_a_model_imports_no_other_family():
    added = run_python(
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
        "num_attention_heads=2, num_key_value_heads=1)\n"
        "model = LlamaForCausalLM(config)\n"
        "before = {m for m in sys.modules if m.startswith('transformers.models.')}\n"
        "import etblocks\n"
        "etblocks.swap(model, backend='portable', max_seq_len=16)\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and m not in before))"
    )
    assert added == "[]"
