// model_common.h — what both emulated vendor builds (model_cuda.h, model_hip.h) include first: the system
// headers the kernels may pull in and the device API of the emulation target (simt.h).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

#include "simt.h"
