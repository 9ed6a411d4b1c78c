// emulated_glue_prelude.h — what ops_emulated_{cuda,hip}.cpp include before renaming the `gpu` namespace and
// including the GPU glue: every header ops_cuda.cpp uses (so the rename never reaches torch's headers).
#pragma once
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include <string.h>

#include <string>
#include <vector>

#include "../attention_checks.h"
#include "../op_checks.h"
#include "../op_params.h"
#include "emulation.h"

#define ALIGNED_EMULATED_GLUE 1
