"""Erf: the error function in numpy, which has none (math.erf is scalar, scipy is not a
dependency of the engine), to the last bit of float32 and about 2e-16 in float64."""
from __future__ import annotations

import math

import numpy as np

from odt_ops.kernels.registry import kernel

# float64: W. J. Cody, "Rational Chebyshev approximations for the error function",
# Math. Comp. 23 (1969): erf on |x| <= 0.46875, erfc on (0.46875, 4] and beyond, each
# a rational function; about 2e-16 absolute error. Its three branches need masking,
# which costs more than the arithmetic, so narrower floats take one branch-free
# rational instead (below), evaluated in float64 on cache-sized blocks.

_ERF_P = (1.85777706184603153e-1, 3.16112374387056560e00, 1.13864154151050156e02,
          3.77485237685302021e02, 3.20937758913846947e03)
_ERF_Q = (1.0, 2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
          2.84423683343917062e03)
_ERFC_MID_P = (2.15311535474403846e-8, 5.64188496988670089e-1, 8.88314979438837594e00,
               6.61191906371416295e01, 2.98635138197400131e02, 8.81952221241769090e02,
               1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03)
_ERFC_MID_Q = (1.0, 1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
               1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
               3.43936767414372164e03, 1.23033935480374942e03)
_ERFC_TAIL_P = (1.63153871373020978e-2, 3.05326634961232344e-1, 3.60344899949804439e-1,
                1.25781726111229246e-1, 1.60837851487422766e-2, 6.58749161529837803e-4)
_ERFC_TAIL_Q = (1.0, 2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
                6.05183413124413191e-2, 2.33520497626869185e-3)
_ERF_SMALL, _ERF_MID = 0.46875, 4.0
_ERF_ONE = 6.0  # erfc(6) < 2.2e-17: erf is 1.0 in float64 from here on

# float32 and narrower: erf(x) ~ x * P(x^2) / Q(x^2) on |x| <= 4 (erf(4) rounds to 1.0 in
# float32), P(0) = 2/sqrt(pi). A least-squares rational fit reweighted toward minimax
# (Lawson) of erf(x)/x against math.erf: error below 2.2e-9, relative below 1 and
# absolute above, so float32 results are off by at most the final rounding.
_ERF32_P = (-1.3093628924424753e-08, 4.6624132170978344e-06, 0.00037887900798537407,
            0.0038516762187996794, 0.05431236627371218, 0.18531193187274492, 1.1283791670955126)
_ERF32_Q = (6.290023751431485e-05, 0.0013070239866662123, 0.015463522876470164,
            0.11398658704841802, 0.49756181149507805, 1.0)
_ERF32_CLAMP = 4.0
_BLOCK = 1 << 16  # elements per float64 block: the temporaries stay in cache


def _rational(p: tuple, q: tuple, t: np.ndarray) -> np.ndarray:
    """p(t) / q(t) by Horner, coefficients highest degree first."""
    num = np.full_like(t, p[0])
    den = np.full_like(t, q[0])
    for c in p[1:]:
        num *= t
        num += c
    for c in q[1:]:
        den *= t
        den += c
    num /= den
    return num


def _erfc_large(y: np.ndarray) -> np.ndarray:
    """erfc(y) for 0.46875 < y < 6."""
    out = np.empty_like(y)
    mid = y <= _ERF_MID
    ym = y[mid]
    out[mid] = _rational(_ERFC_MID_P, _ERFC_MID_Q, ym) * np.exp(-ym * ym)
    yt = y[~mid]
    z = 1.0 / (yt * yt)
    out[~mid] = (1.0 / math.sqrt(math.pi) - z * _rational(_ERFC_TAIL_P, _ERFC_TAIL_Q, z)) / yt * np.exp(-yt * yt)
    return out


def _erf64(x: np.ndarray) -> np.ndarray:
    y = np.abs(x)
    out = np.ones_like(x)  # right for |x| >= 6 once signed
    small = y <= _ERF_SMALL
    xs = x[small]
    out[small] = xs * _rational(_ERF_P, _ERF_Q, xs * xs)
    large = (y > _ERF_SMALL) & (y < _ERF_ONE)
    out[large] = 1.0 - _erfc_large(y[large])
    np.copysign(out, x, out=out)  # erf is odd (the small branch has its sign already)
    out[np.isnan(x)] = np.nan
    return out


def _erf_narrow(X: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(X).reshape(-1)
    out = np.empty(flat.shape, X.dtype)
    for i in range(0, flat.size, _BLOCK):
        x = flat[i:i + _BLOCK].astype(np.float64)
        np.clip(x, -_ERF32_CLAMP, _ERF32_CLAMP, out=x)  # NaN stays NaN
        r = _rational(_ERF32_P, _ERF32_Q, x * x)
        r *= x
        out[i:i + _BLOCK] = r
    return out.reshape(X.shape)


def erf_values(X: np.ndarray) -> np.ndarray:
    if X.dtype == np.float64 or X.dtype.kind in "iu":  # Erf accepts integers too
        return _erf64(np.asarray(X, dtype=np.float64)).astype(X.dtype, copy=False)
    return _erf_narrow(X)


@kernel("Erf", since=9)
def erf(input):
    return (erf_values(input),)
