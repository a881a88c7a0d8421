"""GGUF files in: the transformers model and tokenizer a llama.cpp file holds.

transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`) dequantizes the blocks to float and builds the
tokenizer, chat template, BOS and EOS from the file's metadata; the model it returns is marked quantized and refuses
`save_pretrained`. `load_gguf` rebuilds the same model from its config, holding the same tensors, as a plain
float model etblocks can swap, export and save. The dequantized values of Q4_0 / Q4_1 / Q4_K blocks are still int4
groups: the 4-bit recipes find them (`etblocks.export.int4.on_grid`) and keep them rather than rounding again.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from etblocks.errors import ConfigError, exception_summary

MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does (without reading more)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(len(MAGIC)) == MAGIC


def load_gguf(path: str | Path, dtype: Any = None) -> tuple[Any, Any]:
    """`(model, tokenizer)` from a GGUF file: a transformers causal LM in `dtype` (default float32) with the file's
    tensors dequantized, and the file's tokenizer with its chat template, BOS and EOS. `ConfigError` naming the
    path if it is not a GGUF file or transformers cannot load its architecture."""
    path = Path(path)
    if not is_gguf(path):
        what = "does not exist" if not path.exists() else "is not a file" if not path.is_file() else "is not a GGUF file"
        raise ConfigError(f"model={str(path)!r} {what}; give a .gguf file (llama.cpp's format) or a checkpoint directory")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name, "local_files_only": True}
    try:
        with _no_progress_bars():
            loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype or torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as exc:  # transformers raises many types for an architecture or tensor type it lacks
        raise ConfigError(f"model={str(path)!r} could not be loaded by transformers' GGUF loader: {exception_summary(exc)}") from exc
    return _plain(loaded), tokenizer


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while loading: its own (`Loading weights`), and the tqdm bar its GGUF
    conversion makes with no switch of its own (the module's `tqdm` is made a disabled one for the time)."""
    from transformers import modeling_gguf_pytorch_utils as conversion
    from transformers.utils import logging as hf_logging

    shown, bar = hf_logging.is_progress_bar_enabled(), conversion.tqdm
    hf_logging.disable_progress_bar()
    conversion.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        conversion.tqdm = bar
        if shown:
            hf_logging.enable_progress_bar()


def _plain(loaded: Any) -> Any:
    """The model `loaded` without transformers' GGUF quantizer mark: rebuilt from its config, holding its tensors."""
    from transformers import AutoModelForCausalLM

    import torch

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    for name, buffer in loaded.named_buffers():  # the non-persistent ones (rotary frequencies) too
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buffer
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.config.name_or_path = loaded.config.name_or_path
    return model.eval()
