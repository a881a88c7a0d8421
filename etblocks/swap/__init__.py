"""Swap upstream token mixers (attention) and MoE blocks for etblocks blocks, by registry and recipe."""

from etblocks.swap.api import SwapInfo, set_max_seq_len, swap
from etblocks.swap.hf.adapter import HFCall
from etblocks.swap.recipes import Recipe, recipe_for, resolve_recipe
from etblocks.swap.registry import MIXERS, MODULES, SwapContext, register
from etblocks.swap.torchtune.attention import TuneCall

__all__ = [
    "swap",
    "set_max_seq_len",
    "SwapInfo",
    "register",
    "MIXERS",
    "MODULES",
    "SwapContext",
    "HFCall",
    "TuneCall",
    "Recipe",
    "recipe_for",
    "resolve_recipe",
]
