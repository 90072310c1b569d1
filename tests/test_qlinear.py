"""Kernel registry and QuantizedLinear: real packed kernels equal x @ dequantized_weight.T (bf16 tolerance)."""
import pytest
import torch

from quant.actquant import fake_quantize_activation
from quant.gemv import cpu_kernel
from runtime.errors import UserError
from quant.qlinear import KERNELS, Kernel, QuantizedLinear, SimulatedKernel, register_kernel, select_kernel
from quant.qmath import compute_qparams, quantize
from quant.scheme import padded_width, parse_scheme


pytestmark = pytest.mark.isa


def make_layer(label, out_f=96, in_f=128, dtype=torch.float32, seed=0, bias=True, kernel=None):
    torch.manual_seed(seed)
    scheme = parse_scheme(label)
    w = torch.randn(out_f, in_f) * 0.05 + 0.01
    width = padded_width(scheme, in_f)
    wp = torch.nn.functional.pad(w, (0, width - in_f))
    scale, zero = compute_qparams(wp, scheme.weights)
    q = quantize(wp, scale, zero, scheme.weights)
    b = torch.randn(out_f) if bias else None
    layer = QuantizedLinear(q, scale, zero, scheme.weights, in_f, b, scheme.activations, dtype, kernel)
    return layer, q, scale, zero, b


@pytest.mark.parametrize("label,kernel", [("w8ch-sym", "int8"), ("w4g32-sym", "int4"),
                                          ("w4g32-asym", "int4"), ("w4g64-asym", "int4"),
                                          ("w4g128-sym", "int4"), ("w3g32-sym", "simulated"),
                                          ("w8ch-asym", "simulated"), ("w4t-sym", "simulated"),
                                          ("w2g32-asym", "simulated")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_output_equals_dequantized_matmul(label, kernel, dtype):
    """Every kernel the registry picks here ("int4" / "int8": quantspec's GEMV or torch's
    packed kernel, whichever this CPU runs)."""
    kernel = cpu_kernel(int(kernel[3:])) if kernel in ("int4", "int8") else kernel
    layer, q, scale, zero, b = make_layer(label, dtype=dtype)
    assert layer.kernel_name == kernel and layer.simulated == (kernel == "simulated")
    x = torch.randn(2, 5, 128).to(dtype)
    ref = x.float() @ layer.dequantized_weight().T + b
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, 96)
    tol = 2e-2 * ref.abs().max().item()  # bf16 activations / scales: ~3 significant digits
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("label", ["w8ch-sym", "w4g32-sym", "w4g32-asym", "w4g64-sym", "w3g32-asym"])
def test_export_is_exact_and_rebuilds_identical_buffers(label):
    layer, q, scale, zero, _ = make_layer(label)
    q2, s2, z2 = layer.export()
    assert torch.equal(q2, q)
    assert torch.equal(z2.reshape(zero.shape), zero.to(torch.int8)) or layer.spec.symmetric
    expected_scale = scale.to(s2.dtype)  # real kernels keep bf16 scales, simulated fp32
    assert torch.equal(s2.reshape(scale.shape), expected_scale)
    again = QuantizedLinear(q2, s2, z2, layer.spec, layer.in_features, layer.bias)
    for (n1, t1), (n2, t2) in zip(layer.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)


def test_dequantized_weight_is_q_minus_zero_times_scale():
    layer, q, scale, zero, _ = make_layer("w4g32-asym")
    s = scale.to(torch.bfloat16).float()
    expected = ((q.float().view(96, 4, 32) - zero[..., None]) * s[..., None]).view(96, 128)
    assert torch.equal(layer.dequantized_weight(), expected)


def test_int4_unsigned_code_conversion_extremes():
    """Codes -8 and 7 (u = 0 and 15) and the asymmetric offset t = -z*s reach the kernel correctly."""
    spec = parse_scheme("w4g32-asym").weights
    q = torch.tensor([[-8] * 16 + [7] * 16] * 16, dtype=torch.int8)
    scale, zero = torch.full((16, 1), 0.5), torch.full((16, 1), 3.0)
    layer = QuantizedLinear(q, scale, zero, spec, 32)
    y = layer(torch.eye(32))
    assert torch.equal(y.T, (q.float() - 3) * 0.5)


@pytest.mark.parametrize("label,shape,kernel", [("w4g32-sym", (40, 64), "simulated"),  # N % 16 != 0
                                                ("w8ch-sym", (32, 72), "simulated"),  # int8pack needs K % 32
                                                ("w4g32-sym", (48, 64), "int4"),
                                                ("w4g32-sym_a8tok-dyn", (32, 64), "simulated")])
def test_selection_by_shape_and_format(label, shape, kernel):
    scheme = parse_scheme(label)
    kernel = cpu_kernel(int(kernel[3:])) if kernel in ("int4", "int8") else kernel
    assert select_kernel(scheme.weights, scheme.activations, shape).name == kernel


def test_named_kernel_is_checked():
    spec = parse_scheme("w3g32-sym").weights
    with pytest.raises(UserError, match="cannot run"):
        select_kernel(spec, None, (64, 64), "int4pack")
    with pytest.raises(UserError, match="unknown kernel"):
        select_kernel(spec, None, (64, 64), "marlin")
    assert select_kernel(spec, None, (64, 64), "simulated") is SimulatedKernel


def test_registering_a_kernel_by_name_takes_priority():
    @register_kernel
    class Doubled(SimulatedKernel):
        name, simulated, priority = "test-doubled", False, 50

        @classmethod
        def supports(cls, spec, act, out_features, in_features):
            return spec.bits == 3

        def forward(self, x):
            return 2 * super().forward(x)

    try:
        layer, *_ = make_layer("w3g32-sym", bias=False)
        assert layer.kernel_name == "test-doubled" and not layer.simulated
        x = torch.randn(3, 128)
        torch.testing.assert_close(layer(x), 2 * x @ layer.dequantized_weight().T)
        assert make_layer("w4g32-sym")[0].kernel_name == cpu_kernel(4)
    finally:
        del KERNELS["test-doubled"]
    assert issubclass(Doubled, Kernel)


def test_padding_for_real():
    layer, q, *_ = make_layer("w4g32-sym+pad", out_f=32, in_f=48)
    assert q.shape == (32, 64) and layer.kernel_name == cpu_kernel(4)
    assert layer.dequantized_weight().shape == (32, 48)
    x = torch.randn(4, 48)
    ref = x @ layer.dequantized_weight().T + layer.bias
    assert (layer(x) - ref).abs().max() < 2e-2 * ref.abs().max()


def test_simulated_activation_quantization():
    layer, *_ = make_layer("w4g32-sym_a8tok-dyn", bias=False)
    x = torch.randn(3, 128)
    act = parse_scheme("w4g32-sym_a8tok-dyn").activations
    torch.testing.assert_close(layer(x), fake_quantize_activation(x, act) @ layer.dequantized_weight().T)
    assert not torch.allclose(layer(x), x @ layer.dequantized_weight().T, atol=1e-6, rtol=0)


def test_bytes():
    layer, *_ = make_layer("w4g32-sym", bias=False)
    assert layer.format_bytes() == 96 * 128 // 2 + 96 * 4 * 2  # packed nibbles + bf16 scales
    assert layer.resident_bytes() == 96 * 128 // 2 + 96 * 4 * 2 * 2  # + bf16 zero offsets


@pytest.mark.parametrize("label", ["w8ch-sym", "w4g32-asym", "w3g32-asym", "w8t-sym", "w4g32-sym+pad"])
def test_format_bytes_match_the_export(label):
    layer, *_ = make_layer(label, in_f=112 if "pad" in label else 128)
    q, scale, zero = layer.export()
    expected = q.numel() * layer.spec.bits // 8 + scale.numel() * scale.element_size()
    assert layer.format_bytes() == expected + (0 if layer.spec.symmetric else zero.numel())
