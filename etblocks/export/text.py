"""Text in and out of a program: its tokenizer beside the .pte, prompts and chats to token ids, ids to text as they
come.

`etblocks.export(..., tokenizer=...)` saves the tokenizer (`save_pretrained`: tokenizer.json, its config with the
chat template and special tokens) to `<stem>.tokenizer/` beside the .pte, where `Runner` finds it. Encoding is the
tokenizer's own (`tokenizer(text)`: its BOS if it adds one; a chat through `apply_chat_template`, whose template
writes its own special tokens), so the Runner, the command and transformers' `generate` see the same ids.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from etblocks.errors import ConfigError

TOKENIZER_SUFFIX = ".tokenizer"
Message = Mapping[str, str]  # {"role": ..., "content": ...}, as transformers' chat templates take them


def tokenizer_dir(pte: str | Path) -> Path:
    """Where `export` puts a program's tokenizer: `model.pte` -> `model.tokenizer/`."""
    return Path(pte).with_suffix(TOKENIZER_SUFFIX)


def load_tokenizer(source: Any) -> Any:
    """A transformers tokenizer from `source`: a tokenizer object (returned as it is), a directory holding a saved
    tokenizer (a checkpoint directory, or `<stem>.tokenizer/`), or a tokenizer.json file. `ConfigError` naming the
    path otherwise."""
    if not isinstance(source, (str, os.PathLike)):
        if callable(getattr(source, "encode", None)) and callable(getattr(source, "decode", None)):
            return source
        raise ConfigError(f"tokenizer={source!r} is not accepted; give a directory, a tokenizer.json or a tokenizer")
    path = Path(source)
    try:
        if path.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if path.is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=str(path), name_or_path=str(path))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... for files it cannot read
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"tokenizer={str(path)!r} could not be loaded by transformers: {first}") from None
    raise ConfigError(
        f"tokenizer={str(path)!r} does not exist; give a directory with a saved tokenizer (tokenizer.json, "
        "tokenizer_config.json) or a tokenizer.json file"
    )


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a checkpoint directory holds a tokenizer to ship with its program."""
    directory = Path(directory)
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def checkpoint_tokenizer(model: Any) -> str | None:
    """The local directory a transformers model was loaded from (`from_pretrained`), when it holds a tokenizer."""
    source = getattr(model, "name_or_path", None) or ""
    return source if source and Path(source).is_dir() and has_tokenizer(source) else None


def find_tokenizer(pte: str | Path) -> Path | None:
    """The tokenizer of a program: `<stem>.tokenizer/` beside it, else a tokenizer.json in its directory."""
    for candidate in (tokenizer_dir(pte), Path(pte).parent / "tokenizer.json"):
        if candidate.exists():
            return candidate
    return None


def save_tokenizer(source: Any, pte: str | Path) -> Path:
    """Save the tokenizer `source` (see `load_tokenizer`) as the program's (`tokenizer_dir(pte)`), written to a
    temporary directory first and renamed, so a failure leaves no half-written tokenizer under that name."""
    tokenizer = load_tokenizer(source)
    target = tokenizer_dir(pte)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def encode(tokenizer: Any, text: str) -> list[int]:
    """`text` as the tokenizer encodes it for a model (special tokens such as its BOS added); `ConfigError` if it
    gives no token."""
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise ConfigError(f"prompt={text!r} encodes to no tokens; give a longer prompt")
    return ids


def render_chat(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The conversation as the tokenizer's chat template writes it; `ConfigError` if it has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this tokenizer has no chat template; give a prompt text instead, or a tokenizer with one")
    if not messages:
        raise ConfigError("messages=[] is empty; give at least one {'role': 'user', 'content': ...}")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """A conversation's ids, as `apply_chat_template(..., tokenize=True, add_generation_prompt=True)` gives them
    (the template writes the special tokens, so none are added)."""
    return list(tokenizer(render_chat(tokenizer, messages), add_special_tokens=False)["input_ids"])


class TextStream:
    """Text of generated ids as they come: each `push` returns what the new id adds; an id that ends inside a
    multi-byte character is held back until the character is complete. Each step decodes a window, not every id so
    far: the ids of the last piece shown, again as context (SentencePiece drops a space at the start of a decode;
    bytes join across ids), and the ids after them; so a step costs the same at any length. The pieces join to
    `tokenizer.decode(ids, skip_special_tokens=True)` whenever decoding more ids only appends text (byte-level BPE
    and SentencePiece tokenizers); a tokenizer that rewrites earlier text shows the rest at `flush`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0  # ids[:shown] are in the pieces returned so far
        self.context = 0  # ids[context:shown]: the last piece's ids, decoded again before the new ones

    def push(self, token: int) -> str:
        self.ids.append(token)
        before, text = self._window()
        if text.endswith("\ufffd") or len(text) <= len(before) or not text.startswith(before):
            return ""
        self.context, self.shown = self.shown, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """What is left at the end: a held-back character, or the text after the longest part already shown."""
        before, text = self._window()
        self.context = self.shown = len(self.ids)
        return text[len(os.path.commonprefix([before, text])):]

    def _window(self) -> tuple[str, str]:
        """The window's text without and with the ids not shown yet."""
        window = self.ids[self.context:]
        decode = self.tokenizer.decode
        return decode(window[: self.shown - self.context], skip_special_tokens=True), decode(window, skip_special_tokens=True)


def text_pieces(tokenizer: Any, tokens: Iterable[int]) -> Iterator[str]:
    """The text of `tokens` in pieces as they come (`TextStream`), what was held back at the end."""
    text = TextStream(tokenizer)
    for token in tokens:
        piece = text.push(token)
        if piece:
            yield piece
    rest = text.flush()
    if rest:
        yield rest
