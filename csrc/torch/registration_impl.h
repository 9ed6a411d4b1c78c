// registration_impl.h — the definition of register_family (registration.h), included only by the translation
// units that instantiate it (a backend's *.cpp beside its run functions).
#pragma once

#include <array>
#include <tuple>
#include <type_traits>
#include <utility>

#include "registration.h"

namespace aligned::glue {

namespace registration_detail {

// One op's implementation under a dispatch key: the default backend's body, or the first alternative's whose
// backend is selected() at the call (an atomic load per alternative: nothing else is added to a call). The
// bodies are instantiations of one template, so their C++ signatures are equal by construction.
template <class Fn, size_t N>
struct SelectedBody;
template <class R, class... A, size_t N>
struct SelectedBody<R(A...), N> {
  R (*fallback)(A...);
  std::array<bool (*)(), N> selected;
  std::array<R (*)(A...), N> bodies;
  R operator()(A... a) const {
    for (size_t i = 0; i < N; ++i)
      if (selected[i]()) return bodies[i](std::forward<A>(a)...);
    return fallback(std::forward<A>(a)...);
  }
};

// Op I of the family: the default backend's body, or a SelectedBody over it and the alternatives' bodies.
template <size_t I, class Family, class Backend, class... Alternatives>
void register_op(torch::Library& m) {
  constexpr auto op = std::get<I>(Family::template ops<Backend>);
  if constexpr (sizeof...(Alternatives) == 0) {
    m.impl(op.name, op.body);
  } else {
    using Fn = std::remove_pointer_t<decltype(op.body)>;
    static_assert((std::is_same_v<decltype(op.body), decltype(std::get<I>(Family::template ops<Alternatives>).body)> &&
                   ...),
                  "an op's glue bodies must have one signature on every backend");
    m.impl(op.name, SelectedBody<Fn, sizeof...(Alternatives)>{op.body,
                                                               {&Alternatives::selected...},
                                                               {std::get<I>(Family::template ops<Alternatives>).body...}});
  }
}

template <class Family, class Backend, class... Alternatives, size_t... I>
void register_ops(torch::Library& m, std::index_sequence<I...>) {
  (register_op<I, Family, Backend, Alternatives...>(m), ...);
}

}  // namespace registration_detail

template <class Family, class Backend, class... Alternatives>
void register_family(torch::Library& m) {
  constexpr size_t n = std::tuple_size_v<std::remove_const_t<decltype(Family::template ops<Backend>)>>;
  static_assert(((std::tuple_size_v<std::remove_const_t<decltype(Family::template ops<Alternatives>)>> == n) && ...),
                "a family lists the same ops for every backend");
  registration_detail::register_ops<Family, Backend, Alternatives...>(m, std::make_index_sequence<n>{});
}

}  // namespace aligned::glue
