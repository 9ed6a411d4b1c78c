// model_common.h — what both emulated vendor builds include before the `gpu` namespace rename of
// model_cuda.h / model_hip.h: every system header the kernels may pull in (so the rename never reaches
// them) and the device API of the emulation target.
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
