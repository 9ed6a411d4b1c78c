"""scikit-build-core metadata provider: a wheel names, and pins, the torch build it was compiled against.

The extension links torch's C++ ABI, which changes between torch versions *and* between the CPU, CUDA and
ROCm builds of one version, so a wheel is only usable next to the exact torch it was built with (the
build is ``--no-build-isolation``: that is the torch installed in the building environment). This provider
turns that torch into
  * the local version label: ``0.1.0+cpu``, ``0.1.0+cu130``, ``0.1.0+rocm6.4`` (torch's own label when it
    has one, else derived from ``torch.version.cuda`` / ``torch.version.hip``);
  * the dependency pin ``torch==<torch.__version__>`` (local label included, so pip refuses a CUDA wheel
    of ours next to a CPU torch rather than failing at import).
Configured in pyproject.toml ([tool.scikit-build.metadata.*], provider-path = "cmake").
"""

from __future__ import annotations


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the build needs torch installed
        raise RuntimeError("aligned_ops builds against an installed torch (pip install --no-build-isolation)") from e
    return torch


def torch_build_tag(torch) -> str:
    local = torch.__version__.partition("+")[2]
    if local:
        return local
    if getattr(torch.version, "hip", None):
        return "rocm" + ".".join(torch.version.hip.split(".")[:2])
    if getattr(torch.version, "cuda", None):
        return "cu" + torch.version.cuda.replace(".", "")[:3]
    return "cpu"


def dynamic_metadata(field, settings=None, project=None):
    settings = dict(settings or {})
    torch = _torch()
    if field == "version":
        base = settings.get("base")
        if not base:
            raise RuntimeError("wheel_metadata: [tool.scikit-build.metadata.version] needs base = \"X.Y.Z\"")
        return f"{base}+{torch_build_tag(torch)}"
    if field == "dependencies":
        return [f"torch=={torch.__version__}", *settings.get("extra", [])]
    raise RuntimeError(f"wheel_metadata provides version and dependencies, not {field!r}")
