// registration.h — how a backend registers an op family: one line per family,
//
//   register_family<Dense, Cpu, EmulatedCuda, EmulatedHip>(m);   // csrc/torch/register_cpu.cpp
//   register_family<Dense, Cuda>(m);                             // csrc/torch/register_cuda.cpp
//
// A family (csrc/torch/glue/<family>.h) is a struct whose `ops<B>` lists, for any backend B, every schema of
// the family with its one glue body instantiated for B. register_family registers each op under the dispatch
// key of `m` with the first backend's body; further backends are alternatives that take over while they are
// selected() — the emulated GPUs on the CPU key: under aligned_ops.emulate(arch) the CPU key runs the body
// instantiated for Emulated<arch's vendor>, otherwise for Cpu (vLLM's torch_bindings.cpp registers per
// op; the list per family instantiated per backend is flash-attention's "one template, generated
// instantiations").
//
// register_family is declared here and defined in registration_impl.h: the registration files see only this
// declaration, and each (family, backends) instantiation is compiled in the backend's own translation unit,
// next to its run functions (csrc/torch/backends/*.cpp: `template void register_family<...>(torch::Library&);`),
// so the families build in parallel. A line without its instantiation fails at link time, naming it.
#pragma once

#include <torch/library.h>

#include "families.h"

namespace aligned::glue {

// One entry of a family's op list: the schema's name (csrc/torch/bindings.cpp) and the op's glue body for
// one backend.
template <class Fn>
struct Op {
  const char* name;
  Fn* body;
};
template <class Fn>
Op(const char*, Fn*) -> Op<Fn>;

template <class Family, class Backend, class... Alternatives>
void register_family(torch::Library& m);

}  // namespace aligned::glue
