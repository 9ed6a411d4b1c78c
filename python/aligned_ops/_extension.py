"""Loading the compiled extension (``_C``, which registers ``torch.ops.aligned.*``), once: at ``import aligned_ops``
(aligned_ops/__init__.py), or at the first import of ``aligned_ops.ops`` in a process where the package deferred
it (the ``aligned-ops`` command). Imports nothing of the package but ``_build_info`` and ``_C``."""

from __future__ import annotations

import importlib


class ExtensionLoadError(ImportError):
    """The extension cannot load here (not built, built for another torch, an ALIGNED_CPU_ISA this CPU cannot run):
    one line saying what to do. The ``aligned-ops`` command prints it as its one-line error."""


def load_extension() -> None:
    """Import ``_C`` after checking it was built for the installed torch; idempotent (Python caches modules)."""
    import torch

    try:
        from ._build_info import TORCH_VERSION as BUILT_WITH_TORCH
    except ImportError as e:  # pragma: no cover - source checkout without a build
        raise ExtensionLoadError(
            "aligned_ops is not built: run `pip install --no-build-isolation .` (or the cmake dev build, see "
            "DESIGN.md) against the installed torch"
        ) from e
    if BUILT_WITH_TORCH != torch.__version__:
        raise ExtensionLoadError(
            f"aligned_ops was built against torch {BUILT_WITH_TORCH} but torch {torch.__version__} is installed; "
            "torch's C++ ABI changes between versions: rebuild with `pip install --no-build-isolation .`"
        )

    # _C registers the ops. By name: an extension module is no node of the package's Python import graph
    # (tests/test_import_graph.py would read "from . import _C" as an edge back to the package).
    try:
        importlib.import_module(__package__ + "._C")
    except ImportError as e:  # a missing, truncated or mismatched .so ("undefined symbol", "file too short")
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ExtensionLoadError(f"aligned_ops: the compiled extension cannot load ({first}); rebuild it with "
                                 "`pip install --no-build-isolation .` against the installed torch") from e

    # The CPU kernel level is chosen once, in C++ (csrc/cpu/cpu_backend.h); an ALIGNED_CPU_ISA that names no level
    # (or one this CPU cannot run) fails here, at import, with the backend's own words, not at the first op.
    try:
        torch.ops.aligned._cpu_isa()
    except RuntimeError as _e:
        raise ExtensionLoadError(str(_e).splitlines()[0]) from None
