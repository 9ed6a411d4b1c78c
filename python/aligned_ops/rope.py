"""The one RoPE table builder both sides use: ``default``, ``linear``, ``dynamic``, ``llama3``, ``yarn``.

The trainer patch (``integrations/hf.py``) describes its model's RoPE with :func:`rope_spec_from_hf_config`,
the vLLM plugin describes the rotary module vLLM built with ``vllm_plugin.rope_spec_from_vllm``; both then
call :func:`cos_sin_cache`, so the ``[positions, rotary_dim]`` fp32 table (cos half | sin half) that
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
computed in Python float64; angle ``= float64(position) * inv_freq[i]`` (one IEEE product); ``cos``/``sin``
in float64, times the attention factor (float64), rounded once to float32. torch's float64 ``cos``/``sin``
differ by an ulp between their vector and scalar paths (which one an element takes depends on the table
size and thread count); that only matters when the float64 value lies within a few ulps of a float32
rounding midpoint, so exactly those elements (about 1 in 10^7) are recomputed with Python's ``math.cos`` /
``math.sin``. Each element therefore depends only on (position, i, spec), not on the table's length.
"""

from __future__ import annotations

import math
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
        if self.rope_type != "default" and not (self.factor > 0):
            raise ValueError(f"aligned_ops rope: {self.rope_type} needs factor > 0, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position:
            raise ValueError(f"aligned_ops rope: {self.rope_type} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ValueError("aligned_ops rope: llama3 needs low_freq_factor and high_freq_factor")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, attention_factor=None, mscale=None, mscale_all_dim=None) -> float:
    """YaRN's cos/sin magnitude factor, with HF's and vLLM's precedence."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return float(_yarn_mscale(factor))


def rope_spec_from_hf_config(config) -> RopeSpec:
    """The RoPE of a Hugging Face Qwen2/Qwen3/Llama config (``rope_parameters`` or legacy ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            params.setdefault(k, v)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise ValueError("aligned_ops rope: config has no rope_theta")
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


def _default_inv_freq(base: float, R: int) -> list[float]:
    return [1.0 / (base ** (2 * i / R)) for i in range(R // 2)]


def inv_freq(spec: RopeSpec) -> list[float]:
    """The ``R/2`` inverse frequencies, Python float64, in the formulas of the module docstring."""
    R = spec.rotary_dim
    if spec.rope_type == "default":
        return _default_inv_freq(spec.base, R)
    if spec.rope_type == "linear":
        return [f / spec.factor for f in _default_inv_freq(spec.base, R)]
    if spec.rope_type == "dynamic":
        trained = spec.max_trained_positions or spec.max_position
        ratio = spec.factor * spec.max_position / trained - (spec.factor - 1)
        return _default_inv_freq(spec.base * ratio ** (R / (R - 2)), R)
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
            return (R * math.log(spec.original_max_position / (rot * 2 * math.pi))) / (2 * math.log(spec.base))

        low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
        if spec.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, R - 1)
        if low == high:
            high += 0.001
        out = []
        for i in range(R // 2):
            pos_freq = spec.base ** (2 * i / R)
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


def _round_unambiguous(v64: torch.Tensor, exact) -> torch.Tensor:
    """Round float64 ``v64`` to float32; elements too close to a float32 midpoint are recomputed by ``exact``."""
    ulp = (torch.nextafter(v64, torch.full_like(v64, math.inf)) - v64).abs()
    delta = ulp * 16.0
    lo, hi = (v64 - delta).to(torch.float32), (v64 + delta).to(torch.float32)
    out = v64.to(torch.float32)
    amb = (lo != hi).nonzero()
    if amb.numel():
        fixed = torch.tensor([exact(*map(int, idx)) for idx in amb.tolist()], dtype=torch.float64)
        out[tuple(amb.t())] = fixed.to(torch.float32)
    return out


def cos_sin_cache(spec: RopeSpec, num_positions: int | None = None) -> torch.Tensor:
    """The fp32 ``[num_positions, rotary_dim]`` table ``[cos | sin]`` (``num_positions`` default: :func:`table_positions`)."""
    n = table_positions(spec) if num_positions is None else int(num_positions)
    freqs = torch.tensor(inv_freq(spec), dtype=torch.float64)
    t = torch.arange(n, dtype=torch.float64)
    angle = torch.outer(t, freqs)  # one IEEE float64 product per element
    af = float(spec.attention_factor)
    f_list = freqs.tolist()

    def table(fn, mfn):
        v = fn(angle)
        if af != 1.0:
            v = v * af
        return _round_unambiguous(v, lambda p, i: mfn(float(p) * f_list[i]) * af if af != 1.0 else mfn(float(p) * f_list[i]))

    return torch.cat([table(torch.cos, math.cos), table(torch.sin, math.sin)], dim=-1).contiguous()


def with_rotary_dim(spec: RopeSpec, rotary_dim: int) -> RopeSpec:
    return replace(spec, rotary_dim=rotary_dim)
