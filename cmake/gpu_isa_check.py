"""Static numerics checks on the GPU compiler output (run by cmake/gpu_compile_check.cmake).

The numerics contract (csrc/common/numerics.h) forbids vendor exp/log, flush-to-zero and FMA contraction
the source did not write. This script proves, on what the compilers actually emitted, that:

  ptx  (nvcc -ptx):   no approximate instruction (ex2/lg2/rcp/sqrt/rsqrt/sin/cos/tanh .approx, div.approx,
                      div.full — what -prec-div=false, -prec-sqrt=false and --use_fast_math emit), no .ftz
                      modifier, and every f32 add/sub/mul carries .rn (ptxas may fuse an unrounded mul+add
                      into FFMA; .rn forbids it), no mad.f32;
  ll   (hip-clang device IR): no llvm.fmuladd, no `contract`/`fast`/`afn` flags on float ops, no calls to
                      llvm.exp/llvm.log/__ocml_exp/__ocml_log/__ocml_native_*, no approximate divide/sqrt:
                      `!fpmath` on an fdiv or sqrt (clang's marker for the 2.5 ulp / 3 ulp versions that
                      -fno-hip-fp32-correctly-rounded-divide-sqrt selects) and no llvm.amdgcn.rcp/rsq/sqrt/exp/log
                      intrinsics. The asm cannot show this: the correctly rounded expansions themselves contain
                      v_rcp_f32 and v_sqrt_f32, followed by their correction steps;
  s    (AMDGPU asm):  no v_exp_f32 / v_log_f32 / v_rsq_f32, and every kernel preserves f32 denormals
                      (.amdhsa_float_denorm_mode_32 3).

Usage: gpu_isa_check.py KIND FILE STAMP   (KIND in ptx, ll, s). Exit status 1 lists the violations.
"""

import re
import sys

CHECKS = {
    "ptx": [
        (re.compile(r"\b(ex2|lg2)\.approx"), "vendor exp/log instruction (ex2/lg2.approx)"),
        (re.compile(r"\b(rcp|sqrt|rsqrt|sin|cos|tanh)\.approx"), "approximate rcp/sqrt/rsqrt/sin/cos/tanh (.approx)"),
        (re.compile(r"\bdiv\.(approx|full)\b"), "approximate division (div.approx / div.full: -prec-div=false)"),
        (re.compile(r"\.ftz\b"), "flush-to-zero modifier (.ftz)"),
        (re.compile(r"^\s*(add|sub|mul)\.f32\b", re.M), "f32 add/sub/mul without .rn (contractible by ptxas)"),
        (re.compile(r"^\s*mad\.(rn\.)?f32\b", re.M), "mad.f32 (contracted multiply-add)"),
    ],
    "ll": [
        (re.compile(r"@llvm\.fmuladd"), "llvm.fmuladd (contraction allowed)"),
        (re.compile(r"\b(fadd|fsub|fmul|fdiv|call)\s+(\w+\s+)*(contract|fast|afn|reassoc|arcp)\b"),
         "fast-math flag on a float operation"),
        (re.compile(r"@(llvm\.(exp|exp2|log|log2)\.f32|__ocml_(exp|log)\w*)"), "vendor exp/log call"),
        (re.compile(r"^.*(\bfdiv\b|@llvm\.sqrt\.f32\b).*!fpmath.*$", re.M),
         "approximate divide/sqrt (!fpmath: -fno-hip-fp32-correctly-rounded-divide-sqrt)"),
        (re.compile(r"@(llvm\.amdgcn\.(rcp|rsq|sqrt|exp2?|log2?)\b|__ocml_native_\w+)"),
         "approximate hardware rcp/rsq/sqrt/exp/log intrinsic"),
    ],
    "s": [
        (re.compile(r"\bv_(exp|log)_f32"), "vendor exp/log instruction (v_exp_f32/v_log_f32)"),
        (re.compile(r"\bv_rsq_f32"), "approximate reciprocal square root (v_rsq_f32)"),
        (re.compile(r"\.amdhsa_float_denorm_mode_32\s+[012]\b"), "kernel flushes f32 denormals"),
    ],
}


def main() -> int:
    kind, path, stamp = sys.argv[1:4]
    text = open(path, encoding="utf-8", errors="replace").read()
    bad = []
    for rx, what in CHECKS[kind]:
        hits = [m.group(0).strip() for m in rx.finditer(text)]
        if hits:
            bad.append(f"  {what}: {len(hits)} hit(s), e.g. {hits[0]!r}")
    if kind == "s" and ".amdhsa_float_denorm_mode_32" not in text:
        bad.append("  no kernel descriptor found (.amdhsa_float_denorm_mode_32 missing)")
    if bad:
        print(f"gpu_isa_check: {path} violates the numerics contract:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    with open(stamp, "w") as f:
        f.write("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
