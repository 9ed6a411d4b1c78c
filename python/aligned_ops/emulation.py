"""``aligned_ops.emulate(arch)``: run the GPU kernel source on CPU tensors, in CI, without a GPU.

Inside ``with aligned_ops.emulate("sm_90") as emu:`` every ``torch.ops.aligned`` op that has a GPU
implementation runs, on CPU tensors, the GPU glue (the op's one glue body, csrc/torch/glue/, instantiated for the
emulated GPU backend, csrc/torch/backends/emulated.h: the same argument checks and
params) and the csrc/gpu kernels compiled for the host and executed by our SIMT runtime (csrc/emu): GPU
threads as fibers, ``__shared__`` memory per block, ``__syncthreads``, warp shuffles and votes with the
arch's warp width (32 for sm_90 / sm_100, which run the CUDA spelling of csrc/gpu/compat.cuh; 64 for
gfx942 / gfx950, which run the HIP spelling on wave64). Ops without GPU kernels (the MoE and exact-linear
families today) keep running the CPU backend. ``emu.launches`` lists every kernel launch of the block (kernel, arch, grid, block,
dynamic shared bytes), so a test can prove that the GPU source ran. Emulation is process-wide (autograd's
threads see it too); scopes nest.

The integer matrix instructions of the exact linear are emulated (CUDA ``mma.sync`` m16n8k32 s8, HIP
``v_mfma_i32_16x16x32_i8``): integer MMA is exact, so the model is the definition; what it checks is the
vendors' fragment layouts (csrc/gpu/int_mma.cuh, csrc/emu/runtime.cpp). The bf16 matrix instructions of the
``mma`` linear (CUDA ``mma.sync`` m16n8k16 bf16, HIP ``v_mfma_f32_16x16x16_bf16``; csrc/gpu/bf16_mma.cuh) are
emulated with a SELECTABLE arithmetic model, ``emulate(arch, mma_model=...)``, one of :data:`MMA_MODELS`
(csrc/emu/bf16_mma_models.h): ``"mmasim"`` (the default) follows MMA-Sim's published characterisation of the
arch's unit (sm_80: two fused k8 steps, 24 bits; sm_90/100/120: one fused k16 step, 25 bits, round toward zero;
gfx942: two groups of 8, CDNA3's truncate/floor/round-to-nearest; gfx950: CDNA3's, an assumption — MMA-Sim has no
CDNA4 model); ``"fma_chain"`` is deliberately different (16 sequential fp32 fmas per instruction, k ascending):
it rounds after every product, so a kernel whose k-block order or K split follows M gives other bits under it.
Neither is measured on hardware here; ``emu.matrix_model`` describes what the scope runs: the arch's instructions
under the scope's model (the arch's MMA-Sim characterisation, or the fma chain).

Schedules: a GPU runs the threads of a block, its warps and the blocks of a grid in no promised order. The
runtime's order is ``ALIGNED_EMU_SCHEDULE`` (read at every launch): ``forward`` (index order, the default),
``reverse``, or ``random:SEED``; ``emulate(arch, schedule=...)`` sets it for the scope. A correct kernel gives
the same bits under every schedule; a missing ``__syncthreads`` / ``__syncwarp`` gives stale reads under
``reverse`` and ``random`` that index order hides (csrc/emu/runtime.cpp). The runtime also pins the IEEE default
FP environment for the kernels (no flush-to-zero, round to nearest) and enforces the vendors' dynamic shared
memory limits (48 KB on CUDA until ``cudaFuncSetAttribute``).
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
# Negative controls (tests only): deliberate runtime deviations that must make GPU != CPU.
_HOST_COPY_RECORD = "<host-to-device copy>"  # csrc/emu/emulation.h kHostCopyRecord
_FAULTS = {None: 0, "neighbour_tree": 1, "barrier_noop": 2, "matrix_layout": 3,
           # kernel variants of the mma linear's emulated launcher that break mma.h's order for M > 16 only
           "mma_split_k_by_m": 4, "mma_block_order_by_m": 5,
           # moe_experts' emulated combine in expert-id order instead of the token's rank order (moe.h)
           "moe_combine_by_expert": 6,
           # the mma attention's emulated launcher: score d-blocks reversed for sequences with q_len > 1
           "mma_attn_block_order_by_q_len": 7,
           # ... and FlashAttention's shared operand (one PV pass per tile, V cut at the group's longest row; the
           # backward's dq with K, dk / dv with q and dO cut the same way)
           "mma_attn_shared_v": 8,
           # moe_experts' grouped fma tiles of more than one row as one chain per output (not the 8-lane tree)
           "moe_fma_chain_by_m": 9,
           # the mma attention's emulated dk / dv: pair-blocks counted from the batch's global pair index
           "mma_attn_pair_blocks_global": 10,
           # the mma linear's tiled kernel (M > 64): lane sums folded left to right instead of the lane tree
           "mma_fold_order_by_m": 11}
# The arithmetic models of the emulated bf16 matrix instructions (csrc/emu/bf16_mma_models.h MmaModel).
MMA_MODELS = ("mmasim", "fma_chain")
# Emulation.matrix_model: the runtime describes each arch's instructions with its bf16 unit under "mmasim" (MMA-Sim's
# model of that unit, csrc/emu/runtime.cpp kArchs, after _MMASIM_CLAUSE); the other models are the same on every arch
# (bf16_mma_models.h bf16_mma_step) and replace that clause in a scope that selects them.
_MMASIM_CLAUSE = "under mma_model 'mmasim': "
_OTHER_MODELS = {"fma_chain": "16 sequential IEEE fp32 fmas per instruction, k ascending, subnormals kept (order-"
                              "sensitive on purpose: not a model of any GPU's unit)"}
assert tuple(_OTHER_MODELS) == MMA_MODELS[1:]


def _matrix_model(arch_text: str, mma_model: str) -> str:
    """The runtime's description of an arch's matrix instructions (its bf16 one under "mmasim") for a scope that runs
    ``mma_model``."""
    if mma_model == MMA_MODELS[0]:
        return arch_text
    head, sep, _ = arch_text.partition(_MMASIM_CLAUSE)
    if not sep:  # the runtime's text changed shape: say both rather than keep a description of the other model
        return f"{arch_text}; this scope's bf16 model: {mma_model!r}: {_OTHER_MODELS[mma_model]}"
    return f"{head}under mma_model {mma_model!r}: {_OTHER_MODELS[mma_model]}"


SCHEDULE_ENV = "ALIGNED_EMU_SCHEDULE"
_SCHEDULE_RE = re.compile(r"forward|reverse|random:[0-9]{1,19}")


def check_schedule(schedule: str) -> str:
    """``schedule`` if it names a runtime schedule (forward, reverse, random:SEED), else ValueError."""
    if not isinstance(schedule, str) or not _SCHEDULE_RE.fullmatch(schedule):
        raise ValueError(f"aligned_ops.emulate: schedule must be forward, reverse or random:SEED, got {schedule!r}")
    return schedule


# The scopes entered and not yet left, innermost last. Process-wide, as the runtime's own scope stack (csrc/emu) is:
# emulation scopes are not thread-safe (two threads with overlapping scopes are refused at the first out-of-order
# exit).
_ACTIVE: list["Emulation"] = []


def active() -> "Emulation | None":
    """The innermost active :func:`emulate` scope, or None (the CPU backend runs)."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: str  # e.g. "rms_norm_kernel<float, float>"
    arch: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int  # dynamic shared memory of the launch

    @property
    def kernel_base(self) -> str:
        """The kernel's name without template arguments, e.g. "rms_norm_kernel"."""
        return self.kernel.split("<", 1)[0]


def _archs() -> dict[str, dict]:
    out = {}
    for rec in torch.ops.aligned._emulated_archs():
        name, vendor, warp, smem, model = rec.split("|", 4)
        out[name] = {"vendor": vendor, "warp_size": int(warp), "max_shared_bytes": int(smem), "matrix_model": model}
    return out


class Emulation:
    """The context manager returned by :func:`emulate`; ``launches`` fills in when the block exits."""

    def __init__(self, arch: str, _fault: str | None = None, schedule: str | None = None, mma_model: str = "mmasim"):
        if arch not in ARCHS:
            raise ValueError(f"aligned_ops.emulate: arch must be one of {', '.join(ARCHS)}, got {arch!r}")
        if mma_model not in MMA_MODELS:
            raise ValueError(f"aligned_ops.emulate: mma_model must be one of {', '.join(MMA_MODELS)}, got {mma_model!r}")
        self.mma_model = mma_model
        self.schedule = check_schedule(schedule) if schedule is not None else None
        self._saved_schedule: str | None = None
        if _fault not in _FAULTS:
            raise ValueError(f"aligned_ops.emulate: unknown fault {_fault!r}")
        info = _archs()[arch]
        self.arch = arch
        self.vendor: str = info["vendor"]
        self.warp_size: int = info["warp_size"]
        self.max_shared_bytes: int = info["max_shared_bytes"]
        # what this scope's matrix instructions compute: the arch's unit under mma_model (not always MMA-Sim's)
        self.matrix_model: str = _matrix_model(info["matrix_model"], mma_model)
        self.launches: list[Launch] = []
        # Host-to-device copies made by the emulated GPU glue, in bytes, in order (csrc/emu/emulation.h
        # record_host_copy; today the attention glue's uploads): the CUDA-graph-safe run forms make none.
        self.host_copies: list[int] = []
        self._fault = _fault
        self._active = False

    def __enter__(self) -> "Emulation":
        if self._active:
            raise RuntimeError("aligned_ops.emulate: this scope is already active")
        if self.schedule is not None:
            self._saved_schedule = os.environ.get(SCHEDULE_ENV)
            os.environ[SCHEDULE_ENV] = self.schedule
        torch.ops.aligned._emulate_enter(self.arch, _FAULTS[self._fault], MMA_MODELS.index(self.mma_model))
        self._active = True
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        # The runtime's scopes are a stack (csrc/emu: exit() leaves the innermost): leaving this one while a scope
        # entered after it is open would end THAT one's arch and keep running this one's, attributed to the other.
        # Refused, with nothing changed: exit the inner scopes first.
        if not self._active:
            raise RuntimeError(f"aligned_ops.emulate: this {self.arch} scope is not active (exited twice, or never "
                               "entered)")
        if _ACTIVE[-1] is not self:
            inner = ", ".join(e.arch for e in _ACTIVE[_ACTIVE.index(self) + 1 :])
            raise RuntimeError(f"aligned_ops.emulate: scopes must be exited innermost first: this {self.arch} scope "
                               f"was exited while scope(s) entered after it are still active ({inner}); exit those "
                               "first")
        self._active = False
        _ACTIVE.pop()
        if self.schedule is not None:
            if self._saved_schedule is None:
                os.environ.pop(SCHEDULE_ENV, None)
            else:
                os.environ[SCHEDULE_ENV] = self._saved_schedule
        for rec in torch.ops.aligned._emulate_exit():
            kernel, arch, grid, block, smem = rec.split("|")
            if kernel == _HOST_COPY_RECORD:
                self.host_copies.append(int(smem))
                continue
            self.launches.append(
                Launch(kernel, arch, tuple(int(v) for v in grid.split(",")), tuple(int(v) for v in block.split(",")), int(smem))
            )

    def kernels(self) -> set[str]:
        """Base names of the kernels launched so far (after the block exited)."""
        return {launch.kernel_base for launch in self.launches}

    def __repr__(self) -> str:
        return (f"Emulation(arch={self.arch!r}, mma_model={self.mma_model!r}, warp_size={self.warp_size}, "
                f"launches={len(self.launches)})")


def emulate(arch: str, *, schedule: str | None = None, mma_model: str = "mmasim",
            _fault: str | None = None) -> Emulation:
    """Run the aligned ops on CPU tensors through the GPU kernel source of ``arch`` (see the module doc).
    ``schedule``: the runtime's thread/warp/block order for the scope (default: ``ALIGNED_EMU_SCHEDULE``, else
    ``forward``). ``mma_model``: the arithmetic of the bf16 matrix instructions, one of :data:`MMA_MODELS`."""
    return Emulation(arch, _fault, schedule, mma_model)
