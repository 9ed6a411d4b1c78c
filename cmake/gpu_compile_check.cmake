# gpu_compile_check.cmake — compile every GPU kernel file for every target arch, on a machine without a GPU
# (CI), and check the emitted code against the numerics contract. Included by CMakeLists.txt when
# -DALIGNED_GPU_COMPILE_CHECK=ON; driven by .ci/gpu_compile_check.sh. Nothing here is linked or run.
#
#   csrc/cuda/*.cu   one nvcc -c per file for every entry of ALIGNED_CUDA_ARCHS (CMakeLists.txt: sm_80, sm_90,
#                    sm_100, sm_120 cubins + compute_80 PTX; the extension's -gencode flags, one front end per NVVM
#                    generation: compute_80 and compute_100), with the exact-numerics flags, --keep (the PTX of
#                    every virtual arch, checked by cmake/gpu_isa_check.py: no .ftz, no ex2/lg2.approx, every
#                    f32/f64 add/sub/mul rounded .rn so ptxas cannot contract it, no f64 fma) and -Xptxas -v
#                    (registers, shared memory, spills per kernel and arch: cuda_<file>.resources.txt). The
#                    object's fatbin is then listed (gpu_isa_check.py fatbin, cuobjdump's --list-elf/--list-ptx
#                    without cuobjdump) and must hold exactly those cubins and PTX.
#   csrc/hip/*.hip   x {gfx942, gfx950}: device-only asm and LLVM IR per arch, checked for v_exp_f32/v_log_f32,
#                    denormal flushing, llvm.fmuladd, f64 fma and fast-math flags, plus the host half as an
#                    object (clang++-22 -x hip --offload-host-only -c: the launchers and kernel stubs). The device
#                    front end and the optimiser run once per file and arch (device-only -emit-llvm -c: the
#                    optimised module as bitcode, use-list order kept); the scanned IR is that module and the
#                    scanned asm is its code generation alone (-x ir, -disable-llvm-passes) — the instructions and
#                    directives of `-S` from the source (tests/cuda/test_gpu_isa_scan.py compares the two),
#                    without a second front end per arch.
#   csrc/torch/backends/cuda.cpp, csrc/torch/register_cuda.cpp (the CUDA key's glue): -fsyntax-only against the
#                    installed torch's headers (the CPU wheel ships c10/cuda headers;
#                    -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE stands in for CUDA torch's config).
#
# Target: gpu_compile_check (not part of `all`). A manifest of what was compiled is written to
# ${CMAKE_BINARY_DIR}/gpu_check/manifest.txt for the summary.

set(ALIGNED_NVCC "/usr/local/bin/nvcc" CACHE FILEPATH "nvcc used by the GPU compile check")
if(NOT EXISTS "${ALIGNED_NVCC}")
  find_program(ALIGNED_NVCC_FOUND nvcc)
  if(ALIGNED_NVCC_FOUND)
    set(ALIGNED_NVCC "${ALIGNED_NVCC_FOUND}")
  endif()
endif()
if(CMAKE_HIP_COMPILER)
  set(ALIGNED_HIP_CLANG "${CMAKE_HIP_COMPILER}")  # a ROCm build checks with the compiler it builds with
else()
  find_program(ALIGNED_HIP_CLANG NAMES clang++-22 clang++-19)
endif()
# The extension's own target lists (CMakeLists.txt "GPU targets"); a CUDA / ROCm build checks what it builds.
set(ALIGNED_CUDA_CHECK_ARCHS "${ALIGNED_CUDA_ARCHS}")
set(ALIGNED_HIP_CHECK_ARCHS ${ALIGNED_HIP_ARCHS})

set(_gc_dir "${CMAKE_BINARY_DIR}/gpu_check")
file(MAKE_DIRECTORY "${_gc_dir}")
set(_gc_outputs)
set(_gc_manifest)
set(_isa_check "${CMAKE_CURRENT_SOURCE_DIR}/cmake/gpu_isa_check.py")
file(GLOB _gc_gpu_headers CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/*" "${CMAKE_CURRENT_SOURCE_DIR}/csrc/common/*.h")

# ---- CUDA --------------------------------------------------------------------------------------------
file(GLOB _gc_cu CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu")
if(EXISTS "${ALIGNED_NVCC}")
  # The extension's own flags (CMakeLists.txt) plus whatever the user's build adds (CMAKE_CUDA_FLAGS[_<CONFIG>],
  # CUDAFLAGS): the check scans what the real build would emit. ALIGNED_GPU_CHECK_EXTRA_FLAGS plants a flag
  # (tests/cuda/test_gpu_isa_scan.py).
  string(TOUPPER "${CMAKE_BUILD_TYPE}" _cfg)
  separate_arguments(_user_cuda_all NATIVE_COMMAND "$ENV{CUDAFLAGS} ${CMAKE_CUDA_FLAGS} ${CMAKE_CUDA_FLAGS_${_cfg}}")
  # Target selection is the check's own (-arch per checked arch): drop the build's -gencode / -arch options; and
  # --threads / -t (the check passes its own; a second one would only draw nvcc's redefinition warning).
  set(_user_cuda)
  set(_skip_next FALSE)
  foreach(_f IN LISTS _user_cuda_all)
    if(_skip_next)
      set(_skip_next FALSE)
    elseif(_f MATCHES "^(-gencode|--generate-code|-arch|--gpu-architecture|-code|--gpu-code|-t|--threads)$")
      set(_skip_next TRUE)
    elseif(NOT _f MATCHES "^(-gencode|--generate-code|-arch|--gpu-architecture|-code|--gpu-code|-t|--threads)=")
      list(APPEND _user_cuda "${_f}")
    endif()
  endforeach()
  set(_nvcc_flags -std=c++17 -O3 ${_user_cuda} ${ALIGNED_CUDA_EXACT_FLAGS} -Xcompiler -ffp-contract=off
      ${ALIGNED_GPU_CHECK_EXTRA_FLAGS})
  aligned_cuda_gencode_flags(_gencode "${ALIGNED_CUDA_CHECK_ARCHS}")
  set(_elf)
  set(_ptx_archs)
  foreach(_a IN LISTS ALIGNED_CUDA_CHECK_ARCHS)
    string(REGEX REPLACE "-(real|virtual)$" "" _n "${_a}")
    if(NOT _a MATCHES "-virtual$")
      list(APPEND _elf "sm_${_n}")
    endif()
    if(NOT _a MATCHES "-real$")
      list(APPEND _ptx_archs "compute_${_n}")
    endif()
  endforeach()
  # every virtual arch nvcc runs (one per distinct compute_NN): its PTX is kept and checked
  set(_virtual)
  foreach(_f IN LISTS _gencode)
    string(REGEX MATCH "arch=compute_[0-9]+[af]?" _m "${_f}")
    string(REPLACE "arch=" "" _m "${_m}")
    list(APPEND _virtual "${_m}")
  endforeach()
  list(REMOVE_DUPLICATES _virtual)
  string(REPLACE ";" "," _elf_csv "${_elf}")
  string(REPLACE ";" "," _ptx_csv "${_ptx_archs}")
  # --threads 0: nvcc runs the front ends (cicc, one per NVVM generation) and ptxas side by side, one thread per CPU (the fatbin check
  # below still finds every image; only the order of the -Xptxas -v lines in the resources file may vary, each
  # kernel's lines stay together). attention.cu's steps one after another are ~140 CPU s (2 front ends ~15 s, one per
  # NVVM generation, + 4 x ptxas 23-29 s: nvcc --time), and it ends the check. The whole check on 2 cores (session 40):
  # 261 s wall / 514 CPU s with one front end per arch, 226 s / 441 CPU s with one per generation.
  foreach(src IN LISTS _gc_cu)
    get_filename_component(_name "${src}" NAME_WE)
    set(_obj "${_gc_dir}/cuda_${_name}.o")
    set(_keep "${_gc_dir}/cuda_${_name}.keep")
    set(_res "${_gc_dir}/cuda_${_name}.resources.txt")
    set(_ptxs)
    list(LENGTH _virtual _n_virtual)
    foreach(_v IN LISTS _virtual)
      if(_n_virtual EQUAL 1)
        # one virtual arch (a device build for its own GPU, TORCH_CUDA_ARCH_LIST=9.0): nvcc --keep names the PTX
        # <name>.ptx; the arch suffix appears only when it emits several
        list(APPEND _ptxs "${_keep}/${_name}.ptx")
      else()
        list(APPEND _ptxs "${_keep}/${_name}.${_v}.ptx")
      endif()
    endforeach()
    add_custom_command(OUTPUT "${_obj}" "${_res}" ${_ptxs}
      COMMAND "${Python_EXECUTABLE}" "${_isa_check}" nvcc "${_res}" --
              "${ALIGNED_NVCC}" ${_nvcc_flags} ${_gencode} --threads 0 -Xptxas -v --keep --keep-dir "${_keep}" -c "${src}"
              -o "${_obj}"
      DEPENDS "${src}" ${_gc_gpu_headers} "${_isa_check}" COMMENT "nvcc ${ALIGNED_CUDA_CHECK_ARCHS}: ${_name}.cu" VERBATIM)
    foreach(_v IN LISTS _virtual)
      if(_n_virtual EQUAL 1)
        set(_ptx "${_keep}/${_name}.ptx")
      else()
        set(_ptx "${_keep}/${_name}.${_v}.ptx")
      endif()
      set(_ok "${_gc_dir}/cuda_${_name}.${_v}.ptx.ok")
      add_custom_command(OUTPUT "${_ok}"
        COMMAND "${Python_EXECUTABLE}" "${_isa_check}" ptx "${_ptx}" "${_ok}"
        DEPENDS "${_obj}" "${_isa_check}" COMMENT "numerics check (PTX) ${_v}: ${_name}.cu" VERBATIM)
      list(APPEND _gc_outputs "${_ok}")
    endforeach()
    set(_fat "${_gc_dir}/cuda_${_name}.fatbin.txt")
    add_custom_command(OUTPUT "${_fat}"
      COMMAND "${Python_EXECUTABLE}" "${_isa_check}" fatbin "${_obj}" "${_elf_csv}+${_ptx_csv}" "${_fat}"
      DEPENDS "${_obj}" "${_isa_check}" COMMENT "fatbin of cuda_${_name}.o: ${_elf_csv} + PTX ${_ptx_csv}" VERBATIM)
    list(APPEND _gc_outputs "${_obj}" "${_fat}")
    foreach(_e IN LISTS _elf)
      list(APPEND _gc_manifest "cuda ${_e} csrc/cuda/${_name}.cu")
    endforeach()
    foreach(_e IN LISTS _ptx_archs)
      list(APPEND _gc_manifest "cuda ${_e}(PTX) csrc/cuda/${_name}.cu")
    endforeach()
  endforeach()
else()
  message(WARNING "GPU compile check: nvcc not found (${ALIGNED_NVCC}); CUDA kernels are NOT compile-checked")
  list(APPEND _gc_manifest "SKIPPED cuda (no nvcc)")
endif()

# ---- HIP ---------------------------------------------------------------------------------------------
file(GLOB _gc_hip CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/hip/*.hip")
if(ALIGNED_HIP_CLANG)
  set(_hip_archs ${ALIGNED_HIP_CHECK_ARCHS})
  if(ALIGNED_HIP_CLANG MATCHES "clang\\+\\+-19$")
    # clang-19 stops at gfx942 (shared/notes/build.md): check what it can and say so loudly.
    list(REMOVE_ITEM _hip_archs gfx950)
    message(WARNING "GPU compile check: clang-22 not found, using ${ALIGNED_HIP_CLANG}; gfx950 is SKIPPED")
    list(APPEND _gc_manifest "SKIPPED hip gfx950 (clang-19 has no gfx950)")
  endif()
  # Debian's HIP headers (libamdhip64-dev) still read __AMDGCN_WAVEFRONT_SIZE, which clang-22 no longer
  # predefines; gfx942 and gfx950 are wave64. A ROCm toolchain with matching headers does not need this.
  string(TOUPPER "${CMAKE_BUILD_TYPE}" _cfg)
  separate_arguments(_user_hip NATIVE_COMMAND "$ENV{HIPFLAGS} ${CMAKE_HIP_FLAGS} ${CMAKE_HIP_FLAGS_${_cfg}}")
  list(FILTER _user_hip EXCLUDE REGEX "^--offload-arch=")
  if(CMAKE_HIP_COMPILER)
    set(_hip_env)  # ROCm's own clang and headers
  else()
    set(_hip_env --rocm-path=/usr -D__AMDGCN_WAVEFRONT_SIZE=64)  # Debian's clang-22 + libamdhip64-dev (below)
  endif()
  set(_hip_flags -x hip -std=c++20 -O3 -nogpulib ${_hip_env} ${_user_hip} ${ALIGNED_HIP_EXACT_FLAGS}
      ${ALIGNED_GPU_CHECK_EXTRA_FLAGS})
  set(_offload)
  foreach(arch IN LISTS _hip_archs)
    list(APPEND _offload --offload-arch=${arch})
  endforeach()
  # The code generation step (bitcode -> asm, no optimiser) gets the target and the -mllvm options of the user's
  # flags; everything else that shapes the code (target features, denormal and fp modes) is in the module's
  # function attributes.
  set(_hip_cg_mllvm)
  set(_take_next FALSE)
  foreach(_f IN LISTS _user_hip ALIGNED_GPU_CHECK_EXTRA_FLAGS)
    if(_take_next)
      list(APPEND _hip_cg_mllvm -mllvm "${_f}")
      set(_take_next FALSE)
    elseif(_f STREQUAL "-mllvm")
      set(_take_next TRUE)
    endif()
  endforeach()
  foreach(src IN LISTS _gc_hip)
    get_filename_component(_name "${src}" NAME_WE)
    # The host half only (--offload-host-only): the device half of every arch is the -emit-llvm step below, in
    # the extension's own (non-rdc) form. A whole -c compiled each arch's device code a second time (it needed
    # -fgpu-rdc to link without device libraries, -nogpulib), ~90% of this step's time (dense.hip: 18.9 CPU s
    # with both archs' device halves, 1.7 s host only). The device-only flags (denormals, divide/sqrt) are unused
    # on the host side: clang's warning about them is silenced here.
    set(_obj "${_gc_dir}/hip_${_name}.o")
    add_custom_command(OUTPUT "${_obj}"
      COMMAND "${ALIGNED_HIP_CLANG}" ${_hip_flags} ${_offload} --offload-host-only -Wno-unused-command-line-argument
              -c "${src}" -o "${_obj}"
      DEPENDS "${src}" ${_gc_gpu_headers} COMMENT "hip-clang host ${_hip_archs}: ${_name}.hip" VERBATIM)
    list(APPEND _gc_outputs "${_obj}")
    foreach(arch IN LISTS _hip_archs)
      set(_bc "${_gc_dir}/hip_${_name}.${arch}.bc")
      set(_asm "${_gc_dir}/hip_${_name}.${arch}.s")
      set(_ll "${_gc_dir}/hip_${_name}.${arch}.ll")
      # front end + optimiser, once: the optimised device module (-emit-llvm-uselists: the use-list order the
      # code generator of a one-step -S sees, so the asm below is the same code)
      add_custom_command(OUTPUT "${_bc}"
        COMMAND "${ALIGNED_HIP_CLANG}" ${_hip_flags} --offload-arch=${arch} --offload-device-only -emit-llvm -c
                -Xclang -emit-llvm-uselists "${src}" -o "${_bc}"
        DEPENDS "${src}" ${_gc_gpu_headers} COMMENT "hip-clang -emit-llvm ${arch}: ${_name}.hip" VERBATIM)
      # from that module: its text (the IR scan) and its code generation only (the asm scan)
      set(_from_bc "${ALIGNED_HIP_CLANG}" -target amdgcn-amd-amdhsa -mcpu=${arch} -nogpulib -O3 -x ir "${_bc}"
                   -Xclang -disable-llvm-passes)
      add_custom_command(OUTPUT "${_asm}" "${_ll}"
        COMMAND ${_from_bc} ${_hip_cg_mllvm} -S -o "${_asm}"
        COMMAND ${_from_bc} -S -emit-llvm -o "${_ll}"
        DEPENDS "${_bc}" COMMENT "amdgcn codegen ${arch} (asm + IR text): ${_name}.hip" VERBATIM)
      foreach(kind s ll)
        if(kind STREQUAL "s")
          set(_in "${_asm}")
        else()
          set(_in "${_ll}")
        endif()
        add_custom_command(OUTPUT "${_in}.ok"
          COMMAND "${Python_EXECUTABLE}" "${_isa_check}" ${kind} "${_in}" "${_in}.ok"
          DEPENDS "${_in}" "${_isa_check}" COMMENT "numerics check (${kind}) ${arch}: ${_name}.hip" VERBATIM)
        list(APPEND _gc_outputs "${_in}.ok")
      endforeach()
      list(APPEND _gc_manifest "hip ${arch} csrc/hip/${_name}.hip")
    endforeach()
  endforeach()
else()
  message(WARNING "GPU compile check: clang++-22 / clang++-19 not found; HIP kernels are NOT compile-checked")
  list(APPEND _gc_manifest "SKIPPED hip (no clang++-22)")
endif()

# ---- torch glue: syntax only, against the installed torch's headers ------------------------------------
# The CUDA key's glue: the device functions and every family's bodies instantiated for Gpu<CudaDevice>
# (csrc/torch/backends/cuda.cpp) and its registration lines (register_cuda.cpp). -fsyntax-only instantiates the
# explicit instantiations, so every glue body is checked as the CUDA build compiles it.
set(_glue_sources "${CMAKE_CURRENT_SOURCE_DIR}/csrc/torch/backends/cuda.cpp"
                  "${CMAKE_CURRENT_SOURCE_DIR}/csrc/torch/register_cuda.cpp")
set(_cuda_inc "")
if(EXISTS "${ALIGNED_NVCC}")
  get_filename_component(_nvcc_real "${ALIGNED_NVCC}" REALPATH)
  # /usr/local/bin/nvcc is a wrapper script here; the toolkit's headers live in /usr/local/cuda/include.
  foreach(_cand "/usr/local/cuda/include" "${_nvcc_real}/../../include")
    if(EXISTS "${_cand}/cuda_runtime_api.h" AND NOT _cuda_inc)
      set(_cuda_inc "${_cand}")
    endif()
  endforeach()
endif()
if(_cuda_inc AND ALIGNED_BACKEND STREQUAL "cpu")
  set(_inc_flags)
  foreach(d IN LISTS TORCH_INCLUDE_DIRS Python_INCLUDE_DIRS)
    list(APPEND _inc_flags "-I${d}")
  endforeach()
  file(GLOB_RECURSE _gc_glue_headers CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/torch/*.h"
       "${CMAKE_CURRENT_SOURCE_DIR}/csrc/common/*.h" "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/*_api.h"
       "${CMAKE_CURRENT_SOURCE_DIR}/csrc/gpu/launchers.h" "${CMAKE_CURRENT_SOURCE_DIR}/csrc/emu/emulation.h")
  foreach(_glue IN LISTS _glue_sources)
    get_filename_component(_gname "${_glue}" NAME_WE)
    set(_ok "${_gc_dir}/glue_${_gname}.syntax.ok")
    add_custom_command(OUTPUT "${_ok}"
      COMMAND "${CMAKE_CXX_COMPILER}" -std=c++20 -fsyntax-only -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE ${_inc_flags}
              "-I${_cuda_inc}" "${_glue}"
      COMMAND "${CMAKE_COMMAND}" -E touch "${_ok}"
      DEPENDS "${_glue}" ${_gc_glue_headers}
      COMMENT "c++ -fsyntax-only (CPU torch headers): ${_gname}.cpp" VERBATIM)
    list(APPEND _gc_outputs "${_ok}")
    file(RELATIVE_PATH _grel "${CMAKE_CURRENT_SOURCE_DIR}" "${_glue}")
    list(APPEND _gc_manifest "glue syntax ${_grel}")
  endforeach()
else()
  list(APPEND _gc_manifest "SKIPPED glue syntax (needs a CPU torch and the CUDA headers)")
endif()

string(REPLACE ";" "\n" _gc_manifest_text "${_gc_manifest}")
file(WRITE "${_gc_dir}/manifest.txt" "${_gc_manifest_text}\n")
add_custom_target(gpu_compile_check DEPENDS ${_gc_outputs})
