"""InstanceNormalization and GroupNormalization kernels against PyTorch and onnxruntime, on rows
shorter and longer than the length from which the squares are summed by per-row dot products
(kernels/nn.py, _square_sums), with the identity affine torch's GroupNorm export passes to
InstanceNormalization (which skips the bias pass) and with a real one."""
from __future__ import annotations

import numpy as np
import pytest

from odt_ops.kernels import nn
from tests.odt_ops.test_kernels_nn import one_node, run_odt, run_ort

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")

# (N, C, spatial...): elements per instance 6, 63 (one under the per-row dot threshold), 64, 4096
SHAPES = [(2, 3, 2, 3), (3, 2, 63), (2, 4, 8, 8), (2, 4, 64, 64)]


def _inputs(shape, affine: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3 + 1.5).astype(np.float32)
    c = shape[1]
    if affine == "identity":  # what torch's GroupNorm export passes
        return x, np.ones(c, np.float32), np.zeros(c, np.float32)
    return x, rng.uniform(-2, 2, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", ["identity", "random"])
def test_instance_normalization_matches_torch_and_onnxruntime(shape, affine):
    x, scale, bias = _inputs(shape, affine)
    (got,) = nn.instance_normalization(x, scale, bias, epsilon=1e-5)
    want = torch.nn.functional.instance_norm(torch.tensor(x, dtype=torch.float64), weight=torch.tensor(scale, dtype=torch.float64),
                                             bias=torch.tensor(bias, dtype=torch.float64), eps=1e-5).numpy()
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
    model, feeds = one_node("InstanceNormalization", [x, scale, bias], opset=17, epsilon=1e-5)
    np.testing.assert_allclose(run_odt(model, feeds)[0], run_ort(model, feeds)[0], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_group_norm_as_torch_exports_it_matches_torch(shape):
    """Reshape to (N, groups, rest) -> InstanceNormalization(ones, zeros) -> Reshape -> Mul -> Add,
    the chain torch.onnx writes for GroupNorm, against torch's group_norm."""
    groups = 2
    x, gamma, beta = _inputs(shape, "random", seed=1)
    n, c = shape[:2]
    (normalized,) = nn.instance_normalization(x.reshape(n, groups, -1), np.ones(groups, np.float32),
                                              np.zeros(groups, np.float32), epsilon=1e-5)
    spread = (1, c) + (1,) * (len(shape) - 2)
    got = normalized.reshape(shape) * gamma.reshape(spread) + beta.reshape(spread)
    want = torch.nn.functional.group_norm(torch.tensor(x, dtype=torch.float64), groups, torch.tensor(gamma, dtype=torch.float64),
                                          torch.tensor(beta, dtype=torch.float64), eps=1e-5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_group_normalization_21_matches_torch(shape):
    x, scale, bias = _inputs(shape, "random", seed=2)
    (got,) = nn.group_normalization(x, scale, bias, num_groups=2, epsilon=1e-5)
    want = torch.nn.functional.group_norm(torch.tensor(x, dtype=torch.float64), 2, torch.tensor(scale, dtype=torch.float64),
                                          torch.tensor(bias, dtype=torch.float64), eps=1e-5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
