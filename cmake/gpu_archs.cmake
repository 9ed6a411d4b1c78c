# gpu_archs.cmake — which GPU targets a build compiles for (CMakeLists.txt "GPU targets" says why these).
#
# aligned_select_cuda_archs(OUT): CMAKE_CUDA_ARCHITECTURES entries ("90-real", "80-virtual", "90a-real").
#   Precedence: -DCMAKE_CUDA_ARCHITECTURES=... (also CMake's CUDAARCHS environment variable), then torch's
#   TORCH_CUDA_ARCH_LIST ("8.0 9.0", "9.0;10.0+PTX", "9.0a"), then ALIGNED_CUDA_ARCHS_DEFAULT. Must run before
#   enable_language(CUDA), which fills CMAKE_CUDA_ARCHITECTURES with the compiler's default.
# aligned_select_hip_archs(OUT): -DALIGNED_HIP_ARCHS, then PYTORCH_ROCM_ARCH, then ALIGNED_HIP_ARCHS_DEFAULT.
# aligned_cuda_gencode_flags(OUT ARCHS): nvcc -gencode flags for a list of CMAKE_CUDA_ARCHITECTURES entries; the
#   extension (CUDA_ARCHITECTURES OFF on _C) and the compile check both compile with them. One virtual arch per NVVM
#   generation: every plain real arch compiles from the PTX of the oldest plain real arch of its generation.
# aligned_strip_gencode_flags(VAR): removes -gencode / -arch / -code options from a flags string.

function(aligned_torch_arch_to_cmake out torch_list)
  string(REPLACE " " ";" _items "${torch_list}")
  set(_res)
  foreach(_it IN LISTS _items)
    if(_it STREQUAL "")
      continue()
    endif()
    set(_ptx FALSE)
    if(_it MATCHES "\\+PTX$")
      set(_ptx TRUE)
      string(REGEX REPLACE "\\+PTX$" "" _it "${_it}")
    endif()
    if(NOT _it MATCHES "^([0-9]+)\\.([0-9]+)([af]?)$")
      message(FATAL_ERROR "TORCH_CUDA_ARCH_LIST entry '${_it}' is not MAJOR.MINOR[a|f][+PTX]")
    endif()
    set(_cc "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    list(APPEND _res "${_cc}-real")
    if(_ptx)
      list(APPEND _res "${_cc}-virtual")
    endif()
  endforeach()
  set(${out} "${_res}" PARENT_SCOPE)
endfunction()

function(aligned_select_cuda_archs out)
  # A value CMake cached itself (enable_language(CUDA) without a list caches nvcc's default, sm_75 for nvcc 13, with
  # the help string "CUDA architectures") is not a user's choice: a re-configure of the same build folder (scikit-
  # build-core reuses build/{wheel_tag}) would otherwise silently target it instead of TORCH_CUDA_ARCH_LIST.
  get_property(_doc CACHE CMAKE_CUDA_ARCHITECTURES PROPERTY HELPSTRING)
  if(_doc STREQUAL "CUDA architectures")
    unset(CMAKE_CUDA_ARCHITECTURES CACHE)
    unset(CMAKE_CUDA_ARCHITECTURES)
  endif()
  if(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT CMAKE_CUDA_ARCHITECTURES STREQUAL "")
    set(_archs "${CMAKE_CUDA_ARCHITECTURES}")
    set(_why "CMAKE_CUDA_ARCHITECTURES")
  elseif(DEFINED ENV{CUDAARCHS} AND NOT "$ENV{CUDAARCHS}" STREQUAL "")
    set(_archs "$ENV{CUDAARCHS}")
    set(_why "CUDAARCHS")
  elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    aligned_torch_arch_to_cmake(_archs "$ENV{TORCH_CUDA_ARCH_LIST}")
    set(_why "TORCH_CUDA_ARCH_LIST=$ENV{TORCH_CUDA_ARCH_LIST}")
  else()
    set(_archs "${ALIGNED_CUDA_ARCHS_DEFAULT}")
    set(_why "default")
  endif()
  foreach(_a IN LISTS _archs)
    string(REGEX MATCH "^[0-9]+" _n "${_a}")
    if(_n LESS 80)
      message(FATAL_ERROR "aligned_ops: CUDA target ${_a} (from ${_why}) is older than sm_80: the exact and mma "
                          "linears use sm_80's integer / bf16 mma.sync")
    endif()
  endforeach()
  set(${out} "${_archs}" PARENT_SCOPE)
  set(${out}_REASON "${_why}" PARENT_SCOPE)
endfunction()

function(aligned_select_hip_archs out)
  if(DEFINED ALIGNED_HIP_ARCHS AND NOT ALIGNED_HIP_ARCHS STREQUAL "")
    set(_archs "${ALIGNED_HIP_ARCHS}")
  elseif(DEFINED ENV{PYTORCH_ROCM_ARCH} AND NOT "$ENV{PYTORCH_ROCM_ARCH}" STREQUAL "")
    string(REPLACE " " ";" _archs "$ENV{PYTORCH_ROCM_ARCH}")
  else()
    set(_archs "${ALIGNED_HIP_ARCHS_DEFAULT}")
  endif()
  set(${out} "${_archs}" PARENT_SCOPE)
endfunction()

# nvcc 13 runs two NVVM generations: NVVM 7 for compute_75..compute_90 and NVVM 20 for compute_100 and later. Within
# one generation the PTX of our sources is the same for every compute_NN (only its .target line differs): no source
# of ours tests the arch it is compiled for (tests/cuda/test_gpu_sources.py keeps it so), and the front end and NVVM
# make the same PTX. So every plain real arch compiles from its generation's first supported PTX: below 100 from
# compute_80's, from 100 on from compute_100's. One front end per generation instead of one per arch, and ptxas gets
# the PTX it got from the arch's own front end — with nvcc 13.0 and these sources the machine code of all five files
# was byte-identical both ways (bench/RESULTS.md, session 40). The bases are fixed, not the list's oldest arch, so a
# build for one GPU (TORCH_CUDA_ARCH_LIST=9.0: the lease build of .ci/gpu_check.sh) compiles that GPU's cubin exactly
# as the wheel does, with one ptxas. The identity is a measurement, not a guarantee: a vendor header's sm_90-only path
# (cuda_bf16.hpp has some), or another nvcc (the wheels allow >= 12.8, whose generations may split elsewhere), could
# make the arch's own PTX differ. The grouping stays correct then (compute_80 PTX is valid for every later arch, and
# compute_100 PTX for every arch from 100 on). The default list becomes
#   -gencode=arch=compute_80,code=[sm_80,sm_90,compute_80] -gencode=arch=compute_100,code=[sm_100,sm_120]
# An arch-specific target (90a, 100a, 100f) keeps its own front end: its features exist only in its own PTX; so does
# PTX asked for another virtual arch (TORCH_CUDA_ARCH_LIST "12.0+PTX" embeds compute_120).
function(aligned_cuda_gencode_flags out archs)
  set(_old)      # plain real archs of NVVM 7 (< 100)
  set(_new)      # plain real archs of NVVM 20 (>= 100)
  set(_virtual)  # PTX to embed
  set(_flags)
  foreach(_a IN LISTS archs)
    if(_a MATCHES "^([0-9]+)(-real)?$")
      if(CMAKE_MATCH_1 LESS 100)
        list(APPEND _old "${CMAKE_MATCH_1}")
      else()
        list(APPEND _new "${CMAKE_MATCH_1}")
      endif()
      if(NOT CMAKE_MATCH_2)
        list(APPEND _virtual "${CMAKE_MATCH_1}")  # "90": CMake's real + virtual
      endif()
    elseif(_a MATCHES "^([0-9]+[af])-real$")
      list(APPEND _flags "-gencode=arch=compute_${CMAKE_MATCH_1},code=sm_${CMAKE_MATCH_1}")
    elseif(_a MATCHES "^([0-9]+[af]?)-virtual$")
      list(APPEND _virtual "${CMAKE_MATCH_1}")
    elseif(_a MATCHES "^([0-9]+[af])$")
      list(APPEND _flags "-gencode=arch=compute_${CMAKE_MATCH_1},code=[sm_${CMAKE_MATCH_1},compute_${CMAKE_MATCH_1}]")
    else()
      message(FATAL_ERROR "CUDA architecture '${_a}' is not NN[a|f][-real|-virtual]")
    endif()
  endforeach()
  set(_grouped)
  # each generation's PTX: its first supported arch (aligned_select_cuda_archs refuses anything older than 80)
  foreach(_base IN ITEMS 80 100)
    if(_base EQUAL 80)
      set(_reals "${_old}")
    else()
      set(_reals "${_new}")
    endif()
    if(NOT _reals)
      continue()
    endif()
    list(REMOVE_DUPLICATES _reals)
    list(SORT _reals COMPARE NATURAL)
    set(_codes)
    foreach(_r IN LISTS _reals)
      list(APPEND _codes "sm_${_r}")
    endforeach()
    list(FIND _virtual "${_base}" _i)
    if(_i GREATER -1)  # the base's own PTX is wanted too: same front end
      list(APPEND _codes "compute_${_base}")
      list(REMOVE_ITEM _virtual "${_base}")
    endif()
    string(REPLACE ";" "," _codes "${_codes}")
    list(APPEND _grouped "-gencode=arch=compute_${_base},code=[${_codes}]")
  endforeach()
  list(REMOVE_DUPLICATES _virtual)
  foreach(_v IN LISTS _virtual)
    list(APPEND _grouped "-gencode=arch=compute_${_v},code=compute_${_v}")
  endforeach()
  set(${out} ${_grouped} ${_flags} PARENT_SCOPE)
endfunction()

function(aligned_strip_gencode_flags var)
  set(_v "${${var}}")
  string(REGEX REPLACE "(-gencode|--generate-code)[ =]+[^ ]+" "" _v "${_v}")
  string(REGEX REPLACE "(^| )(-arch|--gpu-architecture|-code|--gpu-code)[ =]+[^ ]+" " " _v "${_v}")
  string(REGEX REPLACE "  +" " " _v "${_v}")
  set(${var} "${_v}" PARENT_SCOPE)
endfunction()
