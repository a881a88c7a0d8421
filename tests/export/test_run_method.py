"""`run_method`: what `Method.execute` returns, as copies the caller owns, made without torch's thread pool."""

from __future__ import annotations

import pytest
import torch
from executorch.exir import to_edge
from executorch.runtime import Runtime

from etblocks.export.runner import copy_tensor, run_method

VOCAB = 49152  # above torch's parallel grain (32768): the size whose clone wakes torch's OpenMP threads


class Outputs(torch.nn.Module):
    """Outputs of every kind a program returns: logits-sized fp32, bf16, bool, int64."""

    def forward(self, x: torch.Tensor, n: torch.Tensor):
        logits = x.repeat(1, VOCAB // x.shape[1]) * n.to(x.dtype)
        return logits, x.to(torch.bfloat16), x > 0, n * 3


@pytest.fixture(scope="module")
def method():
    x, n = torch.randn(1, 64), torch.tensor([2])
    program = Runtime.get().load_program(to_edge(torch.export.export(Outputs(), (x, n))).to_executorch().buffer)
    yield program.load_method("forward")  # the method needs its program alive


def _inputs(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 64, generator=generator), torch.tensor([seed + 1])]


def test_outputs_equal_execute(method):
    inputs = _inputs(0)
    expected = method.execute(inputs)
    got = run_method(method, inputs)
    assert len(got) == len(expected) == 4
    for out, ref in zip(got, expected):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(got, list(Outputs()(*inputs)), rtol=0, atol=0)


def test_outputs_survive_the_next_call(method):
    """The runtime reuses its output memory on every call; `run_method`'s outputs must not change with it."""
    first = run_method(method, _inputs(0))
    kept = [t.clone() for t in first]
    second = run_method(method, _inputs(1))
    assert not torch.equal(second[0], kept[0])
    for out, ref in zip(first, kept):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (1, 1, VOCAB)])
def test_copy_tensor_is_an_owned_copy(dtype, shape):
    tensor = (torch.randn(shape) * 50).to(dtype)
    copied = copy_tensor(tensor)
    assert copied.dtype == dtype and copied.shape == tensor.shape
    torch.testing.assert_close(copied, tensor, rtol=0, atol=0)
    if tensor.numel():
        assert copied.data_ptr() != tensor.data_ptr()


def test_copy_tensor_of_a_strided_view():
    base = torch.arange(24.0).reshape(4, 6)
    view = base[:, 1::2]
    torch.testing.assert_close(copy_tensor(view), view.contiguous(), rtol=0, atol=0)
