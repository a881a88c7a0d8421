"""Swap upstream attention for etblocks blocks, by registry and recipe."""

from etblocks.swap.api import SwapInfo, set_max_seq_len, swap
from etblocks.swap.recipes import RECIPES, Recipe, resolve_recipe
from etblocks.swap.registry import ATTENTION, SwapContext, register

__all__ = ["swap", "set_max_seq_len", "SwapInfo", "register", "ATTENTION", "SwapContext", "Recipe", "RECIPES", "resolve_recipe"]
