"""The moe family: fake implementations, autograd and Python wrappers of ``aligned::moe_routing`` and
``aligned::moe_experts``.

The per-token arithmetic is written once in ``csrc/common/moe.h`` (routing scores, top-k with the lower-id
tie-break, rank-order renormalisation; each expert through the linear contract, combined in fp32 in rank order
and rounded once). Both the vLLM plugin and the trainer patch call these ops, so the rollout engine and the
trainer choose the same experts and compute the same bits.

Backward is deterministic: the routing gradient is its own op with a fixed order (moe.h); the experts'
gradient is the op ``aligned::moe_experts_backward``, composed of ``aligned`` ops (linear_backward,
silu_and_mul_backward) run expert by expert in increasing id, tokens in batch order, with fp32 accumulation.
"""

from __future__ import annotations

import torch

ops = torch.ops.aligned
_lib = "aligned::"
SCORINGS = ("softmax", "sigmoid")


def _same_device(op, *tensors):
    devs = {t.device for t in tensors if t is not None}
    torch._check(len(devs) <= 1, lambda: f"aligned::{op}: all tensors must be on the same device, got {devs}")


# ---- fake implementations --------------------------------------------------------------------------------


@torch.library.register_fake(_lib + "moe_routing")
def _(router_logits, top_k, scoring="softmax", renormalize=True):
    torch._check(router_logits.dim() == 2, lambda: "aligned::moe_routing: router_logits must be 2-D [tokens, experts]")
    T, E = router_logits.shape
    torch._check(1 <= top_k <= E, lambda: f"aligned::moe_routing: top_k must be in [1, {E}], got {top_k}")
    w = router_logits.new_empty((T, top_k), dtype=torch.float32)
    ids = router_logits.new_empty((T, top_k), dtype=torch.int64)
    scores = router_logits.new_empty((T, E), dtype=torch.float32)
    return w, ids, scores


@torch.library.register_fake(_lib + "moe_routing_backward")
def _(grad_weights, grad_scores, router_logits, topk_ids, scoring, renormalize):
    _same_device("moe_routing_backward", grad_weights, grad_scores, router_logits, topk_ids)
    return torch.empty_like(router_logits, memory_format=torch.contiguous_format)


# The linear profiles the experts' projections run (moe.h; the schema's linear_profile, default first).
EXPERT_PROFILES = ("fma", "mma")


def _experts_fake(x, topk_weights, topk_ids, w13, w2, shared_w13=None, shared_w2=None, shared_gate=None,
                  linear_profile="fma"):
    _same_device("moe_experts", x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate)
    torch._check(x.dim() == 2, lambda: "aligned::moe_experts: x must be 2-D [tokens, hidden]")
    torch._check(w13.dim() == 3 and w13.shape[2] == x.shape[1], lambda: "aligned::moe_experts: w13 must be [E, 2I, H]")
    if shared_gate is not None:
        torch._check(shared_gate.dim() == 2 and shared_gate.shape[0] == 1 and shared_gate.shape[1] == x.shape[1],
                     lambda: f"aligned::moe_experts: shared_gate must be [1, {x.shape[1]}] with x's dtype, got "
                             f"{list(shared_gate.shape)}")
    torch._check(linear_profile in EXPERT_PROFILES,
                 lambda: f"aligned::moe_experts: linear_profile must be 'fma' or 'mma', got {linear_profile!r}")
    return x.new_empty(x.shape)


torch.library.register_fake(_lib + "moe_experts")(_experts_fake)
torch.library.register_fake(_lib + "_moe_experts_reference")(_experts_fake)


# ---- autograd ------------------------------------------------------------------------------------------------


def _routing_setup(ctx, inputs, output):
    router_logits, top_k, scoring, renormalize = inputs
    _, ids, _ = output
    ctx.save_for_backward(router_logits, ids)
    ctx.scoring = scoring
    ctx.renormalize = renormalize


def _routing_backward(ctx, grad_w, grad_ids, grad_scores):
    logits, ids = ctx.saved_tensors
    if grad_w is None:
        grad_w = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    gs = grad_scores.contiguous() if grad_scores is not None else None
    dz = ops.moe_routing_backward(grad_w.contiguous(), gs, logits, ids, ctx.scoring, ctx.renormalize)
    return dz, None, None, None


torch.library.register_autograd(_lib + "moe_routing", _routing_backward, setup_context=_routing_setup)


@torch.library.register_fake(_lib + "moe_grouped_routing")
def _(router_logits, correction_bias, top_k, n_group=1, topk_group=1, renormalize=True, routed_scaling_factor=1.0):
    op = "aligned::moe_grouped_routing"
    _same_device("moe_grouped_routing", router_logits, correction_bias)
    torch._check(router_logits.dim() == 2, lambda: f"{op}: router_logits must be 2-D [tokens, experts]")
    T, E = router_logits.shape
    torch._check(n_group >= 1 and E % n_group == 0,
                 lambda: f"{op}: n_group must divide the number of experts {E} (router_logits' columns), got n_group "
                         f"{n_group}")
    torch._check(1 <= topk_group <= n_group, lambda: f"{op}: topk_group must be in [1, n_group = {n_group}]")
    avail = topk_group * (E // n_group)
    torch._check(1 <= top_k <= avail, lambda: f"{op}: top_k must be in [1, {avail}] (the experts in the kept groups)")
    if correction_bias is not None:
        torch._check(correction_bias.dtype == torch.float32 and tuple(correction_bias.shape) == (E,),
                     lambda: f"{op}: correction_bias must be float32 [{E}]")
    w = router_logits.new_empty((T, top_k), dtype=torch.float32)
    ids = router_logits.new_empty((T, top_k), dtype=torch.int64)
    scores = router_logits.new_empty((T, E), dtype=torch.float32)
    return w, ids, scores


@torch.library.register_fake(_lib + "moe_grouped_routing_backward")
def _(grad_weights, grad_scores, router_logits, topk_ids, renormalize, routed_scaling_factor):
    _same_device("moe_grouped_routing_backward", grad_weights, grad_scores, router_logits, topk_ids)
    return torch.empty_like(router_logits, memory_format=torch.contiguous_format)


def _grouped_routing_setup(ctx, inputs, output):
    router_logits, _bias, _k, _ng, _tg, renormalize, scale = inputs
    _, ids, _ = output
    ctx.save_for_backward(router_logits, ids)
    ctx.renormalize = renormalize
    ctx.scale = scale


def _grouped_routing_backward(ctx, grad_w, grad_ids, grad_scores):
    """d(router_logits) per moe.h; the correction bias gets None: it only selects experts, so the weights and
    scores are piecewise constant in it (its derivative is 0 wherever it exists)."""
    logits, ids = ctx.saved_tensors
    if grad_w is None:
        grad_w = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    gs = grad_scores.contiguous() if grad_scores is not None else None
    dz = ops.moe_grouped_routing_backward(grad_w.contiguous(), gs, logits, ids, ctx.renormalize, ctx.scale)
    return dz, None, None, None, None, None, None


torch.library.register_autograd(_lib + "moe_grouped_routing", _grouped_routing_backward,
                                setup_context=_grouped_routing_setup)


def _experts_setup(ctx, inputs, output):
    x, tw, ids, w13, w2, sw13, sw2, sgate = inputs[:8]
    ctx.save_for_backward(x, tw, ids, w13, w2, sw13, sw2, sgate)
    ctx.linear_profile = inputs[8] if len(inputs) > 8 else "fma"


def _fma_mlp_forward(x, w13, w2):
    h = ops.linear(x, w13, None)
    a = ops.silu_and_mul(h)
    return h, a, ops.linear(a.float(), w2.float(), None)


def _mma_mlp_forward(x, w13, w2):
    h = ops.linear_mma(x, w13, None)
    a = ops.silu_and_mul(h)
    return h, a, ops.linear_mma_partial(a, w2, 8)  # y: the unrounded 8-lane tree, as the kernel keeps it


def _fma_gate_logit(x, sgate):
    return ops.linear(x.float(), sgate.float(), None)


def _mma_gate_logit(x, sgate):
    return ops.linear_mma_partial(x, sgate, 8)


# The schema's linear_profile values (csrc/common/moe.h) and the ops their forward's projections are: the
# backward recomputes the forward with these (h, a and y bit-identical to the kernel's), and the shared expert's
# gate logit.
_EXPERT_LINEARS = {"fma": (_fma_mlp_forward, _fma_gate_logit), "mma": (_mma_mlp_forward, _mma_gate_logit)}


def _mlp_backward(x, w13, w2, gy, profile=EXPERT_PROFILES[0]):
    """One expert MLP's backward on gathered rows x (model dtype); gy = grad of its fp32 output y.

    Returns (y fp32, dx fp32, dw13 fp32, dw2 fp32). The forward is recomputed with the same ops as the kernel
    (h = linear(x, w13) in the model dtype, a = silu_and_mul(h), y = linear in fp32 — under ``profile``: the
    ``mma`` profile's h is linear_mma, its y the unrounded linear_mma_partial over 8 lanes), so h and y are
    bit-identical to the forward's. The gradient chains are the fma profile's in fp32 for both profiles: the
    gradients reaching the experts' projections are fp32 (w_r * g), which the bf16 unit could only take rounded.
    """
    h, a, y = _EXPERT_LINEARS[profile][0](x, w13, w2)
    af, w2f = a.float(), w2.float()
    da, dw2, _ = ops.linear_backward(gy.contiguous(), af, w2f, True, True, False)
    dh = ops.silu_and_mul_backward(da.contiguous(), h.float())
    dx, dw13, _ = ops.linear_backward(dh.contiguous(), x.float(), w13.float(), True, True, False)
    return y, dx, dw13, dw2


def row_sums(v: torch.Tensor) -> torch.Tensor:
    """``[n, H]`` fp32 -> ``[n]``: each row's sum in the linear contract's order (moe.h, "experts backward": the
    8 lanes of fma chains against ones, tree-combined; contract.h), row-local — not ``torch.sum``, whose order
    depends on the thread count and on how many rows share the call once H > 32768 (it splits a lone row). Also
    the patched HF forward's entropy (``integrations.hf._entropy``)."""
    ones = torch.ones((1, v.shape[1]), dtype=torch.float32, device=v.device)
    return ops.linear(v.contiguous(), ones, None)[:, 0]


class _RowLocalSum(torch.autograd.Function):
    """:func:`row_local_sum` with the gradient of a sum (``g`` broadcast over the row: what the linear's backward
    against ones gives, bit for bit) and nothing saved: through ``ops.linear``'s autograd the [n, w] terms stayed
    alive until backward and its gradient was reshaped back from tiles, one extra fp32 copy of the input (+2.4 GB at
    [4096, 151936])."""

    @staticmethod
    def forward(ctx, x):
        n, w = x.shape
        ctx.width = w
        return row_sums(row_sums(x.reshape(-1, 64)).reshape(n, w // 64))

    @staticmethod
    def backward(ctx, g):
        return g[:, None].expand(g.shape[0], ctx.width)


def row_local_sum(x: torch.Tensor) -> torch.Tensor:
    """``[n, w]`` fp32, ``w`` a multiple of 64 -> ``[n]``: each row's sum in two row-local levels (:func:`row_sums`
    per 64-term tile, then over the tiles: short chains, accurate at any width), independent of the number of rows
    and of the threads; differentiable."""
    if x.dim() != 2 or x.shape[1] % 64 or x.dtype != torch.float32:
        raise ValueError(f"row_local_sum: x must be float32 [n, w] with w a multiple of 64, got {tuple(x.shape)} "
                         f"{x.dtype}")
    return _RowLocalSum.apply(x)


class _RowTreeSum(torch.autograd.Function):
    """:func:`row_tree_sum`, with the gradient of a sum (g broadcast) and nothing saved."""

    @staticmethod
    def forward(ctx, x):
        n, t = x.shape
        ctx.width = t
        while True:
            width = max(64, -(-x.shape[1] // 64) * 64)
            if width != x.shape[1]:
                x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
            x = row_sums(x.reshape(-1, 64)).reshape(n, width // 64)
            if width == 64:
                return x[:, 0]

    @staticmethod
    def backward(ctx, g):
        return g[:, None].expand(g.shape[0], ctx.width)


def row_tree_sum(x: torch.Tensor) -> torch.Tensor:
    """``[n, t]`` fp32, any ``t`` -> ``[n]``: each row's sum as a 64-ary tree — 64-term tiles (:func:`row_sums`),
    then 64 tile sums at a time, until one is left, each level widened with zeros to a multiple of 64. The tiles
    start at absolute positions, so zeros appended to a row (a batch padded to another width) change no bit of its
    sum (each adds an exact +0; at most the sign of a zero sum), nor do the number of rows or the threads. (The
    two-level :func:`row_local_sum` cuts its second level into 8 lanes by the number of tiles, which the width
    moves.) Differentiable."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"row_tree_sum: x must be float32 [n, t], got {tuple(x.shape)} {x.dtype}")
    return _RowTreeSum.apply(x.contiguous())


def _checked_expert_counts(op: str, ids: torch.Tensor, E: int) -> list:
    """Rows per expert ``[E]`` of int64 ``ids [T, k]``, read on the host in the one sync the backward makes, with the
    ids checked in the same read: every id in [0, E) (an id >= E would otherwise get no gradient, a negative one
    fail inside torch), and no expert twice in a token. The forward defines a repeated expert (moe.h: each rank's
    y_r is its own, combined in rank order), but its gradient would reach dx through two adds of the same row
    (index_add_, atomics on a GPU: run-dependent order), so the backward refuses it by name."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    # slot 0: ids < 0, slots 1..E: the experts, slot E+1: ids >= E; then the number of tokens with a repeated id
    binned = torch.bincount(flat.clamp(-1, E) + 1, minlength=E + 2)
    srt = ids.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1).sum().reshape(1) if k > 1 else binned.new_zeros(1)
    host = torch.cat([binned, dup.to(binned.dtype)]).tolist()
    below, above, ndup = host[0], host[E + 1], host[E + 2]
    if below or above:
        raise RuntimeError(f"aligned::{op}: topk_ids must lie in [0, {E}), got {below} id(s) < 0 and {above} id(s) "
                           f">= {E}")
    if ndup:
        raise RuntimeError(f"aligned::{op}: topk_ids must not list an expert twice in a token (its gradient would be "
                           f"summed in a run-dependent order), got {ndup} such token(s)")
    return host[1 : E + 1]


def _experts_backward_impl(grad, x, tw, ids, w13, w2, sw13=None, sw2=None, sgate=None, linear_profile="fma"):
    """CPU/any-device kernel of ``aligned::moe_experts_backward`` (experts in increasing id, tokens in order)."""
    if linear_profile not in EXPERT_PROFILES:
        raise RuntimeError(f"aligned::moe_experts_backward: linear_profile must be 'fma' or 'mma', got {linear_profile!r}")
    T, H = x.shape
    k = ids.shape[1]
    E = w13.shape[0]
    g = grad.float().contiguous()
    dx = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    dtw = torch.zeros((T, k), dtype=torch.float32, device=x.device)
    dw13 = torch.zeros(w13.shape, dtype=torch.float32, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).to(torch.int64)
    counts = _checked_expert_counts("moe_experts_backward", ids.to(torch.int64), E)
    order = torch.sort(flat, stable=True).indices  # expert-major, (token, rank) order inside an expert
    start = 0
    for e in range(E):
        n = counts[e]
        if n == 0:
            continue
        sel = order[start : start + n]
        start += n
        tok, rank = sel // k, sel % k
        wv = tw[tok, rank].float()
        gt = g.index_select(0, tok)
        y, dxe, dw13e, dw2e = _mlp_backward(x.index_select(0, tok).contiguous(), w13[e], w2[e], wv[:, None] * gt,
                                            linear_profile)
        dtw[tok, rank] = row_sums(gt * y)
        dx.index_add_(0, tok, dxe)
        dw13[e] = dw13e
        dw2[e] = dw2e
    empty = x.new_empty((0,))
    dsw13 = dsw2 = dgate = empty
    if sw13 is not None:
        if sgate is not None:
            logit = _EXPERT_LINEARS[linear_profile][1](x, sgate.reshape(1, H))  # [T, 1] fp32, the kernel's chains
            gate = 1.0 / (1.0 + ops._exp_f32(-logit))  # moe.h: moe_shared_gate
        else:
            gate = torch.ones((T, 1), dtype=torch.float32, device=x.device)
        ys, dxs, dsw13, dsw2 = _mlp_backward(x, sw13, sw2, gate * g, linear_profile)
        dx += dxs
        if sgate is not None:
            dlogit = row_sums(g * ys)[:, None] * (gate * (1.0 - gate))
            dxg, dgate, _ = ops.linear_backward(dlogit.contiguous(), x.float(), sgate.reshape(1, H).float(),
                                                True, True, False)
            dx += dxg
            dgate = dgate.reshape(sgate.shape).to(sgate.dtype)
        dsw13, dsw2 = dsw13.to(sw13.dtype), dsw2.to(sw2.dtype)
    return dx.to(x.dtype), dtw, dw13.to(w13.dtype), dw2.to(w2.dtype), dsw13, dsw2, dgate


# CPU tensors (the CPU backend, and the emulated GPUs under aligned_ops.emulate: every op it calls then runs the GPU
# kernel source) and CUDA / ROCm tensors: the ops it is composed of have GPU kernels in both profiles. It reads the
# experts' token counts on the host (one sync per call: a training step's backward, never a rollout's graph).
torch.library.register_kernel(_lib + "moe_experts_backward", ("cpu", "cuda"), _experts_backward_impl)


@torch.library.register_fake(_lib + "moe_experts_backward")
def _(grad_out, x, tw, ids, w13, w2, sw13=None, sw2=None, sgate=None, linear_profile="fma"):
    _same_device("moe_experts_backward", grad_out, x, tw, ids, w13, w2, sw13, sw2, sgate)
    empty = x.new_empty((0,))
    return (
        x.new_empty(x.shape),
        tw.new_empty(tw.shape, dtype=torch.float32),
        w13.new_empty(w13.shape),
        w2.new_empty(w2.shape),
        sw13.new_empty(sw13.shape) if sw13 is not None else empty,
        sw2.new_empty(sw2.shape) if sw2 is not None else empty,
        sgate.new_empty(sgate.shape) if sgate is not None else empty,
    )


def _experts_backward(ctx, grad):
    x, tw, ids, w13, w2, sw13, sw2, sgate = ctx.saved_tensors
    need = tuple(ctx.needs_input_grad) + (False,) * 8  # optional inputs may be absent from the tuple
    dx, dtw, dw13, dw2, dsw13, dsw2, dgate = ops.moe_experts_backward(grad.contiguous(), x, tw, ids, w13, w2, sw13,
                                                                     sw2, sgate, ctx.linear_profile)
    return (
        dx if need[0] else None,
        dtw if need[1] else None,
        None,
        dw13 if need[3] else None,
        dw2 if need[4] else None,
        dsw13 if (need[5] and sw13 is not None) else None,
        dsw2 if (need[6] and sw2 is not None) else None,
        dgate if (need[7] and sgate is not None) else None,
        None,
    )


torch.library.register_autograd(_lib + "moe_experts", _experts_backward, setup_context=_experts_setup)


# ---- Python wrappers ------------------------------------------------------------------------------------------


def moe_routing(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True):
    """Route tokens: ``(topk_weights fp32 [T, k], topk_ids int64 [T, k], scores fp32 [T, E])``.

    ``scoring``: ``"softmax"`` (Qwen/Mixtral) or ``"sigmoid"`` (DeepSeek-V3 style). Top-k ties go to the lower
    expert id; ``renormalize`` divides the k weights by their sum taken in rank order. See ``csrc/common/moe.h``.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"aligned_ops.moe_routing: scoring must be one of {SCORINGS}, got {scoring!r}")
    return ops.moe_routing(router_logits, checked_int("moe_routing", "top_k", top_k, None), scoring,
                           checked_bool("moe_routing", "renormalize", renormalize))


def moe_grouped_routing(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                        n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                        routed_scaling_factor: float = 1.0):
    """DeepSeek-V3 / Kimi-K2 routing: ``(topk_weights fp32 [T, k], topk_ids int64 [T, k], scores fp32 [T, E])``.

    Sigmoid scores of the (fp32) router logits; experts chosen on ``score + correction_bias`` (fp32 ``[E]``)
    within the ``topk_group`` best of ``n_group`` contiguous groups (group score: the sum of its two best biased
    scores); ties go to the lower index; weights from the unbiased scores, renormalised in rank order when
    ``renormalize``, times ``routed_scaling_factor`` in fp32. The bias gets no gradient. Written down in
    ``csrc/common/moe.h`` ("grouped sigmoid routing").
    """
    op = "moe_grouped_routing"
    return ops.moe_grouped_routing(router_logits, correction_bias, checked_int(op, "top_k", top_k, None),
                                   checked_int(op, "n_group", n_group, None),
                                   checked_int(op, "topk_group", topk_group, None),
                                   checked_bool(op, "renormalize", renormalize), float(routed_scaling_factor))


def moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13=None, shared_w2=None, shared_gate=None,
                linear_profile: str = "fma"):
    """``sum_r w_r * expert_{id_r}(x)`` (+ ``sigmoid(x . shared_gate) * shared_expert(x)``), fp32, rounded once.

    ``w13 [E, 2I, H]`` holds each expert's gate rows then up rows (vLLM's ``w13_weight``, HF's
    ``experts.gate_up_proj``); ``w2 [E, H, I]`` the down projections. The optional shared expert uses
    ``shared_w13 [2Is, H]``, ``shared_w2 [H, Is]`` and its gate ``shared_gate [1, H]``. ``linear_profile``: the
    projections' profile, ``fma`` or ``mma`` (bf16; the machine's matrix unit).
    """
    if linear_profile == EXPERT_PROFILES[0]:  # the schema's default: the call (and its trace) as before mma existed
        return ops.moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate)
    return ops.moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate, linear_profile)


def _check_layer_shapes(x, router_weight, w13, w2):
    """The router's experts are the experts' weights: a router with more rows than w13 / w2 have experts ran while
    no token picked a missing expert (and failed on topk_ids otherwise); one with fewer left experts unused. The
    rest (w13 against w2 and x, the shared expert) moe_experts checks by name."""
    op = "aligned_ops.moe_layer"
    if router_weight.dim() != 2:
        raise ValueError(f"{op}: router_weight must be 2-D [experts, hidden], got shape {tuple(router_weight.shape)}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{op}: w13 must be [experts, 2 * intermediate, hidden] and w2 [experts, hidden, "
                         f"intermediate], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    E = router_weight.shape[0]
    if w13.shape[0] != E or w2.shape[0] != E:
        raise ValueError(f"{op}: router_weight has {E} experts (rows) but w13 has {w13.shape[0]} and w2 "
                         f"{w2.shape[0]} (their first dimension): the router must score exactly the experts given")
    if x.dim() >= 1 and router_weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: router_weight must be [{E}, {x.shape[-1]}] (x's hidden size), got "
                         f"{tuple(router_weight.shape)}")


def moe_layer(x, router_weight, w13, w2, top_k, scoring="softmax", renormalize=True, shared_w13=None,
              shared_w2=None, shared_gate=None, return_routing=False):
    """A whole routed MoE block: router linear (``aligned::linear``, model dtype) -> routing -> experts.

    With ``return_routing`` also returns ``(router_logits, topk_weights, topk_ids, scores)``.
    """
    _check_layer_shapes(x, router_weight, w13, w2)
    logits = ops.linear(x, router_weight, None)
    w, ids, scores = moe_routing(logits, top_k, scoring, renormalize)
    out = moe_experts(x, w, ids, w13, w2, shared_w13, shared_w2, shared_gate)
    if return_routing:
        return out, (logits, w, ids, scores)
    return out


from ._registry import checked_bool, checked_int, register_no_backward  # noqa: E402

for _name in ("moe_routing_backward", "moe_experts_backward", "moe_grouped_routing_backward"):
    register_no_backward(_name, "it is a backward op; double backward is not implemented")
register_no_backward("_moe_experts_reference", "a test hook: the per-token scalar model of the moe contract")
