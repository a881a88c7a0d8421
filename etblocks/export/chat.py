"""`Chat`: a conversation with a program, turn by turn, its state kept between turns."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from etblocks.export.runner import Runner
from etblocks.export.text import encode_chat, render_chat, text_pieces


class Chat:
    """A conversation with a program: `send(text)` adds a user turn and returns the reply; the program's state
    is kept between turns, so each turn feeds only what the chat template adds after the tokens already in it
    (the reply's own tokens stay as generated). When the template rewrites earlier turns, the turn starts a new
    sequence from the whole conversation. `system`: a system message first."""

    def __init__(self, runner: Runner, system: str | None = None, **generation: Any) -> None:
        self.runner = runner
        self.generation = {"max_new_tokens": 256, **generation}
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.ids: list[int] = []  # every token of the conversation so far, in the program's state (the last unfed)
        self.prefilled = 0  # tokens the last turn fed before generating
        self.generated = 0  # tokens the last turn generated, the last ones of `ids`

    @property
    def reply_ids(self) -> list[int]:
        """The last turn's generated ids (the end of `ids`)."""
        return self.ids[len(self.ids) - self.generated:]

    def check(self) -> None:
        """`ConfigError` now, not at the first turn, if the runner has no tokenizer or it has no chat template."""
        render_chat(self.runner.tokenizer, [{"role": "user", "content": "hi"}])

    def send(self, text: str, **generation: Any) -> str:
        """The reply to the user's `text` (after the whole turn is generated)."""
        return "".join(self.stream(text, **generation))

    def stream(self, text: str, **generation: Any) -> Iterator[str]:
        """The reply to the user's `text`, in pieces as tokens come."""
        tokenizer = self.runner.tokenizer
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt, fresh = self._turn(tokenizer, messages), False
        if prompt is None:
            prompt, fresh = encode_chat(tokenizer, messages), True
        tokens = self.runner.stream(prompt, fresh=fresh, **{**self.generation, **generation})
        self.prefilled, self.generated = len(prompt), 0
        self.ids = ([] if fresh else self.ids) + prompt
        yield from text_pieces(tokenizer, self._recorded(tokens))
        reply = tokenizer.decode(self.reply_ids, skip_special_tokens=True)
        self.messages = [*messages, {"role": "assistant", "content": reply}]

    def _recorded(self, tokens: Iterator[int]) -> Iterator[int]:
        """`tokens`, each added to the conversation's ids as it passes."""
        for token in tokens:
            self.ids.append(token)
            self.generated += 1
            yield token

    def _turn(self, tokenizer: Any, messages: list[dict[str, str]]) -> list[int] | None:
        """The ids this turn adds after `self.ids`: the template's text after the last reply's tokens (their own
        text as the template writes it), or None when the conversation cannot continue the state."""
        if not self.ids:
            return None
        past = render_chat(tokenizer, self.messages, add_generation_prompt=False)
        new = render_chat(tokenizer, messages)
        said = tokenizer.decode(self.reply_ids, skip_special_tokens=False)
        end = past.rfind(said) if said else -1
        if not new.startswith(past) or end < 0:
            return None
        added = past[end + len(said):] + new[len(past):]
        ids = list(tokenizer(added, add_special_tokens=False)["input_ids"])
        return ids or None
