"""Static numerics checks on the GPU compiler output (run by cmake/gpu_compile_check.cmake).

The numerics contract (csrc/common/numerics.h) forbids vendor exp/log, flush-to-zero and FMA contraction
the source did not write. This script proves, on what the compilers actually emitted, that:

  ptx  (nvcc -ptx):   no approximate instruction (ex2/lg2/rcp/sqrt/rsqrt/sin/cos/tanh .approx, div.approx,
                      div.full — what -prec-div=false, -prec-sqrt=false and --use_fast_math emit), no .ftz
                      modifier, and every f32 and f64 add/sub/mul carries .rn (ptxas may fuse an unrounded
                      mul+add into FFMA / DFMA; .rn forbids it), no mad.f32 / mad.f64, and no f64 fma at all:
                      no kernel writes one (the exact epilogue's TwoSum and its scalings are plain f64 add / sub /
                      mul, correct only unfused), so an fma.rn.f64 in the PTX is nvcc's own contraction
                      (--fmad=true contracts f64 before PTX, where .rn cannot be checked);
  ll   (hip-clang device IR): no llvm.fmuladd, no `contract`/`fast`/`afn` flags on float ops, no calls to
                      llvm.exp/llvm.log/__ocml_exp/__ocml_log/__ocml_native_*, no approximate divide/sqrt:
                      `!fpmath` on an fdiv or sqrt (clang's marker for the 2.5 ulp / 3 ulp versions that
                      -fno-hip-fp32-correctly-rounded-divide-sqrt selects) and no llvm.amdgcn.rcp/rsq/sqrt/exp/log
                      intrinsics. The asm cannot show this: the correctly rounded expansions themselves contain
                      v_rcp_f32 and v_sqrt_f32, followed by their correction steps;
  s    (AMDGPU asm):  no v_exp_f32 / v_log_f32 / v_rsq_f32, no f64 fma (v_fma_f64 / v_fmac_f64: contracted,
                      as above), and every kernel preserves f32 denormals (.amdhsa_float_denorm_mode_32 3).
  ll   also: no llvm.fma.f64 / llvm.fmuladd.f64 (the same f64 rule in the device IR).
  REQUIRED: the matrix instructions a kernel file must contain (ptx / s), e.g. linear_mma's and attention's bf16 mma.sync
                      m16n8k16 / v_mfma_f32_16x16x16_bf16.

Usage: gpu_isa_check.py KIND FILE STAMP   (KIND in ptx, ll, s). Exit status 1 lists the violations.

Two helpers of the compile check (cmake/gpu_compile_check.cmake) live here too:
  gpu_isa_check.py nvcc LOG -- NVCC ARGS...      runs nvcc, its output (ptxas -v resource usage) into LOG;
  gpu_isa_check.py fatbin OBJ EXPECT STAMP        lists the cubins / PTX embedded in an object's fatbin (the
                      ELF section .nv_fatbin; what cuobjdump --list-elf --list-ptx prints, without cuobjdump)
                      and fails unless they are exactly EXPECT ("sm_80,sm_90,...+compute_80"); writes them to STAMP.
"""

import os
import re
import struct
import subprocess
import sys

CHECKS = {
    "ptx": [
        (re.compile(r"\b(ex2|lg2)\.approx"), "vendor exp/log instruction (ex2/lg2.approx)"),
        (re.compile(r"\b(rcp|sqrt|rsqrt|sin|cos|tanh)\.approx"), "approximate rcp/sqrt/rsqrt/sin/cos/tanh (.approx)"),
        (re.compile(r"\bdiv\.(approx|full)\b"), "approximate division (div.approx / div.full: -prec-div=false)"),
        (re.compile(r"\.ftz\b"), "flush-to-zero modifier (.ftz)"),
        (re.compile(r"^\s*(add|sub|mul)\.f32\b", re.M), "f32 add/sub/mul without .rn (contractible by ptxas)"),
        (re.compile(r"^\s*mad\.(rn\.)?f32\b", re.M), "mad.f32 (contracted multiply-add)"),
        (re.compile(r"^\s*(add|sub|mul)\.f64\b", re.M), "f64 add/sub/mul without .rn (contractible by ptxas)"),
        (re.compile(r"^\s*(mad|fma)\.(rn\.|rz\.|rm\.|rp\.)?f64\b", re.M),
         "f64 fma / mad (no kernel writes one: a contraction of the TwoSum's f64 arithmetic)"),
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
        (re.compile(r"@llvm\.(fma|fmuladd)\.f64\b"), "f64 fma (no kernel writes one: a contraction)"),
    ],
    "s": [
        (re.compile(r"\bv_(exp|log)_f32"), "vendor exp/log instruction (v_exp_f32/v_log_f32)"),
        (re.compile(r"\bv_rsq_f32"), "approximate reciprocal square root (v_rsq_f32)"),
        (re.compile(r"\.amdhsa_float_denorm_mode_32\s+[012]\b"), "kernel flushes f32 denormals"),
        (re.compile(r"\bv_fmac?_f64"), "f64 fma (no kernel writes one: a contraction)"),
    ],
}


# The matrix instructions a kernel file must contain (keyed by a substring of the checked file's name: the PTX
# keep files are <name>.compute_NN.ptx, the asm hip_<name>.<arch>.s): the `mma` linear's bf16 instruction
# (csrc/gpu/bf16_mma.cuh). A build that lost it (a fallback path, a dead-code-eliminated kernel) fails the scan.
REQUIRED = {
    "linear_mma": {
        "ptx": (re.compile(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b"),
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (the mma linear's bf16 instruction)"),
        "s": (re.compile(r"\bv_mfma_f32_16x16x16_?bf16(_1k)?\b"),
              "v_mfma_f32_16x16x16_bf16 (the mma linear's bf16 instruction)"),
    },
    # moe_experts' mma profile: its grouped tiles run the mma linear's kernel body (csrc/gpu/moe_kernels.cuh)
    "moe": {
        "ptx": (re.compile(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b"),
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (the mma experts' bf16 instruction)"),
        "s": (re.compile(r"\bv_mfma_f32_16x16x16_?bf16(_1k)?\b"),
              "v_mfma_f32_16x16x16_bf16 (the mma experts' bf16 instruction)"),
    },
    # csrc/cuda/attention.cu / csrc/hip/attention.hip always hold the mma profile's attention forward
    # (csrc/gpu/attention_mma_kernels.cuh): its QK^T and PV are the same bf16 instruction
    "attention": {
        "ptx": (re.compile(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b"),
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (the mma attention's bf16 instruction)"),
        "s": (re.compile(r"\bv_mfma_f32_16x16x16_?bf16(_1k)?\b"),
              "v_mfma_f32_16x16x16_bf16 (the mma attention's bf16 instruction)"),
    },
}


def run_nvcc(log: str, cmd: list[str]) -> int:
    """Runs nvcc (creating its --keep-dir), writes everything it printed to LOG; fails with it on error."""
    if "--keep-dir" in cmd:
        os.makedirs(cmd[cmd.index("--keep-dir") + 1], exist_ok=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log, "w") as f:
        f.write(p.stdout)
    if p.returncode:
        sys.stderr.write(p.stdout)
    return p.returncode


def fatbin_entries(path: str) -> list[tuple[str, int]]:
    """(kind, arch) of every image in the .nv_fatbin section of an ELF object: ("elf", 90) is an sm_90 cubin,
    ("ptx", 80) compute_80 PTX. Layout: a 16-byte header (magic 0xBA55ED50, version, header size, payload size)
    per fatbin, then images, each with its own header: kind (1 PTX, 2 ELF), header size, payload size, ..., arch."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not an ELF64 object")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = secs[shstrndx][4]

    def name(off: int) -> str:
        end = data.index(b"\0", names_off + off)
        return data[names_off + off:end].decode()

    out = []
    for sec in secs:
        if name(sec[0]) != ".nv_fatbin":
            continue
        fb, p = data[sec[4]:sec[4] + sec[5]], 0
        while p + 16 <= len(fb):
            magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", fb, p)
            if magic != 0xBA55ED50:
                break
            q, end = p + hsize, p + hsize + fsize
            while q < end:
                kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", fb, q)
                arch, = struct.unpack_from("<I", fb, q + 28)
                out.append(({1: "ptx", 2: "elf"}.get(kind, f"kind{kind}"), arch))
                q += ehsize + psize
            p = (end + 7) & ~7
    return out


def check_fatbin(obj: str, expect: str, stamp: str) -> int:
    entries = fatbin_entries(obj)
    elf = sorted({a for k, a in entries if k == "elf"})
    ptx = sorted({a for k, a in entries if k == "ptx"})
    got = ",".join(f"sm_{a}" for a in elf) + ";" + ",".join(f"compute_{a}" for a in ptx)
    want_elf, want_ptx = expect.split("+")
    norm = lambda s: {x for x in s.split(",") if x}  # noqa: E731
    if norm(want_elf) != {f"sm_{a}" for a in elf} or norm(want_ptx) != {f"compute_{a}" for a in ptx}:
        print(f"gpu_isa_check: {obj} embeds {got!r}, expected {expect!r}", file=sys.stderr)
        return 1
    with open(stamp, "w") as f:
        f.write(got + "\n")
    return 0


def main() -> int:
    if sys.argv[1] == "nvcc":
        return run_nvcc(sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
    if sys.argv[1] == "fatbin":
        return check_fatbin(*sys.argv[2:5])
    kind, path, stamp = sys.argv[1:4]
    text = open(path, encoding="utf-8", errors="replace").read()
    bad = []
    for rx, what in CHECKS[kind]:
        hits = [m.group(0).strip() for m in rx.finditer(text)]
        if hits:
            bad.append(f"  {what}: {len(hits)} hit(s), e.g. {hits[0]!r}")
    for key, need in REQUIRED.items():
        if key in os.path.basename(path) and kind in need and not need[kind][0].search(text):
            bad.append(f"  missing matrix instruction: {need[kind][1]}")
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
