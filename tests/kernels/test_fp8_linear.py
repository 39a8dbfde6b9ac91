"""The fp8 projection: kernels/fp8_linear.py (torch._scaled_mm) against kernels.reference.fp8_linear.

torch._scaled_mm also runs on CPU in recent torch (2.13 here), which checks the call's layout and scales
without a GPU; on CUDA the same test runs natively."""

import importlib

import pytest
import torch

from kernels import reference
from kernels.reference import quantize_fp8_rows


def _case(tokens: int, in_features: int, out_features: int, device: str):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=gen) * torch.logspace(-2, 1, tokens)[:, None]  # tokens' ranges
    weight, scale = quantize_fp8_rows(torch.randn(out_features, in_features, generator=gen) * 0.05)
    return x, weight, scale


def test_reference_fp8_linear_is_the_product_of_the_quantized_operands():
    x, weight, scale = _case(9, 64, 48, "cpu")
    xq, x_scale = quantize_fp8_rows(x)
    expected = (xq.float() * x_scale[:, None]) @ (weight.float() * scale[:, None]).t()
    torch.testing.assert_close(reference.fp8_linear(x, weight, scale), expected, atol=1e-5, rtol=1e-5)
    error = (reference.fp8_linear(x, weight, scale) - x @ (weight.float() * scale[:, None]).t()).norm()
    assert 0 < error / expected.norm() < 0.06  # activations in E4M3: ~3% per value


@pytest.mark.parametrize("tokens", [1, 37, 128])
def test_scaled_mm_path_matches_the_reference(tokens, device):
    x, weight, scale = _case(tokens, 256, 96, device)
    x = x.bfloat16()
    fp8_linear = importlib.import_module("kernels.fp8_linear").fp8_linear
    try:
        got = fp8_linear(x.to(device), weight.to(device), scale.to(device))
    except (RuntimeError, NotImplementedError) as exc:
        if device == "cpu":
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {exc}")
        raise
    assert got.dtype == torch.bfloat16
    expected = reference.fp8_linear(x, weight, scale).float()  # the same bf16 input, summed in float32
    scale_of_rows = expected.abs().amax(1, keepdim=True)  # tokens differ in range by 1000x
    assert ((got.float().cpu() - expected).abs() <= 1e-2 * scale_of_rows).all()


def test_fp8_linear_refuses_features_not_multiple_of_16():
    x, weight, scale = _case(3, 40, 48, "cpu")
    with pytest.raises(ValueError, match="multiples of 16"):
        importlib.import_module("kernels.fp8_linear").fp8_linear(x, weight, scale)


@pytest.mark.parametrize("tokens", [1, 37])
def test_static_input_scale_quantizes_every_token_with_it(tokens, device):
    """compressed-tensors' static activation scales: x / input_scale clamped to the fp8 range, one scale for
    every token; the _scaled_mm path and the reference agree."""
    x, weight, scale = _case(tokens, 256, 96, device)
    input_scale = torch.tensor([0.004])  # small: the tokens of the widest range clamp at 448
    xq = (x / input_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    expected = (xq.float() * input_scale) @ (weight.float() * scale[:, None]).t()
    got = reference.fp8_linear(x, weight, scale, input_scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    fp8_linear = importlib.import_module("kernels.fp8_linear").fp8_linear
    try:
        on_device = fp8_linear(x.bfloat16().to(device), weight.to(device), scale.to(device), input_scale.to(device))
    except (RuntimeError, NotImplementedError) as exc:
        if device == "cpu":
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {exc}")
        raise
    bf16_expected = reference.fp8_linear(x.bfloat16(), weight, scale, input_scale).float()
    scale_of_rows = bf16_expected.abs().amax(1, keepdim=True)
    assert ((on_device.float().cpu() - bf16_expected).abs() <= 1e-2 * scale_of_rows).all()
