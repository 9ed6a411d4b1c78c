"""The RoPE table's arithmetic (aligned_ops.rope.cos_sin_f32): every element is the real cos / sin of its float64
angle, times the attention factor, rounded once to float32 — checked bit for bit against mpmath at 200 bits, and
shown to be the same in processes that differ in torch's CPU dispatch and thread count.

Why it matters: both sides read this table, and a table built from torch's float64 ``cos`` once differed between
two processes of the ISA-level test on the same machine (a flaky CI failure). The table now uses no libm or
torch transcendental at all.
"""

import hashlib
import math
import os
import random
import struct
import sys
import textwrap

import mpmath
import pytest
import torch

from aligned_ops import rope
from aligned_ops.rope import RopeSpec, cos_sin_cache, cos_sin_f32
from aligned_ops.testing import assert_bitwise_equal

mpmath.mp.prec = 200


def rn32(x) -> float:
    """Round a real (mpmath, 200 bits) to float32, ties to even (no subnormal results occur here)."""
    with mpmath.workprec(24):
        return float(+x)


def ref(angle: float, which: str, factor: float = 1.0) -> float:
    fn = mpmath.cos if which == "cos" else mpmath.sin
    return rn32(fn(mpmath.mpf(angle)) * mpmath.mpf(factor))


def bits32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def hard_angles() -> list[float]:
    """Near multiples of pi/2 (tiny reduced angle: the integer tier), large quotients, tiny angles, random."""
    rng = random.Random(1)
    out = [0.0, 5e-324, 1e-300, 2.0**-30, 1e-8, 0.5, math.pi / 4, math.pi / 2, math.pi, 1e6, 2.0**22, 2.0**24 + 3.5,
           1e9 + 0.25, 1e15]
    for k in (1, 2, 3, 7, 1000, 123457, 2**21 + 1, 2**23 + 5):
        a = k * math.pi / 2
        out += [a, math.nextafter(a, 0), math.nextafter(a, math.inf)]
    out += [rng.uniform(0, 4e6) for _ in range(300)] + [rng.uniform(0, 2) for _ in range(100)]
    return out


@pytest.mark.parametrize("factor", [1.0, 1.1732867951399863, 0.3])
def test_every_angle_correctly_rounded(factor):
    angles = hard_angles()
    cos, sin = cos_sin_f32(torch.tensor(angles, dtype=torch.float64), factor)
    assert torch.equal(cos.view(torch.int32), bits32([ref(a, "cos", factor) for a in angles]))
    assert torch.equal(sin.view(torch.int32), bits32([ref(a, "sin", factor) for a in angles]))


def test_integer_tier_alone_matches_mpmath():
    """The fixed-point tier on its own (it decides the elements the float64 tier cannot)."""
    for a in hard_angles()[:80]:
        for which in ("cos", "sin"):
            got = struct.pack("f", rope._exact_f32(a, which, 1.25))
            assert got == struct.pack("f", ref(a, which, 1.25)), (a, which)


def test_float64_tier_error_bound():
    """The float64 tier's documented bound (<= 4 ulps where it vouches), which the 16-ulp guard relies on."""
    rng = random.Random(2)
    angles = [rng.uniform(0, 3e6) for _ in range(3000)] + [rng.uniform(0, 1.6) for _ in range(1000)]
    cos, sin, undecided = rope._cos_sin_f64(torch.tensor(angles, dtype=torch.float64))
    worst = 0.0
    for i, a in enumerate(angles):
        if undecided[i]:
            continue
        for v, fn in ((float(cos[i]), mpmath.cos), (float(sin[i]), mpmath.sin)):
            worst = max(worst, float(abs(mpmath.mpf(v) - fn(mpmath.mpf(a)))) / math.ulp(v))
    assert worst <= 4.0, worst


def midpoint_angles(count=3):
    """Angles whose cos rounds to a float32 rounding midpoint in float64: there RN32(float64 cos) (a tie, to
    even) and the correctly rounded value disagree half of the time."""
    found = []
    for j in range(1, 20000):
        y = struct.unpack("f", struct.pack("f", 0.7))[0] + 2.0**-24 * (j + 0.5)  # an fp32 midpoint in [0.5, 1)
        a0 = math.acos(y)
        for n in range(-4, 5):
            a = a0 + n * math.ulp(a0)
            c = mpmath.cos(mpmath.mpf(a))
            if float(c) == y and rn32(c) != float(torch.tensor(y, dtype=torch.float64).float()):
                found.append(a)
        if len(found) >= count:
            return found
    raise AssertionError("no midpoint angle found")


def test_double_rounding_midpoints_negative_control():
    """Negative control: rounding a float64 cos (libm's or torch's) to float32 gets these elements wrong; the
    table's arithmetic gets them right."""
    angles = midpoint_angles()
    want = bits32([ref(a, "cos") for a in angles])
    t = torch.tensor(angles, dtype=torch.float64)
    assert not torch.equal(bits32([math.cos(a) for a in angles]), want)
    assert not torch.equal(t.cos().float().view(torch.int32), want)
    assert torch.equal(cos_sin_f32(t)[0].view(torch.int32), want)


@pytest.mark.parametrize("spec", [
    RopeSpec(rotary_dim=64, base=10000.0, max_position=2048),
    RopeSpec(rotary_dim=128, base=500000.0, max_position=4096, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
             high_freq_factor=4.0, original_max_position=512),
    RopeSpec(rotary_dim=96, base=1e6, max_position=1024, rope_type="yarn", factor=4.0, original_max_position=256,
             attention_factor=rope.yarn_attention_factor(4.0)),
], ids=["default", "llama3", "yarn"])
def test_table_elements_correctly_rounded(spec):
    table = cos_sin_cache(spec)
    freqs = rope.inv_freq(spec)
    half = len(freqs)
    rng = random.Random(3)
    picks = [(p, i) for p in (0, 1, table.shape[0] - 1) for i in range(half)]
    picks += [(rng.randrange(table.shape[0]), rng.randrange(half)) for _ in range(600)]
    got = torch.stack([table[p, c] for p, i in picks for c in (i, half + i)])
    want = [ref(float(p) * freqs[i], which, spec.attention_factor) for p, i in picks for which in ("cos", "sin")]
    assert torch.equal(got.view(torch.int32), bits32(want))


SCRIPT = textwrap.dedent("""
    import hashlib, sys, torch
    from aligned_ops.rope import RopeSpec, cos_sin_cache
    torch.set_num_threads(int(sys.argv[1]))
    spec = RopeSpec(rotary_dim=128, base=1e6, max_position=8192, rope_type="yarn", factor=4.0,
                    original_max_position=2048, attention_factor=1.1386)
    table = cos_sin_cache(spec)
    if sys.argv[2] == "nudge":  # the negative control: one element one ulp up
        table[4000, 17] = torch.nextafter(table[4000, 17], torch.tensor(2.0))
    print(hashlib.sha256(table.view(torch.int32).numpy().tobytes()).hexdigest())
""")


_PROCESSES = [(cap, th, False) for cap in ("default", "avx2", "avx512") for th in (1, 2)] + [("default", 1, True)]


def BACKGROUND_JOBS(tiny_checkpoint):
    """The table-building processes need nothing from this one: tests/_background.py starts them at the beginning
    of the run."""
    return {f"rope_table_{cap}_{th}{'_nudge' if nudge else ''}": dict(
        argv=[sys.executable, "-c", SCRIPT, str(th), "nudge" if nudge else "-"],
        env=dict(os.environ, ATEN_CPU_CAPABILITY=cap), timeout=300) for cap, th, nudge in _PROCESSES}


def _table_hash(background, capability, threads, nudge=False):
    proc = background.result(f"rope_table_{capability}_{threads}{'_nudge' if nudge else ''}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.slow  # seven interpreter start-ups (torch dispatch level x threads, and the negative control)
def test_table_same_across_torch_dispatch_threads_and_processes(background):
    """The table from processes with torch's CPU dispatch forced to default / AVX2 / AVX-512 and 1 or 2 threads,
    and from this process, is one set of bits. Negative control: the comparison sees one element one ulp off."""
    spec = RopeSpec(rotary_dim=128, base=1e6, max_position=8192, rope_type="yarn", factor=4.0,
                    original_max_position=2048, attention_factor=1.1386)
    here = hashlib.sha256(cos_sin_cache(spec).view(torch.int32).numpy().tobytes()).hexdigest()
    hashes = {(cap, th): _table_hash(background, cap, th) for cap in ("default", "avx2", "avx512") for th in (1, 2)}
    assert set(hashes.values()) == {here}, hashes
    assert _table_hash(background, "default", 1, nudge=True) != here


def test_table_does_not_depend_on_chunking(monkeypatch):
    spec = RopeSpec(rotary_dim=64, base=10000.0, max_position=3000)
    whole = cos_sin_cache(spec)
    monkeypatch.setattr(rope, "_CHUNK_ELEMENTS", 32 * 7)  # 7 rows per pass
    assert_bitwise_equal(cos_sin_cache(spec), whole)


def test_bad_angles_refused():
    with pytest.raises(TypeError, match="cos_sin_f32 takes float64 angles"):
        cos_sin_f32(torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite angle"):
        cos_sin_f32(torch.tensor([1.0, math.inf], dtype=torch.float64))


def nearest_double(x) -> float:
    """The float64 nearest to the real ``x`` (600-bit mpmath), chosen among neighbours by distance, ties to even:
    independent of mpmath's own rounding."""
    f = float(x)
    cands = [math.nextafter(f, -math.inf), f, math.nextafter(f, math.inf)]
    return min(cands, key=lambda c: (abs(mpmath.mpf(c) - x), struct.unpack("<q", struct.pack("<d", c))[0] & 1))


def test_inverse_frequencies_correctly_rounded():
    """Powers are correctly rounded, not libm's: glibc's pow rounds 10000 ** (198 / 256) the other way (its
    result is 0.5025 ulp off), which a host with another libm need not do."""
    with mpmath.workprec(600):
        for base in (10000.0, 500000.0, 1e6, 123456.789):
            for R in (64, 96, 128, 256):
                for i in range(0, R // 2, 3):
                    assert rope._pow(base, 2 * i / R) == nearest_double(mpmath.power(mpmath.mpf(base),
                                                                                      mpmath.mpf(2 * i / R)))
        hard = mpmath.power(mpmath.mpf(10000.0), mpmath.mpf(198 / 256))
        assert rope._pow(10000.0, 198 / 256) == nearest_double(hard) == 1240.9377607517197
        assert rope._log(1e6) == nearest_double(mpmath.log(mpmath.mpf(1e6)))
    spec = RopeSpec(rotary_dim=256, base=10000.0, max_position=16)
    assert rope.inv_freq(spec)[99] == 1.0 / 1240.9377607517197


def test_zero_tiny_and_huge_angles():
    angles = [0.0, -0.0, 5e-324, -5e-324, 1e-300, 2.0**-40, 2.0**32 * math.pi, 6e9, 1e10 + 0.5, 3e15]
    cos, sin = cos_sin_f32(torch.tensor(angles, dtype=torch.float64), 1.25)
    for j, a in enumerate(angles):
        want_c, want_s = ref(a, "cos", 1.25), ref(a, "sin", 1.25)
        if a == 0.0:
            want_s = 0.0  # sin(+-0) is +0 here (the real value has no sign)
        assert struct.pack("f", float(cos[j])) == struct.pack("f", want_c), a
        assert struct.pack("f", float(sin[j])) == struct.pack("f", want_s), a
    assert bool(rope._cos_sin_f64(torch.tensor([1e10], dtype=torch.float64))[2][0])  # |k| >= 2^32: tier 2
    assert not bool(rope._cos_sin_f64(torch.tensor([2.0**-40], dtype=torch.float64))[2][0])  # k = 0: exact r


@pytest.mark.parametrize("factor", [0.0, -1.0, math.inf, math.nan])
def test_bad_factor_refused(factor):
    with pytest.raises(ValueError, match="cos_sin_f32 factor"):
        cos_sin_f32(torch.tensor([1.0], dtype=torch.float64), factor)
