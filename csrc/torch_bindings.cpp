// torch_bindings.cpp — every dense op schema, declared once, and the Python module entry point.
// Backends register implementations with TORCH_LIBRARY_IMPL (csrc/cpu/ops_cpu.cpp, csrc/cuda/ops_cuda.cpp);
// fake (meta) implementations and autograd live in python/aligned_ops/_dense.py. Attention schemas are a
// TORCH_LIBRARY_FRAGMENT in csrc/cpu/ops_attention_cpu.cpp.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(aligned, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def(
      "linear_backward(Tensor grad_out, Tensor x, Tensor weight, bool needs_x_grad, bool needs_w_grad, "
      "bool needs_b_grad) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_backward(Tensor grad_out, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("silu_and_mul_backward(Tensor grad_out, Tensor x) -> Tensor");
  m.def(
      "rotary_embedding(Tensor positions, Tensor x, Tensor cos_sin_cache, int rotary_dim, bool is_neox) -> "
      "Tensor");
  m.def(
      "rotary_embedding_backward(Tensor positions, Tensor grad_out, Tensor cos_sin_cache, int rotary_dim, "
      "bool is_neox) -> Tensor");
  m.def("logsumexp(Tensor logits, float temperature=1.0, Tensor? temperatures=None) -> Tensor");
  m.def("log_softmax(Tensor logits, float temperature=1.0, Tensor? temperatures=None) -> Tensor");
  m.def(
      "token_logprobs(Tensor logits, Tensor token_ids, float temperature=1.0, Tensor? temperatures=None) -> "
      "Tensor");
  m.def(
      "token_logprobs_backward(Tensor grad, Tensor logits, Tensor token_ids, float temperature=1.0, "
      "Tensor? temperatures=None) -> Tensor");
  // The contract's scalar math, exposed elementwise so tests can check it against float64 and backends
  // against each other (fp32 in, fp32 out).
  m.def("_exp_f32(Tensor x) -> Tensor");
  m.def("_log_f32(Tensor x) -> Tensor");
  // exact profile (csrc/common/exact_linear.h): integer digit products, one rounding; the weight is packed once.
  m.def("linear_exact(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("linear_exact_pack_weight(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_exact_packed(Tensor x, Tensor weight_digits, Tensor weight_exponents, Tensor weight_nonfinite, "
      "int out_features, Tensor? bias=None, int k_parts=1) -> Tensor");
  m.def("_linear_exact_reference(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

// A bare module: the ops register themselves with the dispatcher when the library is loaded.
static struct PyModuleDef aligned_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&aligned_module); }
