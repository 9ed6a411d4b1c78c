"""No host synchronisation in any op on the decode path (GPU glue and the Python around it).

Two proofs, both without a GPU:
1. A scan of the GPU glue — the GPU backends' run functions (csrc/torch/backends/gpu.h, the CUDA device in
   cuda.h / cuda.cpp), the one glue body per op they run (csrc/torch/glue/*.h), make_params.h — and of the
   decode-path Python for host reads of device data: ``.item()``, ``.cpu()``, ``.tolist()``, ``to(kCPU)``,
   ``cudaMemcpy``/``hipMemcpy`` device-to-host, stream/device synchronise; every call of the data-value checks
   in a glue body must pass the backend's mode ``B::kValueChecks``, and the GPU backends' mode is
   ``ValueChecks::kInKernel``. A planted violation of each kind must be found (negative control).
2. The decode-path Python wrappers and vLLM hooks run under a TorchDispatchMode that fails on
   ``aten._local_scalar_dense`` (what ``.item()`` / ``float(t)`` / ``bool(t)`` dispatch to), ``aten.equal``,
   ``aten.is_nonzero`` and any copy of a non-CPU tensor to the CPU, on 'meta' tensors (the ops' fake
   impls; any host read of data fails there too). The negative control runs a planted ``.item()``.
(The emulated tests, tests/emulated/test_emulated_device_errors.py, prove behaviourally that the GPU glue
does not read values on the host: bad values do not raise at the call.)
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aligned_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH = ROOT / "csrc" / "torch"
GPU_BACKEND = TORCH / "backends" / "gpu.h"  # every GPU run function, for every build (device, emulated)
CUDA_DEVICE = (TORCH / "backends" / "cuda.h", TORCH / "backends" / "cuda.cpp")  # streams, guard, error words
GLUE_BODIES = sorted((TORCH / "glue").glob("*.h"))  # one body per op, run by every backend
ATTENTION_GLUE = TORCH / "glue" / "attention.h"
OP_PARAMS = TORCH / "make_params.h"  # tensors -> params structs, every glue body
# Where the negative controls plant a violation: a run function every GPU build has.
PLANT_BEFORE = "  static void gemm(const Call& c, GemmParams p) {"

# Host reads of device data / synchronisations, as they are spelled in C++ glue.
CXX_FORBIDDEN = {
    "item": r"\.item\s*<|\.item\s*\(",
    "cpu": r"\.cpu\s*\(|kCPU|Device\s*\(\s*\"cpu\"",
    "tolist": r"\.tolist\s*\(",
    "memcpy": r"(cuda|hip)Memcpy(Async)?\s*\(",
    "sync": r"(cuda|hip)(Stream|Device)Synchronize|\.synchronize\s*\(",
    "local_scalar": r"_local_scalar_dense",
    "equal": r"\.equal\s*\(|\.is_nonzero\s*\(",
}
# Data-value checks (csrc/torch/checks): a glue body passes its backend's mode, B::kValueChecks (kInKernel on
# every GPU backend, so the same body never reads device data there).
VALUE_CHECKS = ("check_rotary", "check_logits", "check_token_ids", "check_topk_ids", "check_moe_experts")
BACKEND_MODE = "B::kValueChecks"


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _calls(src: str, name: str):
    """Argument text of every call of `name` (balanced parentheses)."""
    for m in re.finditer(rf"(?<![\w:]){re.escape(name)}\s*(<[^>]*>)?\s*\(", src):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        yield src[m.end():i - 1]


# Glue functions that run once per weight version (load, refit), never per step: a host read there is allowed
# (the packed weight's digit count sizes its output tensor).
OFF_DECODE_PATH = ("linear_exact_pack_weight",)


def _definition(src: str, name: str):
    """(start, end) of the definition of function `name` (a free or member function, any indentation)."""
    m = re.search(rf"\n[^\n;]*\b{re.escape(name)}\s*\([^;{{]*\)\s*(?:const\s*)?\{{", src)
    if not m:
        return None
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return m.start(), i


def _drop_functions(src: str, names) -> str:
    for name in names:
        span = _definition(src, name)
        if span:
            src = src[:span[0]] + "\n" + src[span[1]:]
    return src


def scan_glue(src: str) -> list:
    src = _drop_functions(_strip_comments(src), OFF_DECODE_PATH)
    found = [f"{kind}: {m.group(0)}" for kind, pat in CXX_FORBIDDEN.items() for m in re.finditer(pat, src)]
    for name in VALUE_CHECKS:
        for args in _calls(src, name):
            if BACKEND_MODE not in args:
                found.append(f"{name}({args.strip()[:60]}...) without {BACKEND_MODE}")
    return found


def test_cuda_attention_glue_has_no_host_read():
    # The attention glue takes its metadata (cu_seqlens, block tables, seq lens) as host tensors and plans on
    # the host (csrc/common/attention_plan.h): no device tensor is read back.
    assert scan_glue(ATTENTION_GLUE.read_text()) == []


def test_gpu_glue_has_no_host_read():
    assert scan_glue(GPU_BACKEND.read_text()) == []
    for path in CUDA_DEVICE:
        assert scan_glue(path.read_text()) == []
    assert scan_glue(OP_PARAMS.read_text()) == []  # the params builders every glue body calls
    bodies = "\n".join(_strip_comments(p.read_text()) for p in GLUE_BODIES)
    assert scan_glue(bodies) == []
    # The value checks are really called there (the scan is not vacuous), and every GPU backend's mode is
    # kInKernel: one Gpu<Device> template serves the CUDA / ROCm device and both emulated spellings.
    for name in VALUE_CHECKS:
        assert list(_calls(bodies, name)), name
    gpu = _strip_comments(GPU_BACKEND.read_text())
    assert re.search(r"static constexpr ValueChecks kValueChecks = ValueChecks::kInKernel;", gpu)
    assert not re.search(r"kValueChecks = ValueChecks::kHost", gpu)
    families = _strip_comments((TORCH / "families.h").read_text())
    for alias in ("Cuda", "EmulatedCuda", "EmulatedHip"):
        assert re.search(rf"using {alias} = Gpu<", families), alias


@pytest.mark.parametrize("planted", [
    "  const int64_t n = pos.max().item<int64_t>();",
    "  auto h = ids.cpu();",
    "  auto h = ids.to(at::kCPU);",
    "  cudaMemcpy(&h, p, 4, cudaMemcpyDeviceToHost);",
    "  hipMemcpyAsync(&h, p, 4, hipMemcpyDeviceToHost, s);",
    "  cudaStreamSynchronize(s);",
    "  auto a = check_rotary<DType>(positions, x, cache, rot, op);",
    "  auto t = check_logits<DType>(logits, temperature, temperatures, op, ValueChecks::kHost);",
    "  a.ids = check_token_ids(ids, a.p.T, a.p.V, op);",
    # a host read in an off-path function's name-alike is still caught (only the listed function is exempt)
    "  static int linear_exact_pack_weight_twice(const at::Tensor& w) {\n    return w.max().item<int8_t>();\n  }\n",
])
def test_scan_negative_control(planted):
    clean = GPU_BACKEND.read_text()
    assert PLANT_BEFORE in clean
    src = clean.replace(PLANT_BEFORE, planted + "\n" + PLANT_BEFORE, 1)
    assert scan_glue(src), planted


def unguarded_item_reads(src: str) -> list:
    """Every ``.item`` read of a checks header that is not preceded, inside its function, by the
    ``values == ValueChecks::kHost`` guard (a function ends at a column-0 ``}``)."""
    src = _strip_comments(src)
    found = []
    for m in re.finditer(r"\.item\s*[<(]", src):
        start = src.rfind("\n}\n", 0, m.start())
        if "values == ValueChecks::kHost" not in src[start + 1:m.start()]:
            found.append(src[src.rfind("\n", 0, m.start()) + 1:src.find("\n", m.start())].strip())
    return found


@pytest.mark.parametrize("header, fns", [
    ("torch/checks/dense.h", ("check_rotary",)),
    ("torch/checks/logits.h", ("check_logits", "check_token_ids")),
    ("torch/checks/moe.h", ("check_topk_ids",)),
])
def test_host_value_checks_are_only_on_the_host_path(header, fns):
    # Every .item() read of the checks header sits behind `values == ValueChecks::kHost`.
    raw = (ROOT / "csrc" / header).read_text()
    src = _strip_comments(raw)
    for fn in fns:
        body = src[src.index(f" {fn}("):]
        body = body[:body.index("\n}\n")]
        assert ".item<" in body, fn  # the check really reads values on the host path (not vacuous)
        assert body.index("values == ValueChecks::kHost") < body.index(".item<"), fn
    assert unguarded_item_reads(raw) == []


def test_unguarded_item_read_negative_control():
    raw = (ROOT / "csrc" / "torch" / "checks" / "moe.h").read_text()
    anchor = "inline at::Tensor check_moe_grad_weights("
    assert anchor in raw
    planted = raw.replace(anchor, "inline int64_t planted_read(const at::Tensor& t) {\n"
                                  "  return t.max().item<int64_t>();\n}\n" + anchor, 1)
    assert unguarded_item_reads(planted) == ["return t.max().item<int64_t>();"]


# ---- the decode-path Python under a mode that forbids host reads ------------------------------------------------


class ForbidHostReads(TorchDispatchMode):
    FORBIDDEN = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                 torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FORBIDDEN:
            raise AssertionError(f"host read on the decode path: {func}")
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst_dev = (args[0].device if func is torch.ops.aten.copy_.default
                       else kwargs.get("device", src.device))
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst_dev).type == "cpu":
                raise AssertionError(f"device->cpu copy on the decode path: {func}")
        self.seen.append(str(func))
        return func(*args, **kwargs)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _decode_step():
    """One decode step's op calls through the Python wrappers (B=4 tokens), on 'meta' tensors."""
    B, H, heads, kv, D, V = 4, 64, 4, 2, 16, 97
    x = _meta(B, H)
    w = _meta(H)
    h = aligned_ops.rms_norm(x, w, 1e-6)
    h, res = aligned_ops.fused_add_rms_norm(h, x, w, 1e-6)
    qkv = aligned_ops.linear(h, _meta((heads + 2 * kv) * D, H), _meta((heads + 2 * kv) * D))
    q = qkv[:, :heads * D].reshape(B, heads, D).contiguous()
    k = qkv[:, heads * D:(heads + kv) * D].reshape(B, kv, D).contiguous()
    v = qkv[:, (heads + kv) * D:].reshape(B, kv, D).contiguous()
    pos = torch.empty(B, dtype=torch.int64, device="meta")
    cache = torch.empty(64, D, dtype=torch.float32, device="meta")
    q = aligned_ops.rotary_embedding(pos, q, cache, D, True)
    k = aligned_ops.rotary_embedding(pos, k, cache, D, True)
    kc, vc = _meta(8, 16, kv, D), _meta(8, 16, kv, D)
    aligned_ops.reshape_and_cache(k, v, kc, vc, torch.empty(B, dtype=torch.int64, device="meta"))
    i32 = dict(dtype=torch.int32, device="meta")
    o = aligned_ops.paged_attention(q, kc, vc, torch.empty(B, 2, **i32), torch.empty(B, **i32),
                                    torch.empty(B + 1, **i32), 0.25)
    h = aligned_ops.linear(o.reshape(B, heads * D), _meta(H, heads * D))
    g = aligned_ops.silu_and_mul(aligned_ops.linear(h, _meta(2 * 32, H)))
    logits = aligned_ops.linear(aligned_ops.linear(g, _meta(H, 32)), _meta(V, H))
    temps = torch.empty(B, dtype=torch.float32, device="meta")
    aligned_ops.log_softmax(logits, temps)
    aligned_ops.log_softmax(logits, torch.empty((), dtype=torch.float32, device="meta"))  # 0-d device scalar
    aligned_ops.log_softmax(logits, 0.7)
    aligned_ops.token_logprobs(logits, torch.empty(B, dtype=torch.int64, device="meta"), temps)
    aligned_ops.logsumexp(logits, temps)


def test_decode_path_python_has_no_host_read():
    with ForbidHostReads() as mode:
        _decode_step()
    assert any("aligned.paged_attention" in s for s in mode.seen) and any("aligned.linear" in s for s in mode.seen)


def test_vllm_plugin_hooks_have_no_host_read():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from aligned_ops.integrations.vllm import layers, sampler

    B, heads, D, V = 3, 2, 16, 50
    rot = SimpleNamespace(_aligned_unsupported=None, head_size=D, rotary_dim=D, is_neox_style=True,
                          _aligned_cos_sin_cache=torch.empty(64, D, dtype=torch.float32, device="meta"))
    with ForbidHostReads():
        layers._rotary_forward(rot, torch.empty(B, dtype=torch.int64, device="meta"), _meta(B, heads * D),
                                    _meta(B, heads * D))
        token = sampler._current_temperature.set(torch.empty(B, dtype=torch.float32, device="meta"))
        try:
            sampler._compute_logprobs(torch.empty(B, V, dtype=torch.float32, device="meta"))
        finally:
            sampler._current_temperature.reset(token)


def test_dispatch_mode_negative_control():
    with pytest.raises(AssertionError, match="host read on the decode path"):
        with ForbidHostReads():
            torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="host read on the decode path"):
        with ForbidHostReads():
            aligned_ops.log_softmax(torch.randn(2, 5), torch.tensor(0.5))  # CPU 0-d: float() = a host read


# ---- the plan/run form of attention: the run path makes no copy at all (CUDA-graph safe) ---------------------
# Beyond the host reads above, a captured graph must not contain a host-to-device copy (it would replay stale
# host data): the run functions may call nothing that uploads. Emulated proof: tests/emulated/
# test_emulated_attention_plan.py (copy records, identical launches).
RUN_PATH = {ATTENTION_GLUE: ("attention_varlen_planned", "paged_attention_planned", "paged_attention_planned_run",
                             "attention_run_planned", "mla_attention_varlen_planned", "mla_paged_attention_planned",
                             "mla_head", "mla_values"),
            GPU_BACKEND: ("attention_forward_planned", "launch_forward", "forward_params"),
            CUDA_DEVICE[1]: ("error_flags", "stream"),
            TORCH / "checks" / "attention.h": ("plan_info_of", "check_plan_call", "check_plan_offsets")}
COPIES = {
    "upload": r"(?<![\w])upload\s*\(",
    "copy_into": r"(?<![\w])copy_into\s*\(",
    "copy_": r"\.copy_\s*\(",
    "to": r"\.to\s*\(",
    "pinned": r"pinned_memory",
    "memcpy": r"(?<![\w])memcpy\s*\(",
}
# (attention_varlen_planned does read its HOST cu_seqlens — checks/attention.h check_plan_offsets — to check the
# call against the plan's metadata fingerprint: a host computation, no copy and no read of device memory.)


def _function_body(src: str, name: str) -> str:
    span = _definition(src, name)
    assert span, name
    return src[span[0]:span[1]]


def scan_run_path(src: str, names) -> list:
    src = _strip_comments(src)
    found = []
    for name in names:
        body = _function_body(src, name)
        found += [f"{name}: {kind}: {m.group(0)}" for kind, pat in {**CXX_FORBIDDEN, **COPIES}.items()
                  for m in re.finditer(pat, body)]
    return found


def test_attention_run_form_makes_no_copy():
    for path, names in RUN_PATH.items():
        assert scan_run_path(path.read_text(), names) == [], path


def test_attention_run_form_scan_negative_control():
    src = GPU_BACKEND.read_text()
    # the per-call form does upload (its work list, every call) and the plan op copies in: the scan sees both
    assert any("upload" in f for f in scan_run_path(src, ("attention_forward",)))
    assert any("copy_into" in f for f in scan_run_path(src, ("write_plan",)))
    anchor = "    launch_forward(c, p, plan.data_ptr<int64_t>()"
    planted = src.replace(anchor, "    at::Tensor h = plan.to(at::kCPU);\n" + anchor, 1)
    assert planted != src and scan_run_path(planted, ("attention_forward_planned",))
