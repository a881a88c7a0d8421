"""torchtune decoders as a model kind: finding attention, calling the decoder's parts, registering converters."""

from __future__ import annotations

import contextlib
import importlib
from typing import ContextManager

import torch
from torch import nn

from etblocks.adapters.lora import LoRATensors
from etblocks.errors import UnsupportedModelError
from etblocks.swap.kinds import ModelKind
from etblocks.swap.registry import MIXERS, MODULES
from etblocks.swap.torchtune.attention import ROPES, gemma2_attention, multi_head_attention
from etblocks.swap.torchtune.lora import base_linear, is_lora_linear, lora_tensors
from etblocks.torchtune_compat import import_torchtune, is_torchtune_decoder


class TorchtuneKind(ModelKind):
    """A torchtune `TransformerDecoder` of self-attention layers. The programs call its parts (embeddings,
    layers with `input_pos`, norm, output) so that the vocabulary projection runs on the last token only."""

    name = "torchtune TransformerDecoder"
    positions_name = "model.max_seq_len"

    def __init__(self) -> None:
        self._registered = False

    def matches(self, model: nn.Module) -> bool:
        return is_torchtune_decoder(model)

    def prepare(self) -> None:
        if self._registered:
            return
        import_torchtune()
        from torchtune.models.gemma2._attention import Gemma2Attention
        from torchtune.modules import MultiHeadAttention
        from torchtune.modules.peft import LoRALinear

        ropes = {getattr(importlib.import_module(module), name): interleaved for (module, name), interleaved in ROPES.items()}
        MIXERS.register(MultiHeadAttention, replace=False)(multi_head_attention(ropes))
        MIXERS.register(Gemma2Attention, replace=False)(gemma2_attention(ropes))
        # Outside attention (MLP, output): the base layer now, the LoRA half loaded back as an adapter after the swap.
        MODULES.register(LoRALinear, same_output=False, replace=False)(lambda module, ctx: base_linear(module))
        self._registered = True

    def mixer_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        from torchtune.modules import TransformerSelfAttentionLayer

        for i, layer in enumerate(model.layers):
            if not isinstance(layer, TransformerSelfAttentionLayer):
                raise UnsupportedModelError(
                    f"layers.{i} is a {type(layer).__name__}; etblocks swaps decoders of TransformerSelfAttentionLayer "
                    "(cross-attention and fusion layers are not supported)"
                )
        return [(f"layers.{i}.attn", layer.attn) for i, layer in enumerate(model.layers)]

    def max_positions(self, model: nn.Module) -> int | None:
        return model.max_seq_len

    def vocab_size(self, model: nn.Module) -> int:
        return model.tok_embeddings.num_embeddings

    def logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool) -> torch.Tensor:
        h = model.tok_embeddings(tokens)
        for layer in model.layers:
            h = layer(h, input_pos=positions)
        if last_only:
            h = h[:, -1:]
        return model.output(model.norm(h))

    def token_metadata(self, model: nn.Module) -> dict:
        """torchtune keeps special tokens in its tokenizer, not its model: give bos_id/eos_ids to export."""
        return {"vocab_size": self.vocab_size(model), "bos_id": None, "eos_ids": [], "n_layers": len(model.layers)}

    def check(self, model: nn.Module, replaced: list[str]) -> None:
        from torchtune.modules import TransformerDecoder

        overridden = [name for name in ("forward", "unembed") if getattr(type(model), name) is not getattr(TransformerDecoder, name)]
        if overridden:
            raise UnsupportedModelError(
                f"{type(model).__name__} overrides TransformerDecoder.{overridden[0]}; etblocks programs run "
                "tok_embeddings, layers, norm and output as TransformerDecoder does and would skip the override"
            )

    def adapter_layers(self, model: nn.Module) -> dict[str, LoRATensors]:
        layers = {}
        for name, module in model.named_modules():
            if type(module).__name__ == "DoRALinear":
                raise UnsupportedModelError(f"{name} is a DoRALinear; DoRA rescales the merged weight per column, only LoRA is supported")
            if is_lora_linear(module):
                try:
                    layers[name] = lora_tensors(name, module)
                except ValueError as exc:
                    raise UnsupportedModelError(str(exc)) from None
        return layers

    def base_only(self, model: nn.Module) -> ContextManager:
        if not any(is_lora_linear(m) for m in model.modules()):
            return contextlib.nullcontext()
        from torchtune.modules.peft import disable_adapter

        return disable_adapter(model)
