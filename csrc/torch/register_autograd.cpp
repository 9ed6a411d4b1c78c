// register_autograd.cpp — the Autograd and ADInplaceOrView kernels of the ops that write into their arguments (the
// schemas' Tensor(a!) in bindings.cpp: the KV-cache writes and the attention planner's buffers). Backend-independent
// keys, so one registration for every backend; the op list is checked against the schemas by
// tests/common/test_glue_structure.py (every writing op here, nothing else).
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <vector>

namespace {

// ADInplaceOrView kernel of the ops that write into arguments (Tensor(a!)) and return nothing: runs the op, then bumps
// the version counter of each written tensor, as torch's own in-place ops do. (torch's boxed
// autogradNotImplementedInplaceOrViewFallback bumps only written tensors that are also returned.)
void bump_written_arguments(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    const c10::IValue& value = (*stack)[first + i];
    if (alias != nullptr && alias->isWrite() && value.isTensor()) written.push_back(value.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  // An inference tensor has no version counter (and cannot have been saved for backward): nothing to bump. (Outside
  // inference mode the key runs for it too: bumping would raise after the write.)
  for (const at::Tensor& t : written)
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

// Autograd kernel of the same ops: they have no derivative, so a call that autograd would have to record (grad mode on
// and a tensor argument that requires grad: a leaf written in place, or values that would carry a history into the
// cache) is refused by name; otherwise the op runs below autograd, through the ADInplaceOrView kernel above.
void refuse_grad_through_writes(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  if (at::GradMode::is_enabled()) {
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::IValue& value = (*stack)[first + i];
      TORCH_CHECK(!value.isTensor() || !value.toTensor().requires_grad(), "aligned::", op.schema().name().substr(9),
                  ": ", args[i].name(), " requires grad, but the op writes into its arguments and has no backward "
                  "(call it under torch.no_grad() or torch.inference_mode())");
    }
  }
  at::AutoDispatchBelowAutograd guard;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

constexpr const char* kWritingOps[] = {"reshape_and_cache", "mla_reshape_and_cache", "attention_plan"};

}  // namespace

// The ops that write into their arguments (the caches, the plan buffers) behave as torch's own in-place ops under
// autograd. ADInplaceOrView: each written tensor's version counter is bumped, so autograd refuses a backward that
// saved the tensor before the write ("modified by an inplace operation") instead of silently using the new values,
// and the exact profile's packed-weight cache (keyed on _version) sees the write. Autograd: a call with a tensor that
// requires grad (in grad mode) is refused by name: these ops have no derivative. Inside inference mode the Autograd
// key is skipped and a normal tensor is still bumped (vLLM 0.32 allocates its KV cache outside inference mode and
// writes it inside: one counter increment per write); an inference tensor is written without a bump, inside inference
// mode or not.
TORCH_LIBRARY_IMPL(aligned, ADInplaceOrView, m) {
  for (const char* op : kWritingOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written_arguments>());
}
TORCH_LIBRARY_IMPL(aligned, Autograd, m) {
  for (const char* op : kWritingOps)
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_grad_through_writes>());
}
