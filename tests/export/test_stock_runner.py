"""A swapped, exported transformers Llama runs in ExecuTorch's stock C++ LLM runner and matches HF `generate`.

Everything is made in the test: a tiny BPE tokenizer trained on the sentences below and a random-weight
Llama whose vocabulary is that tokenizer's. The reference is HF greedy `generate` on an untouched copy of
the model; the code under test is `etblocks.swap` + `etblocks.export`; the runtime is `TextLLMRunner`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import SENTENCES, tiny_model
from peft_refs import ADAPTERS, make_adapter

pytest.importorskip("tokenizers")
pytest.importorskip("executorch.extension.llm.runner")
pytestmark = pytest.mark.slow

PROMPT = "the lazy fox learns to export one token at a time"
MAX_NEW_TOKENS = 12
MAX_SEQ_LEN = 64


def _train_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # No initial byte alphabet: every token is ASCII, so each one decodes to a complete string on its own.
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 4, trainer)
    tokenizer.save(str(path))
    return tokenizer


def _hf_greedy(model, prompt_ids: list[int], eos_id: int | None) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=0,
            eos_token_id=eos_id,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def _set_eos(model, eos_id: int | None) -> None:
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "lora-slots"])
def test_stock_text_llm_runner_matches_hf_generate(tmp_path, with_adapter):
    """With an adapter loaded before export the program has LoRA slots and a `set_adapter` method; the stock
    runner, which knows neither, still loads it and runs the base model (slots start at zero)."""
    import pytorch_tokenizers

    import etblocks
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    tokenizer = _train_tokenizer(tmp_path / "tokenizer.json")
    vocab_size = tokenizer.get_vocab_size()
    assert 150 <= vocab_size <= 300

    # The ids the stock runner itself will feed: its C++ HF tokenizer, no BOS (see EXECUTORCH_NOTES.md).
    cpp_tokenizer = pytorch_tokenizers.CppHFTokenizer()
    cpp_tokenizer.load(str(tmp_path / "tokenizer.json"))
    prompt_ids = [int(t) for t in cpp_tokenizer.encode(PROMPT, 0, 0)]
    assert prompt_ids == tokenizer.encode(PROMPT).ids
    assert len(prompt_ids) > 4

    # Each token decodes to its own distinct string, so comparing the runner's pieces is comparing tokens.
    pieces = [cpp_tokenizer.decode(i, i) for i in range(vocab_size)]
    assert len(set(pieces)) == vocab_size

    original = tiny_model("llama", vocab_size=vocab_size, max_position_embeddings=128, bos_token_id=0)

    # EOS: the token HF greedy emits at step k (its first occurrence, k >= 1), so both sides must stop there.
    # The stock runner does not check the very first (prefill) token against EOS, hence k >= 1.
    _set_eos(original, None)
    free_run = _hf_greedy(original, prompt_ids, eos_id=None)
    assert len(free_run) == MAX_NEW_TOKENS
    assert len(set(free_run)) > 2, f"degenerate random model: {free_run}"
    stop_step = next((k for k in range(MAX_NEW_TOKENS - 4, 0, -1) if free_run[k] not in free_run[:k]), None)
    assert stop_step is not None, f"no usable EOS candidate in {free_run}"
    eos_id = free_run[stop_step]
    _set_eos(original, eos_id)
    expected = _hf_greedy(original, prompt_ids, eos_id=eos_id)
    assert expected == free_run[: stop_step + 1]

    model = copy.deepcopy(original)
    etblocks.swap(model, backend="xnnpack", max_seq_len=MAX_SEQ_LEN)
    if with_adapter:
        make_adapter(original, tmp_path / "adapter", 0, **ADAPTERS["B"])
        etblocks.load_adapter(model, tmp_path / "adapter", name="B")
    pte = tmp_path / "model.pte"
    result = etblocks.export(model, backend="xnnpack", out=pte)
    assert pte.is_file() and list(result.adapters) == (["B"] if with_adapter else [])
    assert list(result.metadata["get_eos_ids"]) == [eos_id]

    received: list[str] = []
    stats = []
    runner = TextLLMRunner(str(pte), str(tmp_path / "tokenizer.json"))
    runner.generate(
        PROMPT,
        GenerationConfig(echo=False, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, num_bos=0, num_eos=0),
        token_callback=received.append,
        stats_callback=stats.append,
    )

    assert stats and stats[-1].num_prompt_tokens == len(prompt_ids)
    # Pieces back to ids (the map is one-to-one, checked above); -1 marks a piece no token decodes to.
    piece_to_id = {piece: i for i, piece in enumerate(pieces)}
    runner_ids = [piece_to_id.get(piece, -1) for piece in received]
    assert runner_ids == expected, f"stock runner {runner_ids} ({received}) != HF greedy {expected}"
    assert len(runner_ids) < MAX_NEW_TOKENS  # it stopped at the EOS from the program's get_eos_ids
