"""The fused LM-head log-prob: ``token_logprobs(linear(hidden, W, b), ids, T)`` and its gradient, bit for bit,
without the ``[T, V]`` logits (issue 14, item 5).

Why chunking cannot change a bit. Every element of the unfused path is a function of one row or one column:
  * ``linear``: each logit z[t, v] is the `fma` profile's 8-lane tree over K of (hidden[t], W[v]) (contract.h):
    recomputing any tile of rows x columns gives the same bits (tiling- and batch-invariant by the contract);
  * ``token_logprobs``: each row's (m, L) pair and logp depend on the row's full V logits only;
  * its backward: dz[t, v] = round_T(((v == id_t) - p_tv) * g_t / tau_t) is elementwise given the row's pair
    (contract.h ``token_logprobs_grad``, the helper every backward kernel calls);
  * ``linear_backward``: dx[t, k] is ONE fma chain over v = 0..V-1 of dz[t, v] * W[v, k] (a row of dz, all V),
    dW[v, k] is ONE chain over the tokens in batch order of dz[t, v] * hidden[t, k] (a column of dz, all T),
    db[v] the chain over tokens of dz[t, v].
So the op is two sweeps, each running the existing aligned kernels on complete reduction ranges:
  * token chunks of FULL rows (forward, d hidden): logits [Tc, V] -> token_logprobs_pairs (logp and the rows'
    (m, L) pairs, kept: T x 2 fp32) -> token_logprobs_backward -> linear_backward's dx rows;
  * vocabulary chunks of ALL tokens (d W, d b): logits [T, Vc] -> token_logprobs_backward_cols (the same
    elements, from the kept pairs) -> linear_backward's dW / db rows of that chunk.
No reduction is ever split, so there is no carried lane state and no second order: the bits are those of the
unfused path by construction, whatever the chunk sizes (tests/ops/test_lm_head.py compares them through integer
views; a naive chunked logsumexp merge is the negative control). Cost: the forward computes the logits once,
the backward twice (one recompute per sweep). Peak extra memory: one tile in the forward, two (logits + their
gradient) in the backward, of about ``DEFAULT_TILE_BYTES`` each, instead of the ``[T, V]`` logits and their
gradient — measured as the process's peak resident set (bench/bench_lm_head.py, RESULTS.md; why the tiles are
48 MiB: DEFAULT_TILE_BYTES).

The `fma` linear profile only (``ALIGNED_OPS_LINEAR=exact`` is refused by hf.completion_logprobs' option).
"""

from __future__ import annotations

import torch

from ._registry import checked_int, register_no_backward
from .logits import _FP32_MIN_NORMAL, _check_temperature, _temperature_args, refuse_temperature_grad

ops = torch.ops.aligned
_lib = "aligned::"
_OP = "fused_token_logprobs"

# Default chunk sizes: each tile (logits or their gradient, in the logits dtype) about this many bytes.
#
# Why 48 MiB and not smaller (issue 21.7). A tile is allocated and freed once per chunk. glibc's malloc serves
# blocks below its mmap threshold from the heap, and raises that threshold (dynamically, up to 32 MiB on 64-bit)
# to the size of every mmapped block freed — so after the first tile, 16 or 32 MiB tiles came from the heap. A
# small allocation made while a tile is alive (the chunk's log-probs, the kernels' own bookkeeping, another
# thread's) then sits above or inside the freed tile, the next tile does not fit the hole, the heap grows by a
# tile per chunk, and freed heap pages stay resident: the forward at T = 4096, V = 151,936 peaked at 1.1-1.2 GB
# of resident memory — the bf16 logits' size — in about half the runs (which half depended on thread timing).
# Tiles above the threshold's 32 MiB ceiling are always mmapped and their pages go back to the OS when freed,
# whatever happened before: peak = the live tiles (one in the forward, two in the backward sweeps) plus the
# outputs (bench/bench_lm_head.py, bench/RESULTS.md). Allocators that cache large blocks (jemalloc, tcmalloc)
# reuse the same-sized tile. With fewer total logits than one tile, the chunk is all of them.
DEFAULT_TILE_BYTES = 48 << 20
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc (malloc/malloc.c)

# completion_logprobs(fused_lm_head="auto"), the default: fused when the [T, V] logits would take at least this
# many bytes (and the scoring is eligible: full vocabulary, fma profile, model-dtype logits). Same bits either way
# (by construction, and tested); the fused step holds ~2 tiles instead of the logits and their gradient, at the
# price of recomputing the logits once per backward sweep (5 LM-head GEMMs per training step instead of 3; a
# no-grad scoring pass computes them once either way). Below the threshold the memory saved is small and the
# unfused path is at least as fast.
FUSED_AUTO_MIN_LOGITS_BYTES = 256 << 20


def fused_by_default(num_tokens: int, vocab: int, dtype: torch.dtype) -> bool:
    """Whether ``fused_lm_head="auto"`` fuses: the ``[num_tokens, vocab]`` logits of ``dtype`` would take at least
    :data:`FUSED_AUTO_MIN_LOGITS_BYTES`."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_tokens * vocab * elem >= FUSED_AUTO_MIN_LOGITS_BYTES


def _auto_chunk(chunk: int, other: int, elem: int, name: str) -> int:
    if chunk < 0:
        raise ValueError(f"aligned::{_OP}: {name} must be >= 0 (0 = automatic), got {chunk}")
    if chunk:
        return int(chunk)
    return max(1, DEFAULT_TILE_BYTES // max(1, other * elem))


def _check(hidden, weight, bias, token_ids, temperatures, token_chunk, vocab_chunk):
    op = f"aligned::{_OP}"
    if hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be 2-D [T, K], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _DTYPES:
        raise ValueError(f"{op}: hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{op}: weight must be [V, {hidden.shape[1]}] (hidden's K), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype != hidden.dtype):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}] of dtype {hidden.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if token_ids.dim() != 1 or token_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"{op}: token_ids must be [{hidden.shape[0]}], got {tuple(token_ids.shape)}")
    if token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: token_ids must be int64 or int32, got {token_ids.dtype}")
    if temperatures is not None and (temperatures.dim() != 1 or temperatures.shape[0] != hidden.shape[0]):
        raise ValueError(f"{op}: temperatures must be [{hidden.shape[0]}], got {tuple(temperatures.shape)}")
    for name, c in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if c < 0:
            raise ValueError(f"{op}: {name} must be >= 0 (0 = automatic), got {c}")


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_temperature_values(temperature, temperatures):
    """The values the pieces would otherwise refuse under their own names (the op's kernel reads its tensors on the
    host: the token ids' range below, the per-row temperatures here)."""
    op = f"aligned::{_OP}"
    _check_temperature(op, temperature)
    if temperatures is not None and temperatures.numel():
        t32 = temperatures.to(torch.float32)
        if not bool((t32.isfinite() & (t32 >= _FP32_MIN_NORMAL)).all()):
            raise ValueError(f"{op}: every temperature must be finite and > 0, and a normal float32 value (>= "
                             f"{_FP32_MIN_NORMAL}) after conversion to float32")


def _ranges(n: int, chunk: int):
    return [(s, min(n, s + chunk)) for s in range(0, n, chunk)]


def _rows(t, a, b):
    return None if t is None else t[a:b]


def _forward_impl(hidden, weight, bias, token_ids, temperature=1.0, temperatures=None, token_chunk=0, vocab_chunk=0):
    _check(hidden, weight, bias, token_ids, temperatures, token_chunk, vocab_chunk)
    _check_temperature_values(temperature, temperatures)
    T, V = hidden.shape[0], weight.shape[0]
    if T and not (0 <= int(token_ids.min()) and int(token_ids.max()) < V):
        raise ValueError(f"aligned::{_OP}: token_ids must lie in [0, {V}), got [{int(token_ids.min())}, "
                         f"{int(token_ids.max())}]")
    hidden = hidden.contiguous()
    tc = _auto_chunk(token_chunk, V, hidden.element_size(), "token_chunk")
    # The outputs exist before the first tile: no small tensor is born per chunk and kept (see DEFAULT_TILE_BYTES).
    lps = hidden.new_empty((T,), dtype=torch.float32)
    pairs = hidden.new_empty((T, 2), dtype=torch.float32)
    for a, b in _ranges(T, tc):
        z = ops.linear(hidden[a:b], weight, bias)  # [Tc, V]: full rows, the unfused logits' bits
        lp, pr = ops.token_logprobs_pairs(z, token_ids[a:b], temperature, _rows(temperatures, a, b))
        lps[a:b] = lp
        pairs[a:b] = pr
        del z, lp, pr
    return lps, pairs


def _backward_impl(grad, hidden, weight, bias, token_ids, lse_pairs, temperature, temperatures, token_chunk,
                   vocab_chunk, needs_hidden_grad, needs_weight_grad, needs_bias_grad):
    _check(hidden, weight, bias, token_ids, temperatures, token_chunk, vocab_chunk)
    T, K = hidden.shape
    V = weight.shape[0]
    hidden = hidden.contiguous()
    grad = grad.contiguous()
    dx = dw = db = None
    if needs_hidden_grad:
        # d hidden: token chunks of full rows; each dx row is one chain over all V (linear_backward's dx).
        dx = torch.empty_like(hidden)
        tc = _auto_chunk(token_chunk, V, hidden.element_size(), "token_chunk")
        for a, b in _ranges(T, tc):
            z = ops.linear(hidden[a:b], weight, bias)
            dz = ops.token_logprobs_backward(grad[a:b], z, token_ids[a:b], temperature, _rows(temperatures, a, b))
            del z
            dx[a:b] = ops.linear_backward(dz, hidden[a:b], weight, True, False, False)[0]
            del dz
    needs_bias_grad = needs_bias_grad and bias is not None
    if needs_weight_grad or needs_bias_grad:
        # d W, d b: vocabulary chunks of all tokens; each dW row is one chain over the T tokens in order.
        if needs_weight_grad:
            dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
        if needs_bias_grad:
            db = torch.empty_like(bias)
        vc = _auto_chunk(vocab_chunk, T, hidden.element_size(), "vocab_chunk")
        for a, b in _ranges(V, vc):
            w = weight[a:b]
            z = ops.linear(hidden, w, _rows(bias, a, b))  # [T, Vc]: the unfused logits' columns a..b-1
            dz = ops.token_logprobs_backward_cols(grad, z, token_ids, lse_pairs, a, V, temperature, temperatures)
            del z
            _, dwc, dbc = ops.linear_backward(dz, hidden, w, False, needs_weight_grad, needs_bias_grad)
            del dz
            if needs_weight_grad:
                dw[a:b] = dwc
            if needs_bias_grad:
                db[a:b] = dbc
    return dx, dw, db


torch.library.register_kernel(_lib + "fused_token_logprobs", "cpu", _forward_impl)
torch.library.register_kernel(_lib + "fused_token_logprobs_backward", "cpu", _backward_impl)


# ---- fake implementations ----------------------------------------------------------------------------


@torch.library.register_fake(_lib + "fused_token_logprobs")
def _(hidden, weight, bias, token_ids, temperature=1.0, temperatures=None, token_chunk=0, vocab_chunk=0):
    _check(hidden, weight, bias, token_ids, temperatures, token_chunk, vocab_chunk)
    T = hidden.shape[0]
    return hidden.new_empty((T,), dtype=torch.float32), hidden.new_empty((T, 2), dtype=torch.float32)


@torch.library.register_fake(_lib + "fused_token_logprobs_backward")
def _(grad, hidden, weight, bias, token_ids, lse_pairs, temperature, temperatures, token_chunk, vocab_chunk,
      needs_hidden_grad, needs_weight_grad, needs_bias_grad):
    dx = hidden.new_empty(hidden.shape) if needs_hidden_grad else None
    dw = weight.new_empty(weight.shape) if needs_weight_grad else None
    db = bias.new_empty(bias.shape) if (needs_bias_grad and bias is not None) else None
    return dx, dw, db


@torch.library.register_fake(_lib + "token_logprobs_pairs")
def _(logits, token_ids, temperature=1.0, temperatures=None):
    torch._check(logits.dim() == 2, lambda: "aligned::token_logprobs_pairs: logits must be 2-D [T, V]")
    T = logits.shape[0]
    return logits.new_empty((T,), dtype=torch.float32), logits.new_empty((T, 2), dtype=torch.float32)


@torch.library.register_fake(_lib + "token_logprobs_backward_cols")
def _(grad, logits, token_ids, lse_pairs, vocab_start, vocab_size, temperature=1.0, temperatures=None):
    torch._check(logits.dim() == 2, lambda: "aligned::token_logprobs_backward_cols: logits must be 2-D [T, n]")
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# ---- autograd ----------------------------------------------------------------------------------------


def _setup(ctx, inputs, output):
    hidden, weight, bias, token_ids, temperature, temperatures, token_chunk, vocab_chunk = inputs
    refuse_temperature_grad(_OP, temperatures)
    _, pairs = output
    ctx.save_for_backward(hidden, weight, bias, token_ids, temperatures, pairs)
    ctx.args = (temperature, token_chunk, vocab_chunk)
    ctx.mark_non_differentiable(pairs)


def _backward(ctx, grad, grad_pairs):
    hidden, weight, bias, token_ids, temperatures, pairs = ctx.saved_tensors
    temperature, token_chunk, vocab_chunk = ctx.args
    if grad is None:
        grad = pairs.new_zeros((hidden.shape[0],))
    dx, dw, db = ops.fused_token_logprobs_backward(
        grad.contiguous(), hidden, weight, bias, token_ids, pairs, temperature, temperatures, token_chunk,
        vocab_chunk, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
        bias is not None and ctx.needs_input_grad[2])
    return dx, dw, db, None, None, None, None, None


torch.library.register_autograd(_lib + "fused_token_logprobs", _backward, setup_context=_setup)
register_no_backward("fused_token_logprobs_backward", "it is a backward op; double backward is not implemented")
register_no_backward("token_logprobs_backward_cols", "it is a backward op; double backward is not implemented")
register_no_backward("token_logprobs_pairs", "a piece of fused_token_logprobs, which is differentiable; for a "
                     "differentiable log-prob of given logits call token_logprobs")


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, temperature=1.0,
                         bias: torch.Tensor | None = None, token_chunk: int = 0,
                         vocab_chunk: int = 0) -> torch.Tensor:
    """fp32 ``token_logprobs(linear(hidden, weight, bias), token_ids, temperature)`` — the trainer's unfused LM
    head log-prob, bit for bit (forward and gradient wrt hidden, weight and bias) — without the ``[T, V]``
    logits. ``hidden [T, K]``, ``weight [V, K]`` (same dtype), ``token_ids [T]``; ``temperature`` a float or a
    per-token fp32 tensor ``[T]``. ``token_chunk`` rows (forward, d hidden) and ``vocab_chunk`` vocabulary rows
    (d weight) per tile; 0 picks tiles of about 48 MiB (``DEFAULT_TILE_BYTES``). Chunk sizes never change a bit
    (module docstring)."""
    t, ts = _temperature_args(_OP, temperature, hidden)
    token_chunk = checked_int(_OP, "token_chunk", token_chunk, None)  # the op names a negative one
    vocab_chunk = checked_int(_OP, "vocab_chunk", vocab_chunk, None)
    lp, _ = ops.fused_token_logprobs(hidden, weight, bias, token_ids, t, ts, token_chunk, vocab_chunk)
    return lp
