"""Tiny random-weight checkpoints, built once per test run and shared by every test that asks for the same one.

    path = tiny_checkpoint("qwen2", torch.bfloat16, seed=0)             # aligned_ops.testing.tiny_model builders
    path = tiny_checkpoint("moe", torch.float32, seed=3, arch="qwen2_moe", num_hidden_layers=1)

The same arguments give the same folder (under the run's pytest tmp dir, one for all pytest-xdist workers: the first
to ask builds it) for the whole run; an override equal
to the builder's default (after the ``variant`` it names, if any: ``variant="dv-ne-dn", qk_nope_head_dim=32``
keeps 32, the variant's own value is dropped as a default) is the same checkpoint as no override. The folders are read-only by contract: each
reuse checks that no file of the folder changed since it was built (a test that edits a checkpoint builds its
own with the builder, or edits a copy: ``edited_copy``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from _xdist import locked, shared_root


def edited_copy(src, dst, **config_changes) -> str:
    """A copy of checkpoint folder ``src`` at ``dst`` with ``config_changes`` written into its config.json (a shared
    checkpoint itself is never edited)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def _builders():
    from aligned_ops.testing import tiny_model as tm

    return {
        "qwen2": (tm.build_tiny_qwen2, tm.DEFAULT_CONFIG),
        "moe": (tm.build_tiny_moe, {**tm.DEFAULT_MOE_CONFIG, "arch": "qwen3_moe", "router_scale": 0.08}),
        "llama": (tm.build_tiny_llama, {}),
        "deepseek_v3": (tm.build_tiny_deepseek_v3, {**tm.DEFAULT_DEEPSEEK_V3_CONFIG, "router_scale": 0.08,
                                                     "bias_scale": 0.05, "variant": "default"}),
        "glm4_moe": (tm.build_tiny_glm4_moe, {**tm.DEFAULT_GLM4_MOE_CONFIG, "router_scale": 0.08, "bias_scale": 0.05}),
    }


def _resolved_defaults(kind: str, defaults: dict, overrides: dict) -> dict:
    """The values the builder uses for what ``overrides`` leaves out: its defaults after the named ``variant``
    (the builder applies the variant first, then the overrides)."""
    if kind == "deepseek_v3" and "variant" in overrides:
        from aligned_ops.models.tiny import DEEPSEEK_V3_VARIANTS

        return {**defaults, **DEEPSEEK_V3_VARIANTS.get(overrides["variant"], {})}  # (unknown: the builder refuses)
    return defaults


def _fingerprint(path: str) -> list:
    out = []
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            st = os.stat(os.path.join(d, f))
            out.append((os.path.relpath(os.path.join(d, f), path), st.st_size, st.st_mtime_ns))
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(kind, dtype, seed=0, **overrides) -> str``: the folder of that tiny checkpoint, built on
    first use in this run (kind: ``qwen2``, ``moe``, ``llama``, ``deepseek_v3`` or ``glm4_moe``; see aligned_ops.testing.tiny_model).
    Under pytest-xdist the workers share the folders (tests/_xdist.py): the first to ask builds it, under a lock."""
    return checkpoint_getter(tmp_path_factory)


def checkpoint_getter(tmp_path_factory):
    """The fixture's function (one per process; its folders are the run's)."""
    root = shared_root(tmp_path_factory) / "tiny_checkpoints"
    root.mkdir(exist_ok=True)
    built: dict = {}

    def get(kind: str, dtype, seed: int = 0, **overrides) -> str:
        builder, defaults = _builders()[kind]
        defaults = _resolved_defaults(kind, defaults, overrides)
        overrides = {k: v for k, v in overrides.items() if k not in defaults or defaults[k] != v}
        key = (kind, str(dtype), seed, repr(sorted(overrides.items())))
        if key not in built:
            # the same name in every worker for the same arguments (not an order-dependent counter)
            digest = hashlib.sha1(repr(key).encode()).hexdigest()[:10]
            name = f"{kind}_{str(dtype).replace('torch.', '')}_seed{seed}_{digest}"
            path = root / name
            with locked(root / f"{name}.lock"):
                if not path.exists():  # built whole in a temporary folder, then renamed: never seen half-written
                    tmp = root / f"{name}.building"
                    shutil.rmtree(tmp, ignore_errors=True)
                    builder(tmp, dtype, seed=seed, **overrides)
                    os.replace(tmp, path)
            built[key] = (str(path), _fingerprint(path))
        path, fingerprint = built[key]
        assert _fingerprint(path) == fingerprint, f"a test modified the shared tiny checkpoint {path}"
        return path

    return get


def runner_checkpoint_bytes(step: int = 2, metrics_offset: int = 0, versions=None) -> bytes:
    """A tiny ``aligned-ops train`` checkpoint (checkpoint/state.pt) as ``learner_main`` writes it: the keys and
    structure ``--resume`` checks up front (runner.config.check_checkpoint_file), with ``versions`` (default: all
    of 0..step) in its weight history."""
    import collections
    import io

    import torch

    w = lambda v: collections.OrderedDict(weight=torch.full((4, 4), float(v)))  # noqa: E731
    versions = range(step + 1) if versions is None else versions
    state = dict(step=step, metrics_offset=metrics_offset,
                 policy={"model": w(step), "master": [torch.zeros(4, 4)], "opt": {"state": {}, "param_groups": []},
                         "sched": {"last_epoch": step}},
                 history={v: w(v) for v in versions}, rng=torch.get_rng_state(), cfg={})
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()
