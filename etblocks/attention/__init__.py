"""Attention blocks: SDPA forms, rotary embeddings, masks and the MHA/GQA/MQA block."""

from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.attention.mha import Attention
from etblocks.attention.rope import RotaryEmbedding, apply_rotary, default_inv_freq, llama3_inv_freq
from etblocks.attention.sdpa import SDPA, CustomSDPA, DynamicSDPA, StaticSDPA, attention_math

__all__ = [
    "Attention",
    "SDPA",
    "CustomSDPA",
    "DynamicSDPA",
    "StaticSDPA",
    "attention_math",
    "RotaryEmbedding",
    "apply_rotary",
    "default_inv_freq",
    "llama3_inv_freq",
    "allowed_keys",
    "additive_mask",
]
