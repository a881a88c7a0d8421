"""Text in and out: a tokenizer trained here (BOS added to plain text, a chat template, EOS = the end of a turn),
saved with a random-weight Llama as a checkpoint; the program exported with it. The references are transformers'
`generate` on the tokenizer's own ids (`tokenizer(text)`, `apply_chat_template`) and `decode` of the new ids."""

from __future__ import annotations

import copy
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hf_models import SENTENCES, tiny_model

import etblocks
from etblocks.cli import main
from etblocks.errors import ConfigError
from etblocks.export.chat import Chat

README = Path(__file__).resolve().parents[2] / "README.md"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "the lazy fox learns to export"
NEW_TOKENS = 10
MAX_SEQ_LEN = 160


def byte_level_char(byte: int) -> str:
    """The character GPT-2's byte-level alphabet writes `byte` as (printable bytes as themselves, the others
    from U+0100 on, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<s>", "<|im_start|>", "<|im_end|>", "<pad>"]
    # Printable ASCII and newline, nothing above: such text encodes, and every token decodes to whole printable
    # characters (ExecuTorch's runner hands each piece to Python as a str, which a partial UTF-8 character breaks,
    # and does not print control characters).
    alphabet = [byte_level_char(b) for b in (ord("\n"), *range(ord(" "), ord("~") + 1))]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet))
    raw.train_from_iterator(SENTENCES * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                   chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint directory (model + tokenizer) and its untouched model."""
    directory = tmp_path_factory.mktemp("ckpt")
    tokenizer = train_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    directory, model, _ = checkpoint
    swapped = copy.deepcopy(model)
    etblocks.swap(swapped, backend="xnnpack", max_seq_len=MAX_SEQ_LEN)
    out = tmp_path_factory.mktemp("program") / "model.pte"
    return etblocks.export(swapped, backend="xnnpack", out=out, tokenizer=directory)


def hf_new_ids(model, ids: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_export_saves_the_tokenizer_beside_the_program(exported, checkpoint):
    _, _, tokenizer = checkpoint
    assert exported.tokenizer == exported.path.with_suffix(".tokenizer") and exported.tokenizer.is_dir()
    assert (exported.tokenizer / "tokenizer.json").is_file()
    saved = etblocks.Runner(exported.path).tokenizer
    assert saved.chat_template == TEMPLATE and saved(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]


@pytest.mark.slow
def test_text_generate_equals_transformers_and_every_call_starts_fresh(exported, checkpoint):
    _, model, tokenizer = checkpoint
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # the tokenizer adds its BOS, on both sides
    new = hf_new_ids(model, ids)
    assert len(set(new)) > 2, f"degenerate random model: {new}"
    expected = tokenizer.decode(new, skip_special_tokens=True)
    runner = etblocks.Runner(exported.path)
    assert runner.generate(PROMPT, max_new_tokens=NEW_TOKENS) == expected
    assert runner.generate(PROMPT, max_new_tokens=NEW_TOKENS) == expected
    assert runner.last_ids == new
    assert runner.generate(ids, max_new_tokens=NEW_TOKENS) == new  # ids in, ids out


@pytest.mark.slow
def test_stream_yields_pieces_that_join_to_the_text(exported):
    runner = etblocks.Runner(exported.path)
    pieces = list(runner.stream(PROMPT, max_new_tokens=NEW_TOKENS))
    assert len(pieces) > 1
    assert "".join(pieces) == runner.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert list(runner.stream([5, 6, 7], max_new_tokens=3)) == runner.generate([5, 6, 7], max_new_tokens=3)


@pytest.mark.slow
def test_chat_equals_apply_chat_template_and_generate(exported, checkpoint):
    _, model, tokenizer = checkpoint
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what does the fox do"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = tokenizer.decode(hf_new_ids(model, ids), skip_special_tokens=True)
    assert etblocks.Runner(exported.path).chat(messages, max_new_tokens=NEW_TOKENS) == expected


@pytest.mark.slow
def test_a_chat_turn_feeds_only_its_own_tokens(exported, checkpoint):
    """The second turn prefills what the template adds after the first reply (not the whole conversation), and
    its reply is transformers' greedy continuation of exactly the ids the program holds."""
    _, model, tokenizer = checkpoint
    chat = Chat(etblocks.Runner(exported.path), system="be brief", max_new_tokens=NEW_TOKENS)
    first = chat.send("what does the fox do")
    assert chat.prefilled == len(chat.ids) - chat.generated
    conversation = chat.ids[:]
    closed = conversation[-1] == tokenizer.eos_token_id  # the reply ended its turn, else the template ends it
    second = chat.send("and the dog")
    added = chat.ids[len(conversation):len(chat.ids) - chat.generated]
    assert chat.prefilled == len(added) < len(conversation)
    turn = "\n<|im_start|>user\nand the dog<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(added) == (turn if closed else "<|im_end|>" + turn)
    reply_ids = chat.ids[len(chat.ids) - chat.generated:]
    assert reply_ids == hf_new_ids(model, conversation + added)
    assert second == tokenizer.decode(reply_ids, skip_special_tokens=True)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2]["content"] == first


@pytest.mark.slow
def test_run_takes_text_without_a_tokenizer_flag(exported, checkpoint, capsys):
    _, model, tokenizer = checkpoint
    expected = tokenizer.decode(hf_new_ids(model, tokenizer(PROMPT)["input_ids"]), skip_special_tokens=True)
    assert main(["run", "--pte", str(exported.path), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"  # the text alone: progress and the summary go to stderr
    assert re.search(rf"{NEW_TOKENS} tokens in .* stopped at max_new_tokens", captured.err)


def read_until(fd: int, pattern: str, seen: list[str], timeout: float = 120.0) -> str:
    """Terminal output up to and including `pattern` (a regex), appended to `seen`."""
    text, deadline = "", time.monotonic() + timeout
    while not re.search(pattern, text):
        if time.monotonic() > deadline or not select.select([fd], [], [], deadline - time.monotonic())[0]:
            raise AssertionError(f"no {pattern!r} in the terminal after {timeout} s: {''.join(seen) + text!r}")
        try:
            chunk = os.read(fd, 4096).decode(errors="replace")
        except OSError:  # the other side closed
            raise AssertionError(f"the process ended before {pattern!r}: {''.join(seen) + text!r}") from None
        text += chunk
    seen.append(text)
    return text


@pytest.mark.slow
def test_chat_command_in_a_terminal(exported, checkpoint):
    """`etblocks chat` on a pseudo-terminal: two turns, both replies streamed, the second prefilling only its own
    tokens (the same count as `Chat` in this process)."""
    reference = Chat(etblocks.Runner(exported.path), max_new_tokens=NEW_TOKENS)
    answers = [reference.send("what does the fox do")]
    answers.append(reference.send("and the dog"))
    second_prefill = reference.prefilled

    leader, follower = pty.openpty()
    command = [sys.executable, "-m", "etblocks", "chat", "--pte", str(exported.path), "--max-new-tokens", str(NEW_TOKENS)]
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    seen: list[str] = []
    try:
        read_until(leader, r"> $", seen)
        for turn, answer in zip(("what does the fox do", "and the dog"), answers):
            os.write(leader, (turn + "\n").encode())
            read_until(leader, r"positions used\]\s*\r?\n> $", seen)
        os.write(leader, b"/exit\n")
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        os.close(leader)
    transcript = "".join(seen).replace("\r\n", "\n")
    for answer in answers:
        assert answer.strip() and answer in transcript, (answer, transcript)
    prefills = [int(n) for n in re.findall(r"\[prefilled (\d+) tokens", transcript)]
    assert len(prefills) == 2 and prefills[1] == second_prefill < prefills[0], transcript


@pytest.mark.slow
def test_a_program_without_a_tokenizer_says_how_to_give_one(exported, tmp_path):
    alone = tmp_path / "alone.pte"
    alone.write_bytes(exported.path.read_bytes())
    runner = etblocks.Runner(alone)
    assert runner.generate([5, 6], max_new_tokens=2)  # ids need no tokenizer
    with pytest.raises(ConfigError, match=r"no tokenizer beside it .*give tokenizer="):
        runner.generate("hello")
    assert etblocks.Runner(alone, tokenizer=exported.tokenizer).generate(PROMPT, max_new_tokens=NEW_TOKENS) == (
        etblocks.Runner(exported.path).generate(PROMPT, max_new_tokens=NEW_TOKENS))


@pytest.mark.slow
def test_run_without_a_usable_tokenizer_exits_2(exported, tmp_path, capsys):
    alone = tmp_path / "alone.pte"
    alone.write_bytes(exported.path.read_bytes())
    assert main(["run", "--pte", str(alone), "--prompt", "hi"]) == 2
    assert "no tokenizer beside it" in capsys.readouterr().err
    assert main(["run", "--pte", str(alone), "--prompt", "hi", "--tokenizer", str(tmp_path / "t.json")]) == 2
    assert "t.json' does not exist" in capsys.readouterr().err
    assert main(["chat", "--pte", str(alone)]) == 2
    assert "no tokenizer beside it" in capsys.readouterr().err


def test_export_refuses_a_missing_tokenizer_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer='.*nowhere' does not exist"):
        etblocks.export(torch.nn.Linear(2, 2), backend="portable", out=tmp_path / "m.pte", tokenizer=tmp_path / "nowhere")
    assert not (tmp_path / "m.pte").exists()


@pytest.mark.slow
def test_the_readme_stock_runner_example_equals_etblocks_run(exported):
    """The README's TextLLMRunner lines, run as written in a fresh process beside the exported files, print what
    `etblocks run --prompt` prints."""
    readme = README.read_text()
    marker = "<!-- stock-runner example: tests/export/test_text.py runs it -->"
    code = readme.split(marker, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    prompt = re.search(r'runner.generate\("([^"]+)"', code).group(1)
    max_new_tokens = re.search(r"max_new_tokens=(\d+)", code).group(1)
    directory = exported.path.parent
    stock = subprocess.run([sys.executable, "-c", code], cwd=directory, capture_output=True, text=True, timeout=300)
    assert stock.returncode == 0, stock.stderr[-3000:]
    printed = stock.stdout.split("\nPyTorchObserver", 1)[0]  # the runner prints the text, a newline, its statistics
    for special in ("<s>", "<|im_start|>", "<|im_end|>", "<pad>"):  # which it prints and etblocks does not
        printed = printed.replace(special, "")
    ours = subprocess.run([sys.executable, "-m", "etblocks", "run", "--pte", "model.pte", "--prompt", prompt,
                           "--max-new-tokens", max_new_tokens], cwd=directory, capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    # Newlines at the end are the runners' own: run ends the text with one, the stock runner with one or two
    # depending on why it stopped (and it prints the EOS token's text, removed above).
    text = ours.stdout.rstrip("\n")
    assert len(text) > 8 and printed.rstrip("\n") == text


@pytest.mark.slow
def test_cli_export_of_a_checkpoint_saves_its_tokenizer(checkpoint, exported, tmp_path, capsys):
    """`export --model DIR` takes the tokenizer of the directory the model comes from (`from_pretrained`'s
    `name_or_path`), without --tokenizer; `run --prompt` then answers as the Python export's program does."""
    directory, _, _ = checkpoint
    out = tmp_path / "cli.pte"
    assert main(["export", "--model", str(directory), "--backend", "xnnpack", "--out", str(out),
                 "--max-seq-len", str(MAX_SEQ_LEN)]) == 0
    assert f"tokenizer   {out.with_suffix('.tokenizer')} (from {directory})" in capsys.readouterr().out
    assert main(["run", "--pte", str(out), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out == etblocks.Runner(exported.path).generate(PROMPT, max_new_tokens=NEW_TOKENS) + "\n"


def test_streamed_pieces_join_to_the_decoded_text():
    """Random ids of a byte-level tokenizer (partial UTF-8 characters included) and a SentencePiece-style one
    (a space marker that a decode drops at its start): the pieces, each decoded from a window of ids, join to the
    decode of all the ids, and a character split across ids comes out whole."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from etblocks.export.text import text_pieces

    def trained(pre_tokenizer, decoder, **options):
        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer, raw.decoder = pre_tokenizer, decoder
        raw.train_from_iterator(["héllo wörld, ünïcode 日本語 text"] * 4, trainers.BpeTrainer(show_progress=False, **options))
        return PreTrainedTokenizerFast(tokenizer_object=raw)

    byte_level = trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), vocab_size=300,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    metaspace = trained(pre_tokenizers.Metaspace(), decoders.Metaspace(), vocab_size=60)
    rng = random.Random(0)
    for tokenizer in (byte_level, metaspace):
        for _ in range(100):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
            assert "".join(text_pieces(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True), ids
    byte_ids = byte_level.convert_tokens_to_ids(byte_level.tokenize("日"))
    assert len(byte_ids) > 1 and list(text_pieces(byte_level, byte_ids)) == ["日"]
    words = metaspace("hello wörld text")["input_ids"]
    assert "".join(text_pieces(metaspace, words)) == metaspace.decode(words) == "hello wörld text"
