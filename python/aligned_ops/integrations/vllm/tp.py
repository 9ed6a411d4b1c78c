"""Tensor parallelism (TP = 1, 2, 4, 8): the row-parallel layers' profile route, the vocab-parallel embedding's
exact copy, and the guard on vLLM's own all-reduce.

Column-parallel layers (QKV, gate_up), the attention heads and the LM head's vocab shards compute whole
output elements over the full K: already exact. Row-parallel layers (o_proj, down_proj) hold 1/t of K: they run
their engine profile's ``row_parallel_linear`` (:mod:`aligned_ops.profiles`) — ``fma``: each rank's 8/t-lane
sub-tree (``aligned::linear_partial``) finished by ``aligned_ops.ops.collective.tree_all_reduce``, bias once
after; ``exact``: integer partials over the full rows' canonical forms, an exact int64 all-reduce SUM, one
rounding (docs/exact_linear.md, "TP"; eager mode only, refused by name in a traced forward). The vocab-parallel
embedding's ranks own disjoint rows: the others contribute -0.0 (x + -0.0 == x for every x, -0.0 included),
so the sum is an exact copy. vLLM-CPU's shared-memory all-reduce is never reached from these layers (a stock TP
all-reduce of floating data raises while the plugin is installed, so nothing can bypass this silently).
"""

from __future__ import annotations

import torch

import aligned_ops
import aligned_ops.ops.collective

from ... import profiles
from ...profiles import profile_of
from . import compat, patches

TP_COMBINE_ENV = "ALIGNED_OPS_TP_COMBINE"  # "sequential", "fma", "moe-late": NEGATIVE CONTROLS ONLY (break the contract)
# "tree": each layer's own profile route; "sequential": the lane sums left to right; a profile name: that
# profile's route whatever the layer's profile (the route the exact profile took at TP > 1 before it had its own).
# "moe-late": the row-parallel linears keep the tree; the MoE blocks weight and sum each rank's partial experts into
# an output in the model dtype and then add the ranks' outputs (the order of vLLM's fused-MoE all-reduce).
TP_COMBINES = ("tree", "sequential", profiles.FMA.name, "moe-late")
_tp_combine = "tree"
_tp_forced_profile: profiles.Profile | None = None


def _warn_negative_control(mode):
    if mode != "tree":
        import warnings

        warnings.warn(f"aligned_ops vLLM plugin: row-parallel combine {mode!r} is a NEGATIVE CONTROL: it breaks the "
                      "contract (and overrides the exact profile's integer route); log-probs will differ from the "
                      "trainer's", RuntimeWarning, stacklevel=3)


def set_combine(mode: str) -> str:
    """This process's row-parallel combine (see :data:`TP_COMBINES`); checked, warned about when not "tree"."""
    global _tp_combine, _tp_forced_profile
    if mode not in TP_COMBINES:
        raise ValueError(f"tp combine must be one of {TP_COMBINES}, got {mode!r}")
    _warn_negative_control(mode)
    _tp_combine = mode
    _tp_forced_profile = profiles.get(mode) if mode in profiles.REGISTRY else None
    return mode


def moe_combine() -> str:
    """The MoE experts' cross-rank combine of this process (collective.MOE_COMBINES): "late" only under the
    "moe-late" negative control."""
    return "late" if _tp_combine == "moe-late" else "tree"


def combine_from_env() -> str:
    import os

    combine = os.environ.get(TP_COMBINE_ENV, "tree").strip().lower() or "tree"
    if combine not in TP_COMBINES:
        raise ValueError(f"{TP_COMBINE_ENV} must be one of {TP_COMBINES}, got {combine!r}")
    return combine


def _set_tp_combine_in_worker(worker, mode):
    return set_combine(mode)


def set_tp_combine(llm, mode: str) -> None:
    """NEGATIVE CONTROLS ONLY: switch a running engine's row-parallel combine ("tree", "sequential" or "fma")
    in every worker. "sequential" adds the same 8 lane sums left to right, which breaks the contract (tests show
    the log-probs then differ from the trainer's); "moe-late" keeps the linears' tree and combines the MoE
    blocks' experts in vLLM's order (each rank's weighted sum rounded to the model dtype, then the ranks' sum); "fma" runs the fma profile's tree whatever the layer's profile
    (the route the exact profile took at TP > 1 before it had its own: its log-probs differ from an exact
    trainer's). "tree": the layer's profile's own route (fma: the tree; exact: integer partials)."""
    llm.collective_rpc(_set_tp_combine_in_worker, args=(mode,))


def _tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group()


def _sequential_lane_combine(x, weight, group_coordinator, profile=None):
    """Negative control: the same lane sums (the layer's profile's: the mma unit's chains under ``mma``, else the
    fma chains) combined left to right (((l0+l1)+l2)+...) instead of the tree."""
    t = group_coordinator.world_size
    k = weight.shape[-1]
    lanes = aligned_ops.ops.collective.LINEAR_LANES // t
    lane_sum = aligned_ops.linear_mma_partial if profile is profiles.MMA else aligned_ops.linear_partial
    sums = []
    for j in range(lanes):
        lo, hi = (j * k) // lanes, ((j + 1) * k) // lanes
        sums.append(lane_sum(x[..., lo:hi].contiguous(), weight[:, lo:hi].contiguous(), 1))
    local = torch.stack(sums)
    gathered = [torch.empty_like(local) for _ in range(t)]
    torch.distributed.all_gather(gathered, local, group=group_coordinator.device_group)
    all_lanes = [s for g in gathered for s in g]
    acc = all_lanes[0]
    for s in all_lanes[1:]:
        acc = acc + s
    return acc


def check_row_parallel_profile(layer, tp_size: int) -> profiles.Profile:
    """The linear profile a row-parallel layer runs at ``tp_size`` (the profile it carries, as every other linear
    hook); refuses a combination without a cross-rank route that can run here (so no layer can silently run
    another profile than the trainer): e.g. the exact profile's TP route inside a compiled (traced) forward.
    The engine's start-up validation refuses the same combinations (``config.validate_vllm_config``)."""
    profile = profile_of(layer)
    if tp_size > 1 and not profile.capabilities.tp_traceable and torch.compiler.is_compiling():
        raise NotImplementedError(
            f"aligned_ops vLLM plugin: the {profile.name!r} linear profile ({profiles.ENV_VAR}={profile.name}) at "
            f"tensor parallelism {tp_size} runs its row-parallel layers ({type(layer).__name__}) in eager mode only "
            f"(its weight packing and integer all-reduces are not traced): start the engine with enforce_eager=True, "
            f"or use tensor_parallel_size=1, or {profiles.ENV_VAR}={profiles.DEFAULT.name} on both sides.")
    return profile


def _row_parallel_forward(self, input_):
    if self.tp_size == 1:
        return self._aligned_base.forward(self, input_)
    profile = check_row_parallel_profile(self, self.tp_size)
    if not self.reduce_results:
        raise NotImplementedError("aligned_ops: a row-parallel layer without reduce_results is not supported")
    if not self.input_is_parallel:
        from vllm.distributed import split_tensor_along_last_dim

        input_ = split_tensor_along_last_dim(input_, num_partitions=self.tp_size)[self.tp_rank].contiguous()
    group = _tp_group()
    bias = None if self.skip_bias_add else self.bias
    if _tp_combine == "sequential":  # ("moe-late" leaves the linears on their profile's route)
        out = _sequential_lane_combine(input_, self.weight, group, profile)
        if bias is not None:
            out = out + bias.to(torch.float32)
        out = out.to(input_.dtype)
    else:
        if _tp_forced_profile is not None:
            profile = _tp_forced_profile  # negative control only
        # check=False: the engine's ranks hold one configured model's shards, so they agree by construction; the
        # agreement all-gather would cost a collective per layer and is data-dependent (no compiled graph)
        out = profile.row_parallel_linear(input_, self.weight, bias, group.device_group, in_features=self.input_size,
                                          check=False)
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)


def _vocab_embedding_forward(self, input_):
    if self.tp_size == 1:
        return self._aligned_base.forward(self, input_)
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask

    si = self.shard_indices
    masked_input, not_owned = get_masked_input_and_mask(
        input_, si.org_vocab_start_index, si.org_vocab_end_index, si.num_org_vocab_padding,
        si.added_vocab_start_index, si.added_vocab_end_index)
    local = self.quant_method.embedding(self, masked_input.long())
    reduce_results, parallel_group = compat.vocab_embedding_reduction(self)
    if not reduce_results:
        return local.masked_fill(not_owned.unsqueeze(-1), 0)
    group = parallel_group if parallel_group is not None else _tp_group()
    return aligned_ops.ops.collective.sharded_rows_all_reduce(local, not_owned, group.device_group,
                                                              check=False)  # as above


def _stock_all_reduce(self, input_):
    if (self.world_size > 1 and self.unique_name.startswith("tp") and isinstance(input_, torch.Tensor)
            and input_.is_floating_point()):
        raise RuntimeError(
            "aligned_ops vLLM plugin: a stock tensor-parallel all-reduce (vLLM's shared-memory/NCCL SUM, not "
            "the 8-lane tree) was reached from a layer the plugin does not cover"
        )
    from vllm.distributed.parallel_state import GroupCoordinator

    return patches.original(GroupCoordinator, "all_reduce")(self, input_)


def oot_hooks() -> dict:
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return {
        RowParallelLinear: dict(forward=_row_parallel_forward),            # PluggableLayer (TP route)
        VocabParallelEmbedding: dict(forward=_vocab_embedding_forward),    # PluggableLayer (TP exact copy)
    }


def install(combine: str) -> None:
    from vllm.distributed.parallel_state import GroupCoordinator

    set_combine(combine)
    patches.patch(GroupCoordinator, "all_reduce", _stock_all_reduce,
                  "not a layer: the stock TP all-reduce guard")
