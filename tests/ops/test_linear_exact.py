"""linear_exact (the `exact` linear profile, csrc/common/exact_linear.h): bits equal to the scalar int128
definition, invariant to batch / row position / threads / ISA level / K split (bitwise, integer views), accurate
against float64, with negative controls on torch's own GEMM."""

import math
import os
import sys
import textwrap

import pytest
import torch

import aligned_ops
from aligned_ops.testing import assert_bitwise_equal, bitwise_equal

ops = torch.ops.aligned
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _rand(*shape, g, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 423, 213), (17, 64, 16), (40, 130, 97), (2, 1536, 33)])
def test_equals_scalar_definition(dtype, shape):
    M, K, N = shape
    g = torch.Generator().manual_seed(M * 7 + K)
    x, w, b = _rand(M, K, g=g, dtype=dtype), _rand(N, K, g=g, scale=0.05, dtype=dtype), _rand(N, g=g, dtype=dtype)
    for bias in (None, b):
        assert_bitwise_equal(ops.linear_exact(x, w, bias), ops._linear_exact_reference(x, w, bias))


def test_extreme_rows_equal_definition():
    g = torch.Generator().manual_seed(3)
    K, N = 300, 40
    x = _rand(12, K, g=g)
    x[0] = 0  # zero row
    x[1, 7] = 3e4  # massive activation (BOS-like row)
    x[2, ::3] *= 1e-30  # tiny values beside ordinary ones: beyond 4 digits -> rounded (the stated limit)
    x[3] = _rand(K, g=g, scale=1e-38)  # subnormal range
    x[4, 5] = 3e38
    x[5] = _rand(K, g=g, scale=1e4)
    w = _rand(N, K, g=g, scale=0.02)
    w[:, 7] *= 1e-3  # small weights meeting the massive channel
    w[3] = 0
    assert_bitwise_equal(ops.linear_exact(x, w), ops._linear_exact_reference(x, w))


def test_nonfinite_rows_and_columns():
    g = torch.Generator().manual_seed(4)
    x, w = _rand(5, 70, g=g), _rand(9, 70, g=g)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    w[4, 69] = -float("inf")
    y = ops.linear_exact(x, w)
    assert y[1].isnan().all() and y[2].isnan().all() and y[:, 4].isnan().all()
    ok = torch.ones_like(y, dtype=torch.bool)
    ok[1] = ok[2] = False
    ok[:, 4] = False
    assert not y[ok].isnan().any()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_accuracy_against_float64(dtype):
    """The fp32 stage is the correctly rounded exact sum, so the output is round_T(fp32(exact)): compare to the
    float64 product rounded the same way; and the error is never above torch's own GEMM's."""
    g = torch.Generator().manual_seed(5)
    M, K, N = 33, 1536, 96
    x, w = _rand(M, K, g=g, dtype=dtype), _rand(N, K, g=g, scale=0.02, dtype=dtype)
    x[:, [5, 900]] *= 1e3  # outlier channels ...
    w[:, [5, 900]] *= 1e-3  # ... meeting small weights (the adversarial case of the study)
    ref = x.double() @ w.double().T
    y = ops.linear_exact(x, w)
    want = ref.float().to(dtype)
    # float64 is not exact here, so a tie may round either way: at most 1 output in 1000 may differ, by one ulp
    diff = (y.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3
    rel = ((y.double() - ref).abs() / ref.abs().clamp_min(1e-30))
    rel_t = ((torch.nn.functional.linear(x, w).double() - ref).abs() / ref.abs().clamp_min(1e-30))
    assert rel.max() <= rel_t.max() and rel.mean() <= rel_t.mean() * 1.001


def test_noncontiguous_inputs():
    g = torch.Generator().manual_seed(6)
    xt = _rand(64, 10, g=g).t()  # [10, 64] non-contiguous
    wt = _rand(64, 24, g=g).t()
    b = _rand(48, g=g)[::2]
    assert not xt.is_contiguous() and not wt.is_contiguous() and not b.is_contiguous()
    assert_bitwise_equal(ops.linear_exact(xt, wt, b), ops.linear_exact(xt.contiguous(), wt.contiguous(), b.contiguous()))
    x3 = _rand(2, 3, 64, g=g)
    assert ops.linear_exact(x3, wt).shape == (2, 3, 24)


def test_batch_and_position_invariance():
    """Every row of every batch size M = 1..300 (and every position in a shuffled batch) equals the row computed
    in the full batch, bit for bit."""
    g = torch.Generator().manual_seed(7)
    K, N = 200, 70
    x, w = _rand(300, K, g=g), _rand(N, K, g=g, scale=0.05)
    x[17, 3] = 5e3  # one BOS-like row: more digits in its tile, same bits for the others
    full = aligned_ops.linear_exact(x, w)
    for m in range(1, 301):
        assert_bitwise_equal(aligned_ops.linear_exact(x[:m], w), full[:m])
    perm = torch.randperm(300, generator=g)
    assert_bitwise_equal(aligned_ops.linear_exact(x[perm], w), full[perm])
    for r in (0, 17, 150, 299):  # a row alone, or at another position of a padded batch
        assert_bitwise_equal(aligned_ops.linear_exact(x[r : r + 1], w), full[r : r + 1])
        padded = torch.cat([x[:5], x[r : r + 1], x[40:63]])
        assert_bitwise_equal(aligned_ops.linear_exact(padded, w)[5], full[r])


def test_thread_count_invariance():
    g = torch.Generator().manual_seed(8)
    x, w = _rand(100, 1000, g=g), _rand(300, 1000, g=g, scale=0.03)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = aligned_ops.linear_exact(x, w)
        torch.set_num_threads(2)
        two = aligned_ops.linear_exact(x, w)
    finally:
        torch.set_num_threads(old)
    assert_bitwise_equal(one, two)


def test_k_split_invariance():
    """The kernel's exact partial sums over any cut of K combine to the same bits."""
    g = torch.Generator().manual_seed(9)
    x, w = _rand(20, 1000, g=g), _rand(50, 1000, g=g, scale=0.03)
    wd, we, wb = ops.linear_exact_pack_weight(w)
    base = ops.linear_exact_packed(x, wd, we, wb, 50, None, 1)
    for parts in (2, 3, 5, 7, 16, 100):
        assert_bitwise_equal(ops.linear_exact_packed(x, wd, we, wb, 50, None, parts), base)


def test_negative_control_torch_gemm_is_not_invariant():
    """The same checks on torch's bf16 GEMM (fp32 accumulation) find differences: a K split (partials summed in
    fp32) changes bits, and so does the batch size or thread count on at least some rows."""
    g = torch.Generator().manual_seed(10)
    x, w = _rand(300, 1000, g=g), _rand(300, 1000, g=g, scale=0.03)
    full = torch.nn.functional.linear(x, w)
    split = (torch.nn.functional.linear(x[:, :333].float(), w[:, :333].float())
             + torch.nn.functional.linear(x[:, 333:].float(), w[:, 333:].float())).bfloat16()
    whole = torch.nn.functional.linear(x.float(), w.float()).bfloat16()
    assert not bitwise_equal(split, whole)
    batch_diff = any(not bitwise_equal(torch.nn.functional.linear(x[:m], w), full[:m]) for m in (1, 3, 16, 17, 64))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.nn.functional.linear(x, w)
    finally:
        torch.set_num_threads(old)
    assert batch_diff or not bitwise_equal(one, full) or not bitwise_equal(split, whole)
    # and the exact op passes exactly these comparisons (the test above could fail)
    assert bitwise_equal(aligned_ops.linear_exact(x[:3], w), aligned_ops.linear_exact(x, w)[:3])


ISA_SCRIPT = textwrap.dedent(
    """
    import sys, torch, aligned_ops
    ops = torch.ops.aligned
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    out = {"unit": ops._exact_unit()}
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for (M, K, N) in ((1, 64, 16), (3, 423, 213), (37, 1536, 100), (300, 130, 33)):
            x = torch.randn(M, K, generator=g).to(dt)
            w = (torch.randn(N, K, generator=g) * 0.05).to(dt)
            x[M // 2, K // 3] = 2e4
            b = torch.randn(N, generator=g).to(dt)
            out[f"{dt}{M}_{K}_{N}"] = ops.linear_exact(x, w, b)
            wd, we, wb = ops.linear_exact_pack_weight(w)
            out[f"parts{dt}{M}_{K}_{N}"] = ops.linear_exact_packed(x, wd, we, wb, N, b, 3)
    torch.save(out, sys.argv[1])
    """
)


ISA_FAMILIES = {"linear_exact": ISA_SCRIPT}  # run once per level for the whole run by tests/_isa_matrix.py


@pytest.mark.slow
def test_isa_levels_bit_identical(isa_matrix):
    from _isa_matrix import supported_levels

    results = {}
    for level in supported_levels(amx=True):  # one level too: the unit checks below still hold
        results[level] = torch.load(isa_matrix.run(level, "linear_exact").path)
    units = {lvl: r.pop("unit") for lvl, r in results.items()}
    assert units["generic"] == "generic"
    if "amx" in units:
        assert units["amx"] == "amx" and units["avx512"] != "amx"
    base = results["generic"]
    for level, r in results.items():
        assert r.keys() == base.keys()
        for k in base:
            assert_bitwise_equal(r[k], base[k], msg=f"{level} ({units[level]}) {k}") if _takes_msg() else assert_bitwise_equal(r[k], base[k])


def _takes_msg():
    import inspect

    return "msg" in inspect.signature(assert_bitwise_equal).parameters


def test_opcheck_compile_and_gradient():
    g = torch.Generator().manual_seed(11)
    x, w, b = _rand(6, 96, g=g), _rand(40, 96, g=g, scale=0.05), _rand(40, g=g)
    torch.library.opcheck(ops.linear_exact.default, (x, w, b), test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    wd, we, wb = ops.linear_exact_pack_weight(w)
    torch.library.opcheck(ops.linear_exact_packed.default, (x, wd, we, wb, 40, b, 1), test_utils=("test_schema", "test_faketensor"))
    f = torch.compile(lambda a, c, d: ops.linear_exact(a, c, d) * 1, fullgraph=True)
    assert_bitwise_equal(f(x, w, b), ops.linear_exact(x, w, b))
    # backward: the deterministic fma path, checked against torch's gradient of the same inputs in fp64
    xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
    aligned_ops.linear_exact(xr, wr, br).sum().backward()
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x64, w64, b64).sum().backward()
    for a, r in ((xr, x64), (wr, w64), (br, b64)):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-5, atol=1e-5)
    # the raw op's autograd too
    xr.grad = None
    ops.linear_exact(xr, wr, br).sum().backward()
    torch.testing.assert_close(xr.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


def test_weight_cache_follows_versions():
    from aligned_ops.ops import linear_exact as _exact

    g = torch.Generator().manual_seed(12)
    x, w = _rand(4, 64, g=g), _rand(8, 64, g=g)
    aligned_ops.clear_exact_weight_cache()
    assert aligned_ops.cache_exact_weights(w) == 1
    y0 = aligned_ops.linear_exact(x, w)
    assert _exact.exact_weight_cache_bytes() > 0
    with torch.no_grad():
        w.mul_(2)  # a refit in place bumps the version: the packing is redone
    assert_bitwise_equal(aligned_ops.linear_exact(x, w), ops.linear_exact(x, w))
    assert not bitwise_equal(aligned_ops.linear_exact(x, w), y0)


# ---- issue 21.3: no cached packing may outlive a change of its weight ----------------------------------------


def _changed(w, g):
    return _rand(*w.shape, g=g).to(w.dtype)


def test_unregistered_weights_are_never_cached_so_any_write_is_seen():
    """A weight nobody registered is packed per call: writes the version counter misses (.data, an inference
    tensor, FSDP2's storage reuse) cannot leave a stale packing behind."""
    from aligned_ops.ops import linear_exact as _exact

    g = torch.Generator().manual_seed(21)
    x = _rand(3, 64, g=g)
    aligned_ops.clear_exact_weight_cache()
    w = _rand(8, 64, g=g)
    aligned_ops.linear_exact(x, w)
    for write in (lambda w, v: w.data.copy_(v), lambda w, v: w.detach().copy_(v)):
        v = _changed(w, g)
        write(w, v)
        assert_bitwise_equal(aligned_ops.linear_exact(x, w), ops._linear_exact_reference(x, v))
    assert _exact.exact_weight_cache_bytes() == 0 and not _exact.is_exact_weight_cacheable(w)


def test_inference_tensor_changed_in_place_is_not_stale():
    """The issue's case: a weight created under torch.inference_mode() (no version counter) and changed in place
    returned the old result. Registered or not, an inference tensor is never cached."""
    from aligned_ops.ops import linear_exact as _exact

    g = torch.Generator().manual_seed(22)
    x = _rand(3, 64, g=g)
    with torch.inference_mode():
        w = _rand(8, 64, g=g).clone()
    aligned_ops.cache_exact_weights(w)
    assert w.is_inference() and not _exact.is_exact_weight_cacheable(w)
    with torch.inference_mode():
        y0 = aligned_ops.linear_exact(x, w)
        v = _changed(w, g)
        w.copy_(v)
        y1 = aligned_ops.linear_exact(x, w)
    assert_bitwise_equal(y1, ops._linear_exact_reference(x, v))
    assert not bitwise_equal(y1, y0)


def test_storage_reuse_and_data_writes_of_registered_weights():
    """Registered weights: storage freed and re-allocated in place (FSDP2's unsharded parameters: same tensor,
    same pointer, version 0), rebinding .data, a reused pointer after the tensor died; .data writes of a
    registered weight need clear_exact_weight_cache() (or increment_version), as documented."""
    from torch.autograd.graph import increment_version

    g = torch.Generator().manual_seed(23)
    x = _rand(3, 64, g=g)
    w = _rand(8, 64, g=g)
    aligned_ops.cache_exact_weights(w)
    aligned_ops.linear_exact(x, w)
    # rebinding .data: new storage, new pointer
    v = _changed(w, g)
    w.data = v.clone()
    assert_bitwise_equal(aligned_ops.linear_exact(x, w), ops._linear_exact_reference(x, v))
    # a .data write behind the version counter: the owner's increment_version / clear makes it seen
    for invalidate in (lambda: increment_version(w), aligned_ops.clear_exact_weight_cache):
        v = _changed(w, g)
        w.data.copy_(v)
        invalidate()
        assert_bitwise_equal(aligned_ops.linear_exact(x, w), ops._linear_exact_reference(x, v))
    # the tensor dies; a new one (possibly at the same address) is a new weight, never the old packing
    for _ in range(3):
        del w
        w = _rand(8, 64, g=g)
        aligned_ops.cache_exact_weights(w)
        assert_bitwise_equal(aligned_ops.linear_exact(x, w), ops._linear_exact_reference(x, w))


def test_fsdp2_unsharded_weights_under_the_exact_profile_follow_every_step(tmp_path, monkeypatch):
    """FSDP2 re-gathers into the same unsharded parameter (same tensor, version counter never bumped, and the
    allocator may hand back the same pointer: a version-keyed cache then returned an old step's packing).
    Trainer weights are not registered, so every forward sees the current weights (one process, gloo).
    (Whether the pointer is reused is the allocator's choice: the test of .data writes above is the
    deterministic form of the same hole.)"""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    g = torch.Generator().manual_seed(24)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        lin = torch.nn.Linear(64, 16, bias=False)
        with torch.no_grad():
            lin.weight.copy_(_rand(16, 64, g=g).float())
        seen = []

        def forward(mod, args):
            seen.append(mod.weight.detach().clone())
            return aligned_ops.linear_exact(args[0], mod.weight)

        lin.forward = lambda x: forward(lin, (x,))
        fully_shard(lin)
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        x = _rand(5, 64, g=g).float()
        outs = []
        for _ in range(4):
            y = lin(x)
            outs.append(y.detach())
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
        for y, w_used in zip(outs, seen):
            assert_bitwise_equal(y, ops._linear_exact_reference(x, w_used))
        assert not bitwise_equal(outs[-1], outs[0])
    finally:
        dist.destroy_process_group()


def test_profile_switch(monkeypatch):
    g = torch.Generator().manual_seed(13)
    x, w = _rand(4, 64, g=g), _rand(8, 64, g=g)
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "exact")
    assert aligned_ops.linear_profile() == "exact"
    assert_bitwise_equal(aligned_ops.profile_linear(x, w), ops.linear_exact(x, w))
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    assert_bitwise_equal(aligned_ops.profile_linear(x, w), ops.linear(x, w))
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "tensorcore")
    with pytest.raises(ValueError, match="ALIGNED_OPS_LINEAR must be one of"):
        aligned_ops.linear_profile()


def _round_f32(n: int, e: int) -> float:
    """n * 2^e (n > 0 an integer) rounded to fp32 (nearest even; normal range): an independent model."""
    sh = n.bit_length() - 24
    if sh > 0:
        q, r = divmod(n, 1 << sh)
        half = 1 << (sh - 1)
        n, e = q + (r > half or (r == half and q & 1)), e + sh
    return math.ldexp(n, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_k_rows_whose_digits_are_all_minus_128(monkeypatch, dtype):
    """K = kMaxK = 2^17 with every digit below the top one -128 in x and weight rows: a digit pair's int32 sum
    reaches 2^14 K = 2^31, one past int32. The digit path summed K in one part and wrapped (fp32 rows:
    135119.19 for 135183.69, 4128 ulp; an exact zero gave -0.00098) while the fp64 path and the int128
    definition were right, so a row alone (M = 1: fp64 path under `auto`) and in a batch (digit path) differed.
    Expected: the exact value on every route. bf16 rows: the constant 1 + 2^-6 (digits 33, -128)."""
    K = 131072
    if dtype == torch.float32:
        V = 33 * 2**24 - 128 * (2**16 + 2**8 + 1)  # canonical integer: balanced digits 33, -128, -128, -128
    else:
        V = 2**29 + 2**23  # 1 + 2^-6: digits 33, -128
    v = V * 2.0**-29  # E = 0, V_k = V exactly
    x = torch.full((2, K), v).to(dtype)
    w = torch.full((3, K), v).to(dtype)
    w[1] = -v
    w[2, 1::2] = -v  # an exact zero sum: +0
    wd, we, wb = ops.linear_exact_pack_weight(w)
    assert wd[0, 0] == 33 and (wd[1:, 0] == -128).all()  # the premise: |C[t][u]| = 2^14 K = 2^31 for t, u >= 1
    p = _round_f32(V * V * K, -58)
    want = torch.tensor([[p, -p, 0.0]] * 2, dtype=torch.float32).to(dtype)
    assert_bitwise_equal(ops._linear_exact_reference(x, w), want)
    for mode in ("off", "all", "auto"):
        monkeypatch.setenv("ALIGNED_EXACT_F64", mode)
        assert_bitwise_equal(ops.linear_exact(x, w), want, f"batch of 2, ALIGNED_EXACT_F64={mode}")
        assert_bitwise_equal(ops.linear_exact(x[:1], w), want[:1], f"M = 1, ALIGNED_EXACT_F64={mode}")
    scan = ops.linear_exact_row_scan(x)
    parts = ops.linear_exact_partial(x, *ops.linear_exact_pack_weight_scanned(w, ops.linear_exact_row_scan(w)), 3,
                                     scan)  # the TP route at t = 1 (one part of the full K)
    assert_bitwise_equal(ops.linear_exact_finish(parts, scan, we, wb, None, dtype), want)
    # the control: K - 1 elements (2^31 - 2^14 fits int32) passed before the fix too
    p1 = _round_f32(V * V * (K - 1), -58)
    assert_bitwise_equal(ops.linear_exact(x[:, 1:], w[:2, 1:]),
                         torch.tensor([[p1, -p1]] * 2, dtype=torch.float32).to(dtype))


def test_bad_inputs_name_op_and_argument():
    g = torch.Generator().manual_seed(14)
    x, w = _rand(4, 64, g=g), _rand(8, 64, g=g)
    with pytest.raises(RuntimeError, match="aligned::linear_exact: weight dtype"):
        ops.linear_exact(x, w.float())
    with pytest.raises(RuntimeError, match="aligned::linear_exact: x has 63 input features"):
        ops.linear_exact(x[:, :63], w)
    with pytest.raises(RuntimeError, match="aligned::linear_exact_pack_weight: weight must be"):
        ops.linear_exact_pack_weight(w[0])
    with pytest.raises(RuntimeError, match="in_features must be <= 131072"):
        ops.linear_exact_pack_weight(torch.zeros(1, 131073, dtype=torch.bfloat16))
    wd, we, wb = ops.linear_exact_pack_weight(w)
    with pytest.raises(RuntimeError, match="aligned::linear_exact_packed: x has 60 input features but the packed"):
        ops.linear_exact_packed(x[:, :60], wd, we, wb, 8)
    with pytest.raises(RuntimeError, match="aligned::linear_exact_packed: weight_digits must be"):
        ops.linear_exact_packed(x, wd[:, :-64].contiguous(), we, wb, 8)
    with pytest.raises(RuntimeError, match="aligned::linear_exact_packed: weight_exponents"):
        ops.linear_exact_packed(x, wd, we[:4], wb, 8)
    with pytest.raises(RuntimeError, match="aligned::linear_exact_packed: bias must be"):
        ops.linear_exact_packed(x, wd, we, wb, 8, torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="aligned::linear_exact_packed: k_parts"):
        ops.linear_exact_packed(x, wd, we, wb, 8, None, 0)
    with pytest.raises(RuntimeError, match="aligned::linear_exact: all tensors must be on one device"):
        ops.linear_exact(x.to("meta"), w)


def test_verify_refuses_a_profile_mismatch(monkeypatch):
    """aligned-ops verify compares the profile the vLLM plugin was installed under with the trainer patch's."""
    import types

    from aligned_ops import profiles
    from aligned_ops.apps import verify
    from aligned_ops.integrations.vllm import config

    model = types.SimpleNamespace(_aligned_profile=profiles.EXACT)  # what patch_model carries
    monkeypatch.setattr(config, "installed_linear_profile", profiles.EXACT)
    assert verify.check_profiles(model) is profiles.EXACT
    monkeypatch.setattr(config, "installed_linear_profile", profiles.FMA)
    with pytest.raises(RuntimeError, match="linear profile mismatch: vLLM plugin 'fma', trainer 'exact'"):
        verify.check_profiles(model)
    # both sides resolved exact once (the variable changed since does not matter): agreed
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "fma")
    monkeypatch.setattr(config, "installed_linear_profile", profiles.EXACT)
    assert verify.check_profiles(model) is profiles.EXACT
    monkeypatch.setattr(config, "installed_linear_profile", None)  # the engine ran in another process
    assert verify.check_profiles(model) is profiles.EXACT


def BACKGROUND_JOBS(tiny_checkpoint):
    """The CLI run needs nothing from this process: tests/_background.py starts it at the beginning of the run."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return {"verify_linear_exact_cli": dict(
        argv=[sys.executable, "-m", "aligned_ops.apps.cli", "verify", "--linear", "exact", "--num-prompts", "4",
              "--max-tokens", "8"], env=env, timeout=900)}


@pytest.mark.slow
def test_verify_exact_profile_is_bitwise(background):
    """`aligned-ops verify --linear exact`: vLLM with the plugin and the patched trainer, both on the exact profile,
    agree bit for bit; the table states the profile and the distance to the fma profile (bf16 noise, not zero)."""
    pytest.importorskip("vllm")
    proc = background.result("verify_linear_exact_cli")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    def row(metric):
        for line in out.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells and cells[0] == metric:
                return cells[1:]
        raise AssertionError(f"no row {metric!r} in:\n{out[-3000:]}")

    assert float(row("bitwise equal (%)")[1]) == 100.0
    assert row("linear profile") == ["stock", "exact"]
    d = float(row("max abs Δlogp exact vs fma")[1])
    assert 0.0 < d < 0.1


def test_identity_map_is_weak_and_keyed_by_identity():
    """The registry and caches of registered weights (ops/linear_exact.py IdentityMap): keyed by the tensor object,
    not its value (two equal tensors are two keys), the entry dies with its tensor, and a tensor created later at
    the same id (CPython reuses addresses) does not hit the dead one's entry. Control: while the first tensor
    lives, the map does hold it."""
    import gc

    from aligned_ops.ops.linear_exact import IdentityMap

    m = IdentityMap()
    a, b = torch.zeros(3), torch.zeros(3)
    m[a] = "a"
    assert a in m and m.get(a) == "a"  # control
    assert b not in m and m.get(b, "none") == "none"
    ida = id(a)
    del a
    gc.collect()
    assert m.values() == [] and ida not in m._entries
    for _ in range(200):  # a later tensor at the dead one's address: never a hit
        t = torch.zeros(3)
        assert t not in m and m.get(t) is None
        if id(t) == ida:
            break
    m[b] = "b"
    m[b] = "b2"  # replacing keeps one entry; the replaced reference's callback must not drop the new one
    assert m.get(b) == "b2" and m.values() == ["b2"]
    m.clear()
    assert b not in m
