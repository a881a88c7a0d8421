"""torchao's eager quantization of an untouched model, and the comparison of a quantized program's logits with it:
shared by the weight quantization tests."""

from __future__ import annotations

import copy

import torch
from hf_models import prompt_ids
from torch import nn

PROMPT = prompt_ids(12)

# Program vs torchao eager: both compute the same integer products with the same scales; what remains is fp32
# accumulation order and XNNPACK's own arithmetic for the per-token activation scale (measured <= 1e-6 of the
# logits' scale). An activation within float error of a rounding boundary may still land on the neighbouring int8
# value in one of the two: at most one prompt prefix in twelve may do that, and stay within ONE_ROUNDING_TOL.
TORCHAO_TOL = 1e-4
ONE_ROUNDING_TOL = 0.05


def linear_config(scheme: str, group_size: int | None = None):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup

    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group_size), weight_scale_dtype=torch.bfloat16,
            intx_choose_qparams_algorithm="hqq_scale_only",
        )
    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int8, weight_granularity=PerAxis(0), intx_choose_qparams_algorithm="hqq_scale_only"
    )


def embedding_config():
    from torchao.quantization import IntxWeightOnlyConfig, PerAxis

    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0), intx_choose_qparams_algorithm="hqq_scale_only")


def torchao_quantized(model: nn.Module, linear=None, embedding=None) -> nn.Module:
    """A copy of `model` quantized eagerly by torchao: its linears (not PEFT's lora_A / lora_B) and embedding."""
    from torchao.quantization import quantize_

    model = copy.deepcopy(model)
    if linear is not None:
        quantize_(model, linear, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and "lora_" not in fqn)
    if embedding is not None:
        quantize_(model, embedding, filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    return model.eval()


def hf_prefix_logits(model: nn.Module, tokens: torch.Tensor = PROMPT) -> torch.Tensor:
    """`[T, V]`: row k is the logits after the first k + 1 tokens (a causal model sees only those)."""
    with torch.no_grad():
        return model(tokens).logits[0]


def program_prefix_logits(runner, tokens: torch.Tensor = PROMPT) -> torch.Tensor:
    """`[T, V]`: each prefix fed to the program in one call from an empty cache."""
    rows = []
    for k in range(1, tokens.shape[1] + 1):
        runner.reset()
        rows.append(runner.forward(tokens[0, :k].tolist()))
    return torch.stack(rows)


def assert_matches_torchao(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    errors = (got - expected).abs().amax(-1) / scale
    assert (errors <= TORCHAO_TOL).sum() >= len(errors) - 1, f"relative errors per prefix: {errors.tolist()}"
    assert errors.max() <= ONE_ROUNDING_TOL, f"relative errors per prefix: {errors.tolist()}"
