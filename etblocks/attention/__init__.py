"""Attention blocks: SDPA forms, rotary embeddings, masks, the MHA/GQA/MQA block, its single-head form and
its KV-shared form."""

from etblocks.attention.conv import Conv2dLinear
from etblocks.attention.masks import additive_mask, allowed_keys
from etblocks.attention.mha import Attention, GatedAttention
from etblocks.attention.mla import MLAttention, cos_sin_from_complex, deinterleave_matrix
from etblocks.attention.rope import RotaryEmbedding, apply_rotary, default_inv_freq, llama3_inv_freq, rotation_matrix
from etblocks.attention.sdpa import (
    SDPA,
    CustomSDPA,
    MaskedCustomSDPA,
    DynamicSDPA,
    QuantizedCustomSDPA,
    StaticSDPA,
    attention_math,
    softmax_with_sinks,
)
from etblocks.attention.sha import SingleHeadAttention, apply_rotary_3d
from etblocks.attention.shared import KVSharedAttention

__all__ = [
    "Attention",
    "GatedAttention",
    "SingleHeadAttention",
    "KVSharedAttention",
    "Conv2dLinear",
    "SDPA",
    "CustomSDPA",
    "MaskedCustomSDPA",
    "QuantizedCustomSDPA",
    "DynamicSDPA",
    "StaticSDPA",
    "attention_math",
    "softmax_with_sinks",
    "RotaryEmbedding",
    "apply_rotary",
    "rotation_matrix",
    "apply_rotary_3d",
    "default_inv_freq",
    "llama3_inv_freq",
    "allowed_keys",
    "additive_mask",
    "MLAttention",
    "cos_sin_from_complex",
    "deinterleave_matrix",
]
