"""The one RoPE table builder both sides use: ``default``, ``linear``, ``dynamic``, ``llama3``, ``yarn``.

The trainer patch (``integrations/hf.py``) describes its model's RoPE with :func:`rope_spec_from_hf_config`,
the vLLM plugin describes the rotary module vLLM built with ``rope_spec_from_vllm`` (``integrations/vllm/layers.py``);
both then call :func:`cos_sin_cache`, so the ``[positions, rotary_dim]`` fp32 table (cos half | sin half) that
``aligned::rotary_embedding`` reads is the same tensor, bit for bit, on both sides.

Semantics (the formulas of Hugging Face ``modeling_rope_utils`` and vLLM ``rotary_embedding/*``, which agree):

- ``default``: ``inv_freq[i] = 1 / base^(2i / R)`` for ``i < R/2`` (``R = rotary_dim``).
- ``linear``: ``inv_freq / factor`` (HF divides the frequencies; vLLM divides the positions — the same angle).
- ``dynamic`` (NTK): vLLM's fixed table, ``base' = base * (factor * P / P_trained - (factor - 1))^(R / (R - 2))``
  with ``P`` = max_position_embeddings and ``P_trained`` = ``max_trained_positions`` (default ``P``, which
  makes ``base' = base``). HF's dynamic RoPE equals this up to ``P`` and re-derives the base from the current
  sequence length beyond it: that makes a token's rotation depend on the length of its sequence, which the
  contract forbids, so positions ``>= P`` are not part of the table.
- ``llama3``: frequencies with wavelength above ``P_orig / low_freq_factor`` are divided by ``factor``, below
  ``P_orig / high_freq_factor`` kept, in between blended by ``smooth = (P_orig / wavelen - low) / (high - low)``.
- ``yarn``: ``inv = interp * (1 - e) + extrap * e`` with ``extrap = 1 / base^(2i/R)``, ``interp = extrap / factor``,
  ``e = 1 - clamp((i - lo) / (hi - lo), 0, 1)`` over YaRN's correction range (``beta_fast``, ``beta_slow``,
  ``truncate``) on ``P_orig``; **cos and sin are multiplied by the attention factor** (``attention_factor``, or
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, or ``0.1 ln(factor) + 1``), as both HF and vLLM do.
- partial rotary (``partial_rotary_factor`` < 1): the table covers the first ``R = head_dim * factor`` dims;
  the op passes the other dims through (vLLM's semantics; HF's Llama/Qwen2 forward has no partial rotary).

Arithmetic (fixed, device- and thread-independent): every scalar (inverse frequencies, attention factor) is
computed in Python float64 — IEEE ``+ - * /`` and correctly rounded powers and logs (not the host's libm),
so the same on every host; YaRN's attention factor uses ``math.log`` as vLLM does (the plugin reads vLLM's
value); angle ``= float64(position) * inv_freq[i]`` (one IEEE product); each table
element is ``RN32(cos(angle) * attention_factor)`` — the real cos (sin) of that float64 angle times the
float64 factor, rounded once to float32 (:func:`cos_sin_f32`). It is evaluated with IEEE ``+ - *`` in
float64 and, for the ~1e-7 of elements that evaluation cannot decide, in integer fixed point; torch's and
libm's ``cos``/``sin`` are not used. Each element therefore depends only on (position, i, spec), not on
the table's length, the thread count, torch's CPU dispatch or its vector math library.
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from dataclasses import dataclass, replace

import torch

__all__ = ["RopeSpec", "SUPPORTED_ROPE_TYPES", "rope_spec_from_hf_config", "inv_freq", "cos_sin_cache",
           "table_positions"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Everything that determines the table. ``max_position``: the model's ``max_position_embeddings``
    (vLLM's yarn module stores ``original_max_position`` there instead; :func:`table_positions` accounts for it)."""

    rotary_dim: int
    base: float
    max_position: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    max_trained_positions: int | None = None

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"aligned_ops rope: rope_type {self.rope_type!r} is not supported "
                             f"({', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"aligned_ops rope: rotary_dim must be even and > 0, got {self.rotary_dim}")
        if not (isinstance(self.base, numbers.Real) and math.isfinite(self.base) and self.base > 0):
            raise ValueError(f"aligned_ops rope: rope_theta (the RoPE base) must be a finite number > 0, got "
                             f"{self.base!r}")
        if not (isinstance(self.max_position, numbers.Integral) and self.max_position >= 1):
            raise ValueError(f"aligned_ops rope: max_position_embeddings must be an integer >= 1, got "
                             f"{self.max_position!r}")
        if self.rope_type != "default" and not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"aligned_ops rope: {self.rope_type} needs a finite factor > 0, got {self.factor}")
        if self.rope_type == "yarn" and self.base == 1:
            raise ValueError("aligned_ops rope: yarn needs rope_theta != 1 (its correction range divides by "
                             "log(rope_theta))")
        if self.rope_type == "dynamic":
            if self.rotary_dim <= 2:
                raise ValueError(f"aligned_ops rope: dynamic NTK needs rotary_dim > 2 (its base is raised to "
                                 f"R / (R - 2)), got {self.rotary_dim}")
            trained = self.max_trained_positions or self.max_position
            ratio = self.factor * self.max_position / trained - (self.factor - 1)
            if not (ratio > 0):
                raise ValueError(f"aligned_ops rope: dynamic NTK with factor {self.factor}, max_position "
                                 f"{self.max_position} and max_trained_positions {trained} gives a base ratio "
                                 f"{ratio} <= 0")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position:
            raise ValueError(f"aligned_ops rope: {self.rope_type} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ValueError("aligned_ops rope: llama3 needs low_freq_factor and high_freq_factor")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # math.log, as vLLM computes it: the plugin takes vLLM's own float (rot.mscale), so the trainer's must be
    # the same expression on the same libm
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, attention_factor=None, mscale=None, mscale_all_dim=None) -> float:
    """YaRN's cos/sin magnitude factor, with HF's and vLLM's precedence."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return float(_yarn_mscale(factor))


def hf_rope_params(config) -> dict:
    """The RoPE parameters of a Hugging Face config as one mapping: transformers 5's ``rope_parameters`` over the
    legacy ``rope_scaling`` (a key in both takes ``rope_parameters``' value; a config object of transformers 5 has
    one mapping under both names, a raw config.json may have either). Every reader of a config's RoPE parameters
    (this module, the config checks, the DeepSeek model, the runner's config.json defaults) reads them here."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    if rope_type_of(params) in ("llama3", "yarn"):
        # transformers' rule (PreTrainedConfig's RoPE standardisation), which a raw config.json has not been
        # through: a top-level original_max_position_embeddings (Phi-3's layout) wins, else the parameter's own,
        # else max_position_embeddings
        top = getattr(config, "original_max_position_embeddings", None)
        if top is not None:
            params["original_max_position_embeddings"] = top
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = getattr(config, "max_position_embeddings", None)
    return params


def rope_type_of(params: dict) -> str:
    """The scaling type of :func:`hf_rope_params`' mapping (``rope_type``, legacy ``type``; none is ``default``)."""
    return params.get("rope_type", params.get("type", "default")) or "default"


def hf_rope_theta(config) -> float:
    """The RoPE base of a Hugging Face config: :func:`hf_rope_params`' ``rope_theta``, else the config's own."""
    base = hf_rope_params(config).get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise ValueError("aligned_ops rope: config has no rope_theta")
    return float(base)


def rope_spec_from_hf_config(config) -> RopeSpec:
    """The RoPE of a Hugging Face Qwen2/Qwen3/Llama config (``rope_parameters`` or legacy ``rope_scaling``)."""
    params = hf_rope_params(config)
    rope_type = rope_type_of(params)
    base = hf_rope_theta(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    prf = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    prf = 1.0 if prf is None else float(prf)
    if not (0.0 < prf <= 1.0):
        raise ValueError(f"aligned_ops rope: partial_rotary_factor must be in (0, 1], got {prf}")
    rotary_dim = int(head_dim * prf)
    max_pos = int(config.max_position_embeddings)
    kw = dict(rotary_dim=rotary_dim, base=float(base), max_position=max_pos, rope_type=rope_type)
    if rope_type == "default":
        return RopeSpec(**kw)
    if rope_type == "dynamic" and "alpha" in params:
        raise ValueError("aligned_ops rope: dynamic NTK-alpha RoPE is not supported (only the 'factor' form)")
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and factor is None and orig:
        factor = max_pos / orig  # HF's rule when factor is absent
    kw["factor"] = float(factor) if factor is not None else float("nan")
    if rope_type == "linear":
        return RopeSpec(**kw)
    if rope_type == "dynamic":
        return RopeSpec(**kw, max_trained_positions=params.get("max_trained_positions"))
    if rope_type == "llama3":
        return RopeSpec(**kw, low_freq_factor=float(params["low_freq_factor"]),
                        high_freq_factor=float(params["high_freq_factor"]), original_max_position=int(orig))
    if rope_type == "yarn":
        return RopeSpec(
            **kw,
            original_max_position=int(orig) if orig else None,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=yarn_attention_factor(kw["factor"], params.get("attention_factor"),
                                                   params.get("mscale"), params.get("mscale_all_dim")),
        )
    raise ValueError(f"aligned_ops rope: rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")


def _rn64(compute) -> float:
    """RN64 of a real that ``compute(mpmath)`` evaluates at 256 bits (ties to even): the host's libm plays no
    part, so every host gets the same float. (mpmath ships with torch, through sympy.)"""
    import mpmath

    with mpmath.workprec(256):
        v = compute(mpmath)
    with mpmath.workprec(53):
        return float(+v)


def _pow(x: float, y: float) -> float:
    """``x ** y`` correctly rounded (glibc's pow is within ~0.52 ulp, not always correctly rounded, and its FMA
    and non-FMA variants may differ)."""
    return _rn64(lambda m: m.power(m.mpf(x), m.mpf(y)))


def _log(x: float) -> float:
    """``math.log(x)`` correctly rounded."""
    return _rn64(lambda m: m.log(m.mpf(x)))


def _default_inv_freq(base: float, R: int) -> list[float]:
    return [1.0 / _pow(base, 2 * i / R) for i in range(R // 2)]


def deepseek_attention_scale(qk_head_dim: int, config) -> float:
    """DeepSeek's (MLA) softmax scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a
    scaled RoPE whose parameters give ``mscale_all_dim`` (HF's ``yarn_apply_mscale``, vLLM's DeepseekV2Attention:
    ``(scale * m) * m`` in float64, ``m = 0.1 * mscale_all_dim * ln(factor) + 1`` for factor > 1). The table's own
    factor (cos / sin times ``mscale / mscale_all_dim``) is :func:`rope_spec_from_hf_config`'s."""
    params = hf_rope_params(config)
    scale = float(qk_head_dim) ** (-0.5)
    if rope_type_of(params) != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = _yarn_mscale(float(params["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


def inv_freq(spec: RopeSpec) -> list[float]:
    """The ``R/2`` inverse frequencies, Python float64, in the formulas of the module docstring (powers and logs
    correctly rounded, every other step one IEEE operation)."""
    R = spec.rotary_dim
    if spec.rope_type == "default":
        return _default_inv_freq(spec.base, R)
    if spec.rope_type == "linear":
        return [f / spec.factor for f in _default_inv_freq(spec.base, R)]
    if spec.rope_type == "dynamic":
        trained = spec.max_trained_positions or spec.max_position
        ratio = spec.factor * spec.max_position / trained - (spec.factor - 1)
        return _default_inv_freq(spec.base * _pow(ratio, R / (R - 2)), R)
    if spec.rope_type == "llama3":
        orig, lo, hi = spec.original_max_position, spec.low_freq_factor, spec.high_freq_factor
        low_wavelen, high_wavelen = orig / lo, orig / hi
        out = []
        for f in _default_inv_freq(spec.base, R):
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / spec.factor)
            else:
                smooth = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / spec.factor + smooth * f)
        return out
    if spec.rope_type == "yarn":

        def correction_dim(rot):
            return (R * _log(spec.original_max_position / (rot * 2 * math.pi))) / (2 * _log(spec.base))

        low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
        if spec.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, R - 1)
        if low == high:
            high += 0.001
        out = []
        for i in range(R // 2):
            pos_freq = _pow(spec.base, 2 * i / R)
            extrap, interp = 1.0 / pos_freq, 1.0 / (spec.factor * pos_freq)
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            e = 1.0 - ramp
            out.append(interp * (1 - e) + extrap * e)
        return out
    raise AssertionError(spec.rope_type)


def table_positions(spec: RopeSpec) -> int:
    """Rows of the table: the positions the model can address (vLLM's cache length for each type)."""
    if spec.rope_type == "linear":
        return int(spec.max_position * spec.factor)
    if spec.rope_type == "yarn":
        return max(int(spec.original_max_position * spec.factor), spec.max_position)
    return spec.max_position


# ---- the table's arithmetic: cos / sin of a float64 angle, correctly rounded to float32 -----------------------
#
# Every element is RN32(cos(a) * af) (resp. sin): the real cos of the float64 angle ``a``, times the float64
# attention factor, rounded once to float32. That is a pure function of (a, af), so the table is the same on
# every host, torch build, libm and thread count. It is evaluated in two tiers:
#   1. a float64 evaluation from IEEE +, -, *, round only (no libm, no vendor vector math, no FMA: each torch
#      elementwise op rounds once, on any CPU): Cody-Waite reduction by pi/2 in three parts and Taylor
#      polynomials on |r| <= pi/4, error <= 4 float64 ulps wherever k = 0, or |r| >= 2^-24 and |k| < 2^32;
#   2. an integer fixed-point evaluation (``_exact_f32``: 320+ bits, reduction and series exact to ~2^-300,
#      rounding decided with an error bound) for the few elements tier 1 cannot decide: those within 16 float64
#      ulps of a float32 rounding midpoint (~6e-8 of them), a tiny reduced angle (|r| < 2^-24, k != 0: the
#      reduction's absolute error would no longer be small relative to r) or a huge quotient (|k| >= 2^32).
# torch's own float64 cos/sin are not used: their bits are whatever the build's vector math library (MKL VML,
# Sleef, libm for tails) returns, and a table built from them once differed between two processes of the same
# test on the same machine (tests/cpu/test_isa_levels.py, in CI).


@functools.lru_cache(maxsize=8)
def _pi_fixed(bits: int) -> int:
    """floor(pi * 2^bits) (Machin's formula in integers, 64 guard bits)."""
    scale = 1 << (bits + 64)

    def arctan_inv(n: int) -> int:  # arctan(1/n) * scale, alternating series
        total, term, k, n2 = 0, scale // n, 1, n * n
        while term:
            total += term // k if (k // 2) % 2 == 0 else -(term // k)
            term //= n2
            k += 2
        return total

    return (16 * arctan_inv(5) - 4 * arctan_inv(239)) >> 64


def _split(value_fixed: int, bits: int, sig: int) -> tuple[float, int]:
    """The float with ``sig`` leading bits of ``value_fixed / 2^bits`` (truncated) and the fixed-point rest."""
    shift = max(value_fixed.bit_length() - sig, 0)
    head = (value_fixed >> shift) << shift
    return math.ldexp(head >> shift, shift - bits), value_fixed - head


def _pio2_parts() -> tuple[float, float, float, float]:
    """pi/2 = C1 + C2 + C3 + C4 + O(2^-115): C1..C3 with at most 21 significant bits, so k*Ci is exact for
    |k| < 2^32; C4 with 53."""
    bits = 240
    half_pi = _pi_fixed(bits) >> 1
    c1, rest = _split(half_pi, bits, 21)
    c2, rest = _split(rest, bits, 21)
    c3, rest = _split(rest, bits, 21)
    c4 = math.ldexp(rest, -bits)  # one rounding
    return c1, c2, c3, c4


_PIO2_C1, _PIO2_C2, _PIO2_C3, _PIO2_C4 = _pio2_parts()
_TWO_OVER_PI = 2.0 / math.pi  # any nearby value works: it only picks the quadrant k
_MAX_K = float(1 << 32)
_MIN_R = 2.0**-24
# Taylor coefficients, highest degree first: sin(r) = r + r^3 * S(r^2), cos(r) = 1 + r^2 * C(r^2).
_SIN_COEFFS = [(-1) ** n / math.factorial(2 * n + 1) for n in range(10, 0, -1)]
_COS_COEFFS = [(-1) ** n / math.factorial(2 * n) for n in range(10, 0, -1)]


def _horner(coeffs: list[float], r2: torch.Tensor) -> torch.Tensor:
    p = torch.full_like(r2, coeffs[0])
    for c in coeffs[1:]:
        p = p * r2 + c  # two roundings: torch never contracts separate elementwise ops into an FMA
    return p


def _cos_sin_f64(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tier 1: float64 (cos, sin) and the mask of elements it does not vouch for (tiny r, huge k)."""
    k = torch.round(angle * _TWO_OVER_PI)
    # k*C1, k*C2, k*C3 and the first difference exact (Sterbenz); three roundings after it, ~2^-84 absolute
    r = (((angle - k * _PIO2_C1) - k * _PIO2_C2) - k * _PIO2_C3) - k * _PIO2_C4
    r2 = r * r
    s = r + (r * r2) * _horner(_SIN_COEFFS, r2)
    c = 1.0 + r2 * _horner(_COS_COEFFS, r2)
    q = torch.remainder(k, 4.0)
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    # a tiny r is exact when k = 0 (r = angle); otherwise the reduction's absolute error would matter
    undecided = ((r.abs() < _MIN_R) & (k != 0)) | (k.abs() >= _MAX_K)
    return cos, sin, undecided


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]  # RN (the C cast); |x| < FLT_MAX here


def _round_fixed_to_f32(v: int, bits: int, err: int):
    """RN32(v / 2^bits), or None when the true value, within ``err`` units of ``v``, may lie on either side of
    a rounding midpoint."""
    sign, x = (-1.0 if v < 0 else 1.0), abs(v)
    if x <= err:
        return None  # the sign is not settled yet (v is never exactly 0: factor > 0, angle != 0)
    shift = max(x.bit_length() - 24, bits - 149)  # 24 significant bits, or the subnormal lsb 2^-149
    if shift <= 0:
        return sign * math.ldexp(x, -bits)  # representable
    mant, rem = x >> shift, x & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if abs(rem - half) <= err:
        return None
    if rem > half:
        mant += 1
    return sign * math.ldexp(mant, shift - bits)


def _exact_f32(angle: float, which: str, factor: float) -> float:
    """Tier 2: RN32(cos(angle) * factor) (``which`` 'cos') or RN32(sin(angle) * factor), in integers."""
    if angle == 0.0:  # cos 1, sin 0: exact (cos_sin_f32 passes +0 for -0)
        return _f32(factor) if which == "cos" else 0.0
    bits = max(320, 64 - 2 * math.frexp(angle)[1])  # enough that a tiny angle is not truncated to 0
    while True:
        num, den = angle.as_integer_ratio()  # den: a power of two
        scale = 1 << bits
        a = (num * scale) // den  # |error| < 1 unit, a != 0
        half_pi = _pi_fixed(bits) >> 1
        k = (2 * a + half_pi) // (2 * half_pi)
        r = a - k * half_pi  # |error| <= |k| + 2 units
        r2 = (r * r) >> bits
        # sin(r) = sum (-1)^n r^(2n+1)/(2n+1)!, cos(r) = sum (-1)^n r^(2n)/(2n)!, each term truncated
        s_sum, term, n = 0, r, 0
        while term:
            s_sum += term
            term = -((term * r2) >> bits) // ((2 * n + 2) * (2 * n + 3))
            n += 1
        terms = n
        c_sum, term, n = 0, scale, 0
        while term:
            c_sum += term
            term = -((term * r2) >> bits) // ((2 * n + 1) * (2 * n + 2))
            n += 1
        terms += n
        quadrant = k % 4
        if which == "cos":
            v = (c_sum, -s_sum, -c_sum, s_sum)[quadrant]
        else:
            v = (s_sum, c_sum, -s_sum, -c_sum)[quadrant]
        fnum, fden = float(factor).as_integer_ratio()
        v = v * fnum // fden
        err = (abs(k) + 4 + 2 * terms) * (abs(fnum) // fden + 2) + 2  # generous: a few units per step
        out = _round_fixed_to_f32(v, bits, err)
        if out is not None:
            return out
        bits *= 2  # undecided at this precision (a true midpoint cannot occur: cos, sin of a rational != 0)


def _round_unambiguous(v64: torch.Tensor, exact, undecided: torch.Tensor) -> torch.Tensor:
    """Round the 1-D float64 ``v64`` (each within a few ulps of its true value) to float32; the elements too
    close to a float32 midpoint for that to be safe, and those in ``undecided``, are ``exact(j)`` instead."""
    ulp = (torch.nextafter(v64, torch.full_like(v64, math.inf)) - v64).abs()
    delta = ulp * 16.0
    lo, hi = (v64 - delta).to(torch.float32), (v64 + delta).to(torch.float32)
    out = v64.to(torch.float32)
    redo = ((lo != hi) | undecided).nonzero().flatten()
    if redo.numel():
        out[redo] = torch.tensor([exact(j) for j in redo.tolist()], dtype=torch.float32, device=out.device)
    return out


def cos_sin_f32(angle: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RN32(cos(angle) * factor), RN32(sin(angle) * factor))`` for a float64 tensor of angles: the real
    functions of each float64 value, rounded once to float32 (the two tiers above)."""
    if angle.dtype != torch.float64:
        raise TypeError(f"aligned_ops rope: cos_sin_f32 takes float64 angles, got {angle.dtype}")
    if not bool(torch.isfinite(angle).all()):
        raise ValueError("aligned_ops rope: cos_sin_f32 got a non-finite angle")
    factor = float(factor)
    if not (math.isfinite(factor) and 0.0 < factor < 2.0**64):
        raise ValueError(f"aligned_ops rope: cos_sin_f32 factor (the attention factor) must be finite and > 0, "
                         f"got {factor}")
    angle = angle + 0.0  # -0 -> +0: sin(+-0) is +0 in both tiers
    cos, sin, undecided = _cos_sin_f64(angle)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    flat, undecided = angle.reshape(-1), undecided.reshape(-1)
    cos32, sin32 = (_round_unambiguous(v.reshape(-1), lambda j, w=which: _exact_f32(float(flat[j]), w, factor),
                                       undecided) for v, which in ((cos, "cos"), (sin, "sin")))
    return cos32.reshape(angle.shape), sin32.reshape(angle.shape)


_CHUNK_ELEMENTS = 1 << 20  # elements per pass: bounds the float64 temporaries to ~100 MB


def cos_sin_cache(spec: RopeSpec, num_positions: int | None = None) -> torch.Tensor:
    """The fp32 ``[num_positions, rotary_dim]`` table ``[cos | sin]`` (``num_positions`` default: :func:`table_positions`).

    Element ``[p, i]`` is ``RN32(cos(float64(p) * inv_freq[i]) * attention_factor)`` (``[p, R/2 + i]``: sin): the
    real function of the float64 angle, rounded once, whatever the host, the torch build, the thread count or
    the table's length (:func:`cos_sin_f32`)."""
    n = table_positions(spec) if num_positions is None else int(num_positions)
    freqs = torch.tensor(inv_freq(spec), dtype=torch.float64)
    half = freqs.numel()
    out = torch.empty(n, 2 * half, dtype=torch.float32)
    rows = max(1, _CHUNK_ELEMENTS // half)
    for p0 in range(0, n, rows):
        p1 = min(n, p0 + rows)
        angle = torch.outer(torch.arange(p0, p1, dtype=torch.float64), freqs)  # one IEEE product per element
        out[p0:p1, :half], out[p0:p1, half:] = cos_sin_f32(angle, spec.attention_factor)
    return out


def with_rotary_dim(spec: RopeSpec, rotary_dim: int) -> RopeSpec:
    return replace(spec, rotary_dim=rotary_dim)
