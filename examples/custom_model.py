"""Build a small decoder-only LM from etblocks blocks, change one attention behaviour, export it and generate.

    python examples/custom_model.py [out_dir]

The model needs no `swap`: it is made of etblocks blocks, so `etblocks.export` takes it as it is. The
exported program is `forward(tokens [1, T], input_pos [1]) -> logits [1, V]` with T dynamic, the KV caches
as in-place buffers, and the metadata methods ExecuTorch's LLM runner reads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import etblocks
from etblocks.attention import Attention, CustomSDPA, RotaryEmbedding, default_inv_freq
from etblocks.state import StaticKVCache

VOCAB_SIZE = 128
DIM = 64
N_LAYERS = 2
N_HEADS = 4
N_KV_HEADS = 2  # grouped-query attention: two query heads per KV head
HEAD_DIM = DIM // N_HEADS
HIDDEN_DIM = 128
MAX_SEQ_LEN = 64
ROPE_BASE = 10000.0
NORM_EPS = 1e-5


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`: `[B, T, D] -> [B, T, D]`."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedAttention(Attention):
    """Attention with a learnable per-head output gate: head h's output is scaled by `sigmoid(head_gate[h])`.

    Only one hook changes: `attend` returns `[B, T, H, Dh]`, and the gate multiplies it before `o_proj`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_gate = nn.Parameter(torch.linspace(-2.0, 2.0, self.n_heads))

    def attend(self, q, k, v, q_pos, k_pos, mask=None) -> torch.Tensor:
        y = super().attend(q, k, v, q_pos, k_pos, mask)
        return y * torch.sigmoid(self.head_gate).view(1, 1, -1, 1).to(y.dtype)


def make_attention(attention_cls: type[Attention] = GatedAttention) -> Attention:
    return attention_cls(
        n_heads=N_HEADS,
        n_kv_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        # llama::custom_sdpa: causal over the cache, offset by the start position, GQA without repeating K/V.
        sdpa=CustomSDPA(scale=HEAD_DIM**-0.5),
        # llama::update_cache writes the new K/V rows in place at input_pos[0].
        kv_cache=StaticKVCache(1, MAX_SEQ_LEN, N_KV_HEADS, HEAD_DIM, use_custom_op=True),
        q_proj=nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=False),
        k_proj=nn.Linear(DIM, N_KV_HEADS * HEAD_DIM, bias=False),
        v_proj=nn.Linear(DIM, N_KV_HEADS * HEAD_DIM, bias=False),
        o_proj=nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False),
        rope=RotaryEmbedding(default_inv_freq(HEAD_DIM, ROPE_BASE)),
    )


class DecoderLayer(nn.Module):
    def __init__(self, attention_cls: type[Attention]) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.attn = make_attention(attention_cls)
        self.mlp_norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.mlp = SwiGLU(DIM, HIDDEN_DIM)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """`forward(tokens [1, T], input_pos [1]) -> logits [1, V]` of the last position.

    `input_pos` is the absolute position of `tokens[:, 0]`; each layer's cache keeps what came before.
    """

    def __init__(self, attention_cls: type[Attention] = GatedAttention) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, DIM)
        self.layers = nn.ModuleList(DecoderLayer(attention_cls) for _ in range(N_LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=NORM_EPS)
        self.lm_head = nn.Linear(DIM, VOCAB_SIZE, bias=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        positions = input_pos + torch.arange(tokens.shape[1], dtype=input_pos.dtype)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x[:, -1, :]))


def build_model(seed: int = 0, attention_cls: type[Attention] = GatedAttention) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(attention_cls).eval()


PROMPT_IDS = [3, 17, 42, 5, 99, 64, 8]


def main(out_dir: str | Path = ".", max_new_tokens: int = 16) -> dict:
    """Build, export to XNNPACK and generate greedily; returns what a caller may want to inspect."""
    model = build_model()
    result = etblocks.export(
        model, backend="xnnpack", out=Path(out_dir) / "custom_model.pte", vocab_size=VOCAB_SIZE, max_seq_len=MAX_SEQ_LEN
    )
    runner = etblocks.Runner(result.path)
    tokens = runner.generate(PROMPT_IDS, max_new_tokens=max_new_tokens)
    return {"model": model, "path": result.path, "prompt_ids": PROMPT_IDS, "tokens": tokens, "result": result}


if __name__ == "__main__":
    out = main(sys.argv[1] if len(sys.argv) > 1 else ".")
    print(f"wrote {out['path']} ({out['result'].size_mb:.2f} MB); {out['result'].delegation}")
    print(f"prompt {out['prompt_ids']} -> {out['tokens']}")
