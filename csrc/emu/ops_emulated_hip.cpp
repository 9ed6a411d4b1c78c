// ops_emulated_hip.cpp — the GPU glue (csrc/cuda/ops_cuda.cpp, which serves ROCm torch too) compiled for the
// emulated HIP build of csrc/gpu (csrc/emu/model_hip.h): same argument checks, params and launcher calls,
// CPU tensors, launchers in aligned::gpu_emu_hip, registered into glue_registry(Vendor::kHip).
#include "emulated_glue_prelude.h"
#define ALIGNED_EMULATED_VENDOR ::aligned::emu::Vendor::kHip
#define gpu gpu_emu_hip
#include "../cuda/ops_cuda.cpp"
#include "../cuda/ops_attention_cuda.cpp"  // the attention family's GPU glue
