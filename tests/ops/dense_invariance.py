"""Invariance checkers shared by the dense-op tests, and the deliberately variant implementations that the
negative controls run through the same checkers (proving each checker can fail).

Every checker returns a count of mismatching rows (0 = invariant) instead of asserting, so a test can assert
``== 0`` for an aligned op and ``> 0`` for its control."""

from __future__ import annotations

import torch

from aligned_ops.testing import bitwise_equal

BATCH_SIZES = (1, 2, 3, 7, 64, 513)


def rows_varying(fn, x_full, rows) -> list[int]:
    """The rows i of ``fn(x_full)`` that are NOT bitwise equal to ``fn(x_full[i:i+1])`` alone, or to row i placed at
    another position among other rows (one checker for the kernels and for the negative controls)."""
    full = fn(x_full)
    bad = []
    for i in rows:
        alone = fn(x_full[i : i + 1])[0]
        noise = torch.randn(x_full.shape, generator=torch.Generator().manual_seed(i)).to(x_full.dtype)
        j = (i * 7 + 3) % x_full.shape[0]
        moved = noise.clone()
        moved[j] = x_full[i]
        if not (bitwise_equal(full[i], alone) and bitwise_equal(fn(moved)[j], full[i])):
            bad.append(i)
    return bad


def _as_tuple(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def batch_mismatches(fn, pool, sizes=BATCH_SIZES, seed=0, rows_checked=10) -> int:
    """fn(*inputs) maps per-row inputs (leading dim = rows) to per-row outputs (a tensor or a tuple).

    For each batch size B, a batch is drawn from the pool (other rows' content and the row's position both
    change between batch sizes) and several rows — first, second, middle, last and random ones — are compared
    through integer views (``bitwise_equal``: +0 != -0, NaN == the same NaN) against the same pool row computed alone (B = 1). Returns the number of mismatches."""
    n = pool[0].shape[0]
    g = torch.Generator().manual_seed(seed)
    alone: dict[int, tuple] = {}

    def single(i):
        if i not in alone:
            alone[i] = _as_tuple(fn(*[p[i:i + 1] for p in pool]))
        return alone[i]

    bad = 0
    for B in sizes:
        idx = torch.randperm(n, generator=g)[:B] if B <= n else torch.randint(0, n, (B,), generator=g)
        outs = _as_tuple(fn(*[p[idx] for p in pool]))
        positions = {0, min(1, B - 1), B // 2, B - 1}
        positions.update(torch.randint(0, B, (rows_checked - len(positions),), generator=g).tolist())
        for j in sorted(positions):
            ref = single(int(idx[j]))
            bad += sum(not bitwise_equal(o[j], r[0]) for o, r in zip(outs, ref))
    return bad


def thread_mismatches(fn, *inputs) -> int:
    """Outputs with torch.set_num_threads(1) vs 2 (callers pass shapes big enough that 2 threads split)."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _as_tuple(fn(*inputs))
        torch.set_num_threads(2)
        two = _as_tuple(fn(*inputs))
    finally:
        torch.set_num_threads(old)
    return sum(not bitwise_equal(a, b) for a, b in zip(one, two))


def run_mismatches(fn, *inputs, runs=3) -> int:
    first = _as_tuple(fn(*inputs))
    return sum(sum(not bitwise_equal(a, b) for a, b in zip(first, _as_tuple(fn(*inputs)))) for _ in range(runs - 1))


# ---- deliberately variant reductions (negative controls) ------------------------------------------------


def batch_variant_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 row sums whose split count grows with the batch, like a split-K / split-vocab kernel that picks
    more splits for larger batches: the partial sums are added in a different tree."""
    splits = 1 if t.shape[0] < 4 else (3 if t.shape[0] < 100 else 7)
    parts = [c.sum(-1) for c in t.tensor_split(splits, dim=-1)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def thread_variant_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 row sums split into torch.get_num_threads() partial sums (a reduction split across threads)."""
    n = torch.get_num_threads()
    parts = [c.sum(-1) for c in t.tensor_split(n, dim=-1)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def run_variant_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 row sums in a fresh random element order every call (atomics-like nondeterminism)."""
    perm = torch.randperm(t.shape[-1])
    acc = torch.zeros(t.shape[:-1], dtype=torch.float32)
    for c in t[..., perm].tensor_split(16, dim=-1):
        acc = acc + c.sum(-1)
    return acc


def contracted_for_large_batch(unfused, fused, threshold=8):
    """An elementwise kernel that takes another code path (here: fp64 intermediates, i.e. what an fma or a
    wider accumulator gives) once the batch reaches ``threshold`` rows — the per-batch-size kernel choice
    that makes engines batch-variant even without reductions."""

    def fn(*inputs):
        return (fused if inputs[0].shape[0] >= threshold else unfused)(*inputs)

    return fn
