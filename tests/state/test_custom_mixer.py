"""Two stateful mixers defined in this file alone, through the public API only, taken through swap, both program
contracts and the runner.

The upstream model is a tiny transformers Llama whose first and last layers mix tokens with modules defined
here instead of attention: a depthwise causal convolution (its etblocks mixer keeps the last K-1 inputs, a
`WindowState`) and a running sum (its mixer keeps the sum so far, a `RecurrentState` replaced by every call). The
upstream modules see the whole sequence and keep nothing, so the reference is an eager loop that runs the
untouched model over the whole sequence for every token. The exported programs must generate exactly its tokens:
dynamic on XNNPACK (state as mutable buffers, cleared by a new sequence), static on portable kernels (state owned
by the runner; a prompt that is not a multiple of the chunk; saved and restored).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import etblocks
from etblocks.state import RecurrentState, WindowState
from etblocks.swap import HFCall

HIDDEN, CHANNELS, TAPS, CONTEXT, CHUNK = 64, 32, 4, 48, 4
PROMPT = [5, 17, 92, 3, 44, 61, 8]  # 7 tokens: a chunk of 4 and a remainder of 3
OTHER_PROMPT = [70, 2, 19, 33, 101]
NEW_TOKENS = 12


# --- the upstream modules: what a model library ships (whole sequence in, nothing kept) -------------------------


class UpstreamCausalConv(nn.Module):
    """Depthwise causal convolution of `TAPS` taps between two projections, called where transformers calls
    attention."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(HIDDEN, CHANNELS)
        self.weight = nn.Parameter(torch.randn(CHANNELS, TAPS) * 0.6)
        self.out_proj = nn.Linear(CHANNELS, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        x = F.pad(self.in_proj(hidden_states).transpose(1, 2), (TAPS - 1, 0))  # [B, C, K - 1 + T]
        y = F.conv1d(x, self.weight[:, None, :], groups=CHANNELS).transpose(1, 2)
        return self.out_proj(y), None


class UpstreamRunningSum(nn.Module):
    """Each position gets the sum of a projection of every input so far."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(HIDDEN, CHANNELS)
        self.out_proj = nn.Linear(CHANNELS, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        return self.out_proj(torch.cumsum(self.in_proj(hidden_states), dim=1)), None


# --- their etblocks mixers: the same weights, state declared ------------------------------------------------


class CausalConvMixer(nn.Module):
    """`forward(x [B, T, D], input_pos [T]) -> [B, T, D]`; keeps the last `TAPS - 1` projected inputs."""

    def __init__(self, upstream: UpstreamCausalConv, caller_owned: bool) -> None:
        super().__init__()
        self.in_proj, self.weight, self.out_proj = upstream.in_proj, upstream.weight, upstream.out_proj
        self.conv_state = WindowState(TAPS - 1, CHANNELS, caller_owned=caller_owned)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        window = self.conv_state.update(input_pos, self.in_proj(x))  # [B, TAPS - 1 + T, C]
        length = x.shape[1]
        y = sum(window[:, tap : tap + length] * self.weight[:, tap] for tap in range(TAPS))
        return self.out_proj(y)


class RunningSumMixer(nn.Module):
    """`forward(x [B, T, D], input_pos [T]) -> [B, T, D]`; keeps the sum so far `[1, C]`, replaced by every call."""

    def __init__(self, upstream: UpstreamRunningSum, caller_owned: bool) -> None:
        super().__init__()
        self.in_proj, self.out_proj = upstream.in_proj, upstream.out_proj
        self.total = RecurrentState((1, CHANNELS), caller_owned=caller_owned)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        sums = self.total.read(input_pos)[:, None] + torch.cumsum(self.in_proj(x), dim=1)
        self.total.write(sums[:, -1])
        return self.out_proj(sums)


class HFCausalConvMixer(HFCall, CausalConvMixer):
    pass


class HFRunningSumMixer(HFCall, RunningSumMixer):
    pass


@etblocks.register(UpstreamCausalConv)
def convert_conv(module, ctx):
    return HFCausalConvMixer(module, ctx.caller_owned)


@etblocks.register(UpstreamRunningSum)
def convert_running_sum(module, ctx):
    return HFRunningSumMixer(module, ctx.caller_owned)


# --- the model, the reference, the programs ---------------------------------------------------------------------


def upstream_model():
    """Three layers: convolution, attention, running sum; random weights, fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, initializer_range=0.3, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        model.model.layers[0].self_attn = UpstreamCausalConv()
        model.model.layers[2].self_attn = UpstreamRunningSum()
    return model


@torch.no_grad()
def eager_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The untouched model over the whole sequence for every token: nothing cached anywhere."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def original():
    return upstream_model()


@pytest.fixture(scope="module")
def reference(original):
    expected = {tuple(p): eager_greedy(original, p, NEW_TOKENS) for p in (PROMPT, OTHER_PROMPT)}
    assert all(len(set(tokens)) > 3 for tokens in expected.values()), "degenerate reference: it would not tell models apart"
    return expected


def swapped(original, backend: str, **options):
    model = copy.deepcopy(original)
    etblocks.swap(model, backend=backend, max_seq_len=CONTEXT, **options)  # the probe checks every mixer against upstream
    return model


def test_swap_takes_both_mixers_with_declared_state(original):
    dynamic = swapped(original, "xnnpack")
    layers = dynamic.model.layers
    assert isinstance(layers[0].self_attn, CausalConvMixer) and isinstance(layers[2].self_attn, RunningSumMixer)
    assert [(s.name, s.shape, s.update) for s in layers[0].self_attn.conv_state.specs()] == [("conv_state", (1, TAPS - 1, CHANNELS), "window")]
    assert [(s.name, s.shape, s.update) for s in layers[2].self_attn.total.specs()] == [("recurrent_state", (1, CHANNELS), "replace")]
    static = swapped(original, "portable", shapes="static", chunk=CHUNK)
    assert static.model.layers[0].self_attn.conv_state.caller_owned and static.model.layers[2].self_attn.total.caller_owned


@pytest.mark.slow
def test_dynamic_xnnpack_program_generates_the_eager_tokens(original, reference, tmp_path):
    result = etblocks.export(swapped(original, "xnnpack"), backend="xnnpack", out=tmp_path / "mixers.pte")
    runner = etblocks.Runner(result.path)
    assert runner.generate(PROMPT, max_new_tokens=NEW_TOKENS) == reference[tuple(PROMPT)]
    runner.reset()  # a new sequence: the state the first one left in the buffers must not be read
    assert runner.generate(OTHER_PROMPT, max_new_tokens=NEW_TOKENS) == reference[tuple(OTHER_PROMPT)]


@pytest.mark.slow
def test_static_program_generates_the_eager_tokens_and_resumes(original, reference, tmp_path):
    result = etblocks.export(swapped(original, "portable", shapes="static", chunk=CHUNK), backend="portable", out=tmp_path / "s.pte")
    runner = etblocks.Runner(result.path)
    contract = runner.contract
    assert [(s.name, s.update) for s in contract.states] == [
        ("conv_state", "window"), ("k_cache", "rows"), ("v_cache", "rows"), ("recurrent_state", "replace")
    ]
    assert not contract.paddable  # the running sum would fold padding in: remainders go through decode
    assert runner.generate(PROMPT, max_new_tokens=NEW_TOKENS) == reference[tuple(PROMPT)]
    runner.reset()
    assert runner.generate(OTHER_PROMPT, max_new_tokens=NEW_TOKENS) == reference[tuple(OTHER_PROMPT)]

    runner.reset()
    runner.forward(PROMPT[:5])
    saved, pos = runner.caches, runner.pos
    assert [tuple(t.shape) for t in saved] == [s.shape for s in contract.states]
    resumed = etblocks.Runner(result.path)
    resumed.restore(saved, pos)
    assert resumed.generate(PROMPT[5:], max_new_tokens=NEW_TOKENS, fresh=False) == reference[tuple(PROMPT)]
