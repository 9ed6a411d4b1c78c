"""Numerics profiles as objects: what a matrix product computes, and everything that follows from that choice.

A *profile* names how every matrix product of a model is computed (DEVELOPERS.md, "The contract"). It is one
object that carries, together:

- ``linear(x, weight, bias)`` — the op itself (forward; autograd is registered on the op);
- ``row_parallel_linear(...)`` — its tensor-parallel route for a row-parallel layer (o_proj, down_proj: each rank
  holds a slice of K), which must give the single-device bits;
- ``fused_token_logprobs(...)`` — the LM head's fused log-prob, where the profile has one;
- ``backward`` — how its gradient is computed (a sentence; the formula is registered on the op);
- ``capabilities`` — where it runs (devices, TP degrees, compiled mode, CUDA graphs), checked once by
  :meth:`Profile.refusals` when a model is patched or an engine is configured; what the model and the machine
  must have (a dtype, a matrix unit): :meth:`Profile.model_refusals`;
- ``moe_experts(...)`` — the MoE experts' projections under the profile (``fma`` chains unless it has its own);
  ``row_parallel_moe_experts(...)`` the same at TP > 1 (each rank an I slice of every expert);
- ``attention_profile(device)`` — the attention it runs there (``"fma"`` / ``"mma"``: mma attention on a GPU under
  the ``mma`` profile, fma on a plain CPU, which has no mma attention), decided once per engine layer / trainer
  forward and passed to every ``attention_varlen`` / ``paged_attention`` call; ``attention_description()`` says it;
- ``invariant_to`` — what its bits do not depend on (the start-up log and the README print it);
- ``op`` — the aligned op its linears run (the name a traced forward shows; ``aligned_ops.model_spec`` steps).

Resolution, once. ``ALIGNED_OPS_LINEAR`` is the user's switch; :func:`resolve` reads it (unless a profile is
given explicitly or an architecture's rules pin one) and returns the object. The trainer patch resolves once
per model (``hf.patch_model(model, profile=None)``), the vLLM plugin once per engine (when the engine config is
created; the name travels to every worker in ``vllm_config.additional_config``). Every patched layer then
*carries* its profile (``layer._aligned_profile``, read by :func:`profile_of`): no hot path reads the
environment or compares a profile name. Code outside this module never compares profile names: it calls the
object, reads a capability, or compares objects (``profile is FMA``).

Adding a profile (as the ``mma`` profile, issue 27, is added below): subclass :class:`Profile`, implement ``linear`` and
``row_parallel_linear`` (and ``fused_token_logprobs`` if it has a fused head), state ``capabilities``,
``invariant_to``, ``backward`` and ``op``, and add one instance to :data:`REGISTRY` below (``register(...)``).
Nothing else in the package names profiles: ``aligned-ops verify --linear NAME``, the plugin's start-up check,
the trainer patch and the spec pick it up from the registry. A profile that cannot run somewhere says so in its
capabilities (or overrides ``refusals``), and the model patch / engine start refuses with its reasons.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .ops import collective
from .ops import linear as _fma
from .ops import linear_exact as _exact
from .ops import linear_mma as _mma
from .ops import lm_head as _lm_head

from .choices import PROFILE_ENV_VAR as ENV_VAR  # torch-free names: aligned_ops.choices


@dataclass(frozen=True)
class Capabilities:
    """Where a profile runs. Checked by :meth:`Profile.refusals` at model patch / engine start, never per call."""

    devices: tuple[str, ...]        # device types its linear runs on ("cuda" also covers ROCm builds of torch)
    tp_degrees: tuple[int, ...]     # tensor-parallel degrees its row-parallel route serves
    tp_devices: tuple[str, ...]     # device types its row-parallel route (TP > 1) runs on
    tp_traceable: bool              # that route inside a traced forward (torch.compile / vLLM compiled mode)
    compile: bool                   # its linear inside torch.compile(fullgraph=True)
    cuda_graphs: bool               # its linear inside a captured CUDA graph (no host read, nothing re-planned)
    fused_lm_head: bool             # aligned_ops.fused_token_logprobs computes its LM head


class Profile:
    """One numerics profile (see the module docstring). Instances are singletons held by :data:`REGISTRY`;
    compare them with ``is``."""

    name: str
    op: str
    capabilities: Capabilities
    invariant_to: str
    backward: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def row_parallel_linear(self, x, weight, bias=None, group=None, *, in_features=None,
                            algorithm: str = "auto", check: bool = True) -> torch.Tensor:
        """Rank r holds ``x[..., K_r]`` and ``weight[:, K_r]``; every rank returns ``linear(x, weight, bias)``.
        ``check``: the ranks first agree on shapes and dtypes (one small all-gather) and all raise together."""
        raise NotImplementedError

    def fused_token_logprobs(self, hidden, weight, token_ids, temperature=1.0, bias=None, **chunks):
        raise ValueError(f"aligned_ops: the {self.name!r} linear profile has no fused LM-head log-prob")

    def moe_experts(self, x, topk_weights, topk_ids, w13, w2, shared_w13=None, shared_w2=None, shared_gate=None):
        """The routed experts (+ shared expert) of a MoE block, their projections under this profile. The base:
        the ``fma`` chains (``exact`` has no expert kernel: its experts run, on both sides, the fma profile's)."""
        return _moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate)

    # the experts' profile of moe_experts (ops/moe.py EXPERT_PROFILES); exact has none: its experts run fma's
    experts_profile = "fma"

    def row_parallel_moe_experts(self, x, topk_weights, topk_ids, w13, w2, shared_w13=None, shared_w2=None,
                                 shared_gate=None, group=None, *, combine="tree", check=True,
                                 intermediate_size=None, shared_intermediate_size=None):
        """:meth:`moe_experts` of a tensor-parallel MoE block (each rank holds every expert's I slice), the
        single-device bits at every TP degree (``aligned_ops.ops.collective.row_parallel_moe_experts``; the
        model's whole ``intermediate_size`` / ``shared_intermediate_size`` are checked against the slices)."""
        return collective.row_parallel_moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2,
                                                   shared_gate, group, linear_profile=self.experts_profile,
                                                   combine=combine, check=check, intermediate_size=intermediate_size,
                                                   shared_intermediate_size=shared_intermediate_size)

    def cpu_unit(self) -> str | None:
        """The CPU unit whose bits this profile's linears are in this process (None: the same bits on every CPU).
        Two processes meant to agree bit for bit (the async runner's learner and workers) compare it."""
        return None

    def model_refusals(self, dtype, device: str = "cpu") -> list[str]:
        """Why a model of ``dtype`` cannot run this profile on this machine's ``device`` type (empty: it can): what
        the profile's unit multiplies, and whether the machine has that unit. Checked at start-up by the trainer patch, the
        vLLM plugin (through :meth:`refusals`) and ``aligned-ops verify``. The base profiles take any dtype."""
        return []

    def refusals(self, *, device: str = "cpu", tp_size: int = 1, compiled: bool = False,
                 cuda_graphs: bool = False, dtype=None) -> list[str]:
        """Why this profile cannot serve the given setting (empty: it can). One sentence per reason. ``dtype``
        (the model's, when known) adds :meth:`model_refusals`."""
        c, out = self.capabilities, []
        if device not in c.devices:
            out.append(f"the {self.name!r} linear profile does not run on {device} (it runs on "
                       f"{', '.join(c.devices)})")
        if tp_size > 1:
            if tp_size not in c.tp_degrees:
                out.append(f"the {self.name!r} linear profile serves tensor_parallel_size "
                           f"{', '.join(map(str, c.tp_degrees))}, not {tp_size}")
            if device not in c.tp_devices:
                out.append(f"the {self.name!r} linear profile's tensor-parallel route runs on "
                           f"{', '.join(c.tp_devices)} only, not {device}")
            if compiled and not c.tp_traceable:
                out.append(f"the {self.name!r} linear profile at tensor parallelism {tp_size} runs its row-parallel "
                           "layers in eager mode only: use enforce_eager=True, tensor_parallel_size=1, or "
                           f"{ENV_VAR}={DEFAULT.name} on both sides")
        if compiled and not c.compile:
            out.append(f"the {self.name!r} linear profile does not run under torch.compile")
        if cuda_graphs and not c.cuda_graphs:
            out.append(f"the {self.name!r} linear profile cannot run inside a captured CUDA graph: use "
                       "enforce_eager=True")
        if dtype is not None:
            out.extend(r for r in self.model_refusals(dtype) if r not in out)
        return out

    # True: the profile runs the mma attention (aligned_ops.attention_varlen / paged_attention profile="mma")
    # where its kernel runs; False: fma attention everywhere (see attention_profile)
    mma_attention = False

    def attention_profile(self, device, mla: bool = False) -> str:
        """The attention profile (``"fma"`` or ``"mma"``) a model of this linear profile runs on ``device`` (a
        ``torch.device`` or device type), decided once per engine step / trainer forward by the caller, never per
        layer. ``fma`` and ``exact`` linears run ``fma`` attention everywhere. ``mma`` runs ``mma`` attention where
        the mma attention kernel runs — a CUDA/ROCm device, or CPU tensors under an active
        :func:`aligned_ops.emulate` scope (the emulated GPU runs them, as it runs ``linear_mma``) — and ``fma``
        attention on a plain CPU: the CPU has no mma attention (its mma profile covers linear, LM head and MoE
        experts), and rollout and trainer on one CPU both run fma attention, so they still agree bit for bit.
        ``mla``: an MLA architecture (DeepSeek-V3 style: its expanded form's attention and the latent op) runs ``fma``
        attention under every profile on both sides — no mma MLA kernel is built yet."""
        if not self.mma_attention or mla:
            return FMA.name
        kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
        if kind == "cuda":
            return MMA.name
        if kind == "cpu":
            from .emulation import active  # the dispatch's own test: CPU tensors go to the emulated GPU in scope

            return MMA.name if active() is not None else FMA.name
        return FMA.name

    def attention_description(self) -> str:
        """Which attention a model of this profile runs (the start-up log and the description say it)."""
        if not self.mma_attention:
            return "attention: the fma profile's (aligned_ops.attention_varlen / paged_attention, profile='fma')."
        return (f"attention: profile={MMA.name!r} on a GPU (CUDA/ROCm, and the emulated GPUs), "
                "QK^T and PV on the unit (csrc/common/attention_mma.h); profile='fma' on a plain CPU (the CPU has no "
                "mma attention; rollout and trainer there both run fma attention, so they still agree). MLA "
                "attention (DeepSeek) runs fma under every profile (no mma MLA kernel yet).")

    def describe(self) -> str:
        """One paragraph for a start-up log or a README table."""
        return (f"linear profile {self.name!r} ({self.op}): invariant to {self.invariant_to} Backward: {self.backward} "
                f"{self.attention_description()}")

    def __repr__(self) -> str:
        return f"<aligned_ops linear profile {self.name!r}>"

    # A profile is a registered singleton: copies (deepcopy of a patched model) and pickles (a worker process)
    # are the registered object itself, so ``is`` comparisons hold everywhere.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (get, (self.name,))


class FmaProfile(Profile):
    """``fma``: portable fp32 chains (8 lanes of K, a fixed tree, one rounding; csrc/common/contract.h)."""

    name = "fma"
    op = "linear"
    capabilities = Capabilities(devices=("cpu", "cuda"), tp_degrees=collective.TP_DEGREES,
                                tp_devices=("cpu", "cuda"), tp_traceable=True, compile=True, cuda_graphs=True,
                                fused_lm_head=True)
    invariant_to = ("the batch (size, a row's position, the other rows), chunking, prefill vs decode, thread count, "
                    "CPU ISA level, the run, the tensor-parallel degree 1, 2, 4 or 8 (each rank computes whole "
                    "lanes of the 8-lane tree; aligned_ops.tree_all_reduce finishes it), and the device: the same "
                    "fp32 chains on CPU, CUDA and HIP (tested: CPU = the emulated GPUs; a real GPU is checked by "
                    ".ci/gpu_check.sh).")
    backward = ("aligned::linear_backward: dx one fp32 chain over N, dW one chain over the tokens in batch order "
                "(deterministic, batch-composition-dependent for dW like any sum over the batch).")

    def linear(self, x, weight, bias=None):
        return _fma.linear(x, weight, bias)

    def row_parallel_linear(self, x, weight, bias=None, group=None, *, in_features=None, algorithm="auto",
                            check=True):
        # each rank's 8/t-lane sub-tree (linear_partial), finished by the tree all-reduce; bias once, one rounding
        return collective.row_parallel_linear(x, weight, bias, group, in_features=in_features, algorithm=algorithm,
                                              check=check)

    def fused_token_logprobs(self, hidden, weight, token_ids, temperature=1.0, bias=None, **chunks):
        return _lm_head.fused_token_logprobs(hidden, weight, token_ids, temperature, bias=bias, **chunks)


class ExactProfile(Profile):
    """``exact``: every output the exact integer dot product of the inputs' canonical fixed-point forms, rounded
    once (csrc/common/exact_linear.h, docs/exact_linear.md)."""

    name = "exact"
    op = "linear_exact"
    capabilities = Capabilities(devices=("cpu", "cuda"), tp_degrees=collective.TP_DEGREES, tp_devices=("cpu",),
                                tp_traceable=False, compile=True, cuda_graphs=False, fused_lm_head=False)
    invariant_to = ("everything fma is invariant to, and also how K is cut (any split, uneven tensor-parallel "
                    "slices included) and which instruction computes it (AMX-INT8, AVX512-VNNI, AVX2, generic; the "
                    "GPU kernels, tested under emulation): the same bits everywhere. Slow; its bits are not fma's.")
    backward = ("the fma profile's aligned::linear_backward (rollouts never need backward bits; the trainer's "
                "forward still runs the exact kernel, so its log-probs match the engine's).")

    def linear(self, x, weight, bias=None):
        return _exact.linear_exact(x, weight, bias)

    def row_parallel_linear(self, x, weight, bias=None, group=None, *, in_features=None, algorithm="auto",
                            check=True):
        # integer partials over the full rows' canonical forms, an exact int64 all-reduce, one rounding
        return collective.exact_row_parallel_linear(x, weight, bias, group, in_features=in_features, check=check)


class MmaProfile(Profile):
    """``mma``: the machine's bf16 matrix instruction in the ``fma`` profile's 8 lanes and tree, + bias once, one
    rounding (csrc/common/mma.h; on the CPU AMX-BF16 ``tdpbf16ps`` or AVX512-BF16 ``vdpbf16ps``, on a GPU ``mma.sync`` m16n8k16 / MFMA
    16x16x16 bf16 in k-blocks of 16, csrc/gpu/mma_linear_kernels.cuh). Same bits on one unit for rollout and
    trainer — not equal to ``fma``'s, nor across units (CPU vs GPU, GPU vendors or generations)."""

    name = "mma"
    op = "linear_mma"
    capabilities = Capabilities(devices=("cpu", "cuda"), tp_degrees=collective.TP_DEGREES, tp_devices=("cpu", "cuda"),
                                tp_traceable=True, compile=True, cuda_graphs=False, fused_lm_head=False)
    invariant_to = ("the batch (size, a row's position, the other rows), chunking, prefill vs decode, thread count, "
                    "the M/N tiling, the run, and the tensor-parallel degree 1, 2, 4 or 8 (the fma profile's 8 lanes "
                    "and tree; each lane one chain of the unit's instruction) — on one unit: the CPU's AMX-BF16 "
                    "tdpbf16ps (the amx level: one AMX CPU model) or AVX512-BF16 vdpbf16ps (one semantics on Intel "
                    "and AMD, csrc/common/mma.h; ALIGNED_CPU_ISA=avx512 picks it on an AMX CPU), or ONE GPU model "
                    "and build (the "
                    "arch's bf16 matrix instruction: mma.sync m16n8k16 on NVIDIA sm_80+, MFMA 16x16x16 bf16 on "
                    "CDNA3/4; tested under emulation with MMA-Sim's models, not yet on hardware). Not across GPU "
                    "vendors or generations, not the CPU's bits, not the fma or exact bits. bfloat16 models only.")
    backward = ("aligned::linear_mma_backward on the unit: dx the profile's 8-lane linear over N, dW over the tokens "
                "in order (8 fixed token blocks), db fp32 column chains (deterministic; dW follows the batch "
                "composition like any sum over the batch).")

    def cpu_unit(self) -> str | None:
        """``amx_bf16`` or ``avx512_bf16``: chosen per process by the CPU kernel level, and the bits are its own."""
        return _mma.mma_unit()

    def describe(self) -> str:
        """The profile's paragraph, and which CPU unit this process runs it on (the bits are that unit's)."""
        unit = self.cpu_unit()
        return super().describe() + (f" This process's CPU unit: {unit}." if unit else "")

    def linear(self, x, weight, bias=None):
        return _mma.linear_mma(x, weight, bias)

    def row_parallel_linear(self, x, weight, bias=None, group=None, *, in_features=None, algorithm="auto",
                            check=True):
        # the fma route's slices, tree all-reduce and epilogue; each rank's lanes on the unit
        return collective.row_parallel_linear(x, weight, bias, group, in_features=in_features, algorithm=algorithm,
                                              check=check, sub_tree=_mma.linear_mma_partial)

    def moe_experts(self, x, topk_weights, topk_ids, w13, w2, shared_w13=None, shared_w2=None, shared_gate=None):
        return _moe_experts(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate,
                            linear_profile=self.name)

    experts_profile = "mma"
    mma_attention = True  # attention_profile: "mma" on a GPU (and the emulated GPUs), "fma" on a plain CPU

    def model_refusals(self, dtype, device: str = "cpu") -> list[str]:
        return _mma.mma_model_reasons(dtype, device)

    def refusals(self, *, device="cpu", tp_size=1, compiled=False, cuda_graphs=False, dtype=None):
        out = super().refusals(device=device, tp_size=tp_size, compiled=compiled, cuda_graphs=cuda_graphs)
        if device != "cpu":  # the GPU kernels must be in this build (said in the profile's own words)
            refusal = _mma.gpu_refusal(device)
            if refusal is not None:
                out.insert(0, refusal)
        if dtype is not None:
            out.extend(r for r in self.model_refusals(dtype, device) if r not in out)
        return out


def _moe_experts(*args, **kwargs):
    from .ops.moe import moe_experts  # the moe family's wrapper (imported here: ops.moe needs no profile)

    return moe_experts(*args, **kwargs)


FMA = FmaProfile()
EXACT = ExactProfile()
MMA = MmaProfile()
DEFAULT = FMA  # what an unset ALIGNED_OPS_LINEAR selects

# The registry: every profile the package offers, by name. The one list (the `mma` profile is added here).
REGISTRY: dict[str, Profile] = {}


def register(profile: Profile) -> Profile:
    """Offer ``profile`` under ``profile.name`` (resolution, ``aligned-ops verify --linear``, the plugin)."""
    if profile.name in REGISTRY and REGISTRY[profile.name] is not profile:
        raise ValueError(f"aligned_ops.profiles: a profile named {profile.name!r} is already registered")
    REGISTRY[profile.name] = profile
    return profile


for _p in (FMA, EXACT, MMA):
    register(_p)


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(profile: str | Profile, what: str = "linear profile") -> Profile:
    """The registered profile named ``profile`` (a :class:`Profile` is returned as is)."""
    if isinstance(profile, Profile):
        return profile
    key = str(profile).strip().lower()
    try:
        return REGISTRY[key]
    except KeyError:
        raise ValueError(f"{what} must be one of {names()}, got {profile!r}") from None


def from_env() -> Profile:
    """The profile ``ALIGNED_OPS_LINEAR`` names (``fma`` when unset or empty), read now."""
    return get(os.environ.get(ENV_VAR, "").strip() or DEFAULT.name, ENV_VAR)


def resolve(requested: str | Profile | None = None, pinned: str | Profile | None = None) -> Profile:
    """The profile a model or an engine runs, decided once: ``pinned`` (an architecture's rules name one) wins,
    then ``requested`` (an explicit argument), then ``ALIGNED_OPS_LINEAR``."""
    if pinned is not None:
        pin = get(pinned, "LayerRules.linear_profile")
        if requested is not None and get(requested) is not pin:
            raise ValueError(f"aligned_ops: profile {get(requested).name!r} was asked for, but this architecture's "
                             f"rules pin the linear profile to {pin.name!r}")
        return pin
    if requested is not None:
        return get(requested)
    return from_env()


def profile_of(layer) -> Profile:
    """The profile a patched layer carries (bound when the trainer patch or the vLLM engine built it). A layer
    built outside both (a stand-in, a layer made by hand) is bound now, from ``ALIGNED_OPS_LINEAR``, once."""
    p = getattr(layer, "_aligned_profile", None)
    if p is None:
        p = from_env()
        try:
            layer._aligned_profile = p
        except AttributeError:  # pragma: no cover - an object that takes no attributes: resolved per call
            pass
    return p


# ---- the process-level convenience API (aligned_ops.linear_profile / profile_linear) -------------------------


def linear_profile() -> str:
    """The name of the profile ``ALIGNED_OPS_LINEAR`` selects now (``fma`` when unset)."""
    return from_env().name


def profile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The aligned linear of the profile ``ALIGNED_OPS_LINEAR`` selects now (reads the variable per call: for
    scripts; models carry their resolved profile instead)."""
    return from_env().linear(x, weight, bias)


def row_parallel_linear(x, weight, bias=None, group=None, *, in_features=None, algorithm: str = "auto",
                        profile: str | Profile | None = None, check: bool = True) -> torch.Tensor:
    """A row-parallel aligned linear of ``profile`` (a name or object; None: ``ALIGNED_OPS_LINEAR`` now): rank r
    holds ``x[..., K_r]`` and ``weight[:, K_r]``; every rank returns the full single-device linear of that
    profile, bit for bit (``fma``: :func:`aligned_ops.ops.collective.row_parallel_linear`, the 8-lane tree;
    ``exact``: :func:`aligned_ops.ops.collective.exact_row_parallel_linear`, integer partials; ``mma``: the fma
    route over ``linear_mma_partial``)."""
    return resolve(profile).row_parallel_linear(x, weight, bias, group, in_features=in_features, algorithm=algorithm,
                                                check=check)
