// bindings.cpp — every op schema, declared once, by family, and the Python module entry point.
// Backends register implementations with one line per family (csrc/torch/register_<key>.cpp: each family's ops
// and their one glue body, csrc/torch/glue/<family>.h); fake (meta) implementations and autograd live in
// python/aligned_ops/ops/.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(aligned, m) {
  // linear: the `fma` profile (csrc/common/contract.h): K cut into 8 lanes by the floor rule, one fp32 fma
  // chain per lane, the fixed tree ((0+1)+(2+3))+((4+5)+(6+7)), + bias once, rounded once to x's dtype.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // linear_partial: x [..., K_local], weight [N, K_local] (same dtype), lanes ∈ {1, 2, 4, 8} -> fp32 [..., N]:
  // the sub-tree of the 8-lane tree over `lanes` whole lanes, where the LOCAL K is cut into `lanes` lanes by the
  // same floor rule (lane j = [floor(j*K_local/lanes), floor((j+1)*K_local/lanes))). No bias, no rounding.
  // A rank r of a t-way row-parallel layer (t ∈ {1,2,4,8}) passes lanes = 8/t and its K slice
  // [floor(r*K/t), floor((r+1)*K/t)) (aligned_ops.linear_tp_slices; exact for every t when K % 8 == 0); the
  // t rank partials folded adjacent pairs first (aligned_ops.tree_combine), + bias, rounded, equal linear
  // bit for bit. lanes = 8 on the full K is linear before its bias and rounding. No backward (raises).
  m.def("linear_partial(Tensor x, Tensor weight, int lanes) -> Tensor");
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
  m.def(
      "logsumexp_backward(Tensor grad, Tensor logits, float temperature=1.0, Tensor? temperatures=None) -> Tensor");
  m.def(
      "log_softmax_backward(Tensor grad, Tensor logits, float temperature=1.0, Tensor? temperatures=None) -> "
      "Tensor");
  // ---- fused LM head (python/aligned_ops/ops/lm_head.py): the pieces and the op ----
  // token_logprobs_pairs: token_logprobs plus the rows' (m, L) pairs (contract.h LsePair) as fp32 [T, 2].
  m.def(
      "token_logprobs_pairs(Tensor logits, Tensor token_ids, float temperature=1.0, Tensor? temperatures=None) -> "
      "(Tensor logprobs, Tensor lse_pairs)");
  // token_logprobs_backward_cols: token_logprobs_backward on the column tile logits = z[:, vocab_start :
  // vocab_start + n] of rows with the given pairs; token_ids are absolute (in [0, vocab_size)).
  m.def(
      "token_logprobs_backward_cols(Tensor grad, Tensor logits, Tensor token_ids, Tensor lse_pairs, int vocab_start, "
      "int vocab_size, float temperature=1.0, Tensor? temperatures=None) -> Tensor");
  // fused_token_logprobs: token_logprobs(linear(hidden, weight, bias), token_ids, temperature) bit for bit, forward
  // and gradient, without the [T, V] logits: token chunks of full rows (forward, d hidden), vocabulary chunks of
  // all tokens (d weight, d bias). Returns (logprobs [T] fp32, lse_pairs [T, 2] fp32). Composed of aligned ops.
  m.def(
      "fused_token_logprobs(Tensor hidden, Tensor weight, Tensor? bias, Tensor token_ids, float temperature=1.0, "
      "Tensor? temperatures=None, int token_chunk=0, int vocab_chunk=0) -> (Tensor logprobs, Tensor lse_pairs)");
  m.def(
      "fused_token_logprobs_backward(Tensor grad, Tensor hidden, Tensor weight, Tensor? bias, Tensor token_ids, "
      "Tensor lse_pairs, float temperature, Tensor? temperatures, int token_chunk, int vocab_chunk, "
      "bool needs_hidden_grad, bool needs_weight_grad, bool needs_bias_grad) -> (Tensor, Tensor, Tensor)");
  // ---- attention (csrc/common/attention.h; planner csrc/common/attention_plan.h) ----
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
      "bool causal=True, str profile=\"fma\") -> (Tensor out, Tensor lse)");
  // _attention_mma_reference: attention_mma.h's scalar reference of the mma profile's forward (a test hook: under
  // aligned_ops.emulate(arch, mma_model=...) the arch's unit model; refused elsewhere).
  m.def(
      "_attention_mma_reference(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, "
      "bool causal=True) -> (Tensor out, Tensor lse)");
  m.def(
      "_attention_mma_backward_reference(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal=True) -> (Tensor dq, Tensor dk, Tensor dv)");
  // plan_info: the info of the plan the forward ran (attention_varlen_planned): the backward refuses offsets that
  // plan was not made from.
  m.def(
      "attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, float scale, bool causal, Tensor? plan_info=None, "
      "str profile=\"fma\") -> "
      "(Tensor dq, Tensor dk, Tensor dv)");
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, str profile=\"fma\") -> Tensor");
  // Plan/run form (CUDA-graph safe; csrc/common/attention_plan.h; aligned_ops.AttentionPlan). attention_plan plans
  // once from HOST metadata (block_table None: packed, query_start_loc = cu_seqlens_q, kv_lens = cu_seqlens_k; else
  // paged, kv_lens = seq_lens) into caller-owned buffers: plan and plan_table on the run's device, plan_info on the
  // host (the plan's info, FlashInfer's plan_info). Each run form takes the three back: it checks the call against
  // plan_info on the host (heads, head_dim, rows — exactly q's —, capacities; attention_varlen_planned also its
  // cu_seqlens against the offsets the plan was made from), then reads only the buffers (no host-to-device copy, no
  // read of device memory, fixed grids; the split partials take workspace_floats, a capacity, never a data value),
  // and equals the per-call form bit for bit. attention_plan_layout gives the buffers' sizes for a capacity,
  // attention_plan_size what a plan of some metadata needs (host; CPU kernel only).
  m.def(
      "attention_plan(Tensor(a!) plan, Tensor(b!) plan_table, Tensor(c!) plan_info, Tensor query_start_loc, "
      "Tensor kv_lens, Tensor? block_table, int num_heads, int num_kv_heads, int head_dim, bool causal=True, "
      "int num_cache_blocks=0, int block_size=0, int workspace_floats=0) -> ()");
  m.def(
      "attention_plan_size(Tensor query_start_loc, Tensor kv_lens, Tensor? block_table, int num_heads, "
      "int num_kv_heads, int head_dim, bool causal=True, int num_cache_blocks=0, int block_size=0) -> int[]");
  m.def("attention_plan_layout(int capacity) -> int[]");  // [plan rows, plan columns, plan_info length]
  m.def(
      "attention_varlen_planned(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor plan, "
      "Tensor plan_info, int workspace_floats, float scale, bool causal=True, str profile=\"fma\") -> (Tensor out, "
      "Tensor lse)");
  m.def(
      "paged_attention_planned(Tensor q, Tensor k_cache, Tensor v_cache, Tensor plan, Tensor plan_table, "
      "Tensor plan_info, int workspace_floats, float scale, str profile=\"fma\") -> Tensor");
  // MLA, latent attention (csrc/common/attention.h "MLA"): one shared KV row per token, kv = [latent || k_rope]
  // of width D = kv_lora_rank + rope_dim, as the one KV head of the attention above (keys: the whole row; values:
  // its first kv_lora_rank dims). q [T, H, D] (absorbed: [q_nope W_UK || q_rope]), out [T, H, kv_lora_rank];
  // kv_cache [num_blocks, block_size, D] (vLLM's MLA layout). The plan of the planned forms: attention_plan with
  // num_kv_heads = 1, head_dim = D; the backward's plan_info: the forward's plan (its offsets are checked).
  m.def(
      "mla_attention_varlen(Tensor q, Tensor kv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int kv_lora_rank, "
      "float scale, bool causal=True) -> (Tensor out, Tensor lse)");
  m.def(
      "mla_attention_varlen_backward(Tensor grad_out, Tensor q, Tensor kv, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int kv_lora_rank, float scale, bool causal, "
      "Tensor? plan_info=None) -> (Tensor dq, Tensor dkv)");
  m.def(
      "mla_attention_varlen_planned(Tensor q, Tensor kv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor plan, "
      "Tensor plan_info, int workspace_floats, int kv_lora_rank, float scale, bool causal=True) -> (Tensor out, "
      "Tensor lse)");
  m.def("mla_reshape_and_cache(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def(
      "mla_paged_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
      "int kv_lora_rank, float scale) -> Tensor");
  m.def(
      "mla_paged_attention_planned(Tensor q, Tensor kv_cache, Tensor plan, Tensor plan_table, Tensor plan_info, "
      "int workspace_floats, int kv_lora_rank, float scale) -> Tensor");
  // The contract's scalar math, exposed elementwise so tests can check it against float64 and backends
  // against each other (fp32 in, fp32 out).
  m.def("_exp_f32(Tensor x) -> Tensor");
  m.def("_log_f32(Tensor x) -> Tensor");
  // The GPU ops check data values in the kernel (no host sync); their per-device error words, read and cleared
  // by aligned_ops.check_device_errors() (csrc/gpu/dense_api.h DeviceError). CPU: always zeros.
  m.def("_device_error_flags(Tensor like) -> Tensor");
  // moe family (csrc/common/moe.h; glue csrc/torch/glue/moe.h; fakes + autograd python/aligned_ops/ops/moe.py)
  m.def(
      "moe_routing(Tensor router_logits, int top_k, str scoring=\"softmax\", bool renormalize=True) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "moe_routing_backward(Tensor grad_weights, Tensor? grad_scores, Tensor router_logits, Tensor topk_ids, "
      "str scoring, bool renormalize) -> Tensor");
  // linear_profile: the experts' projections under "fma" (contract.h) or "mma" (mma.h: bf16, the matrix unit).
  m.def(
      "moe_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2, Tensor? shared_w13=None, "
      "Tensor? shared_w2=None, Tensor? shared_gate=None, str linear_profile=\"fma\") -> Tensor");
  // Gradients of moe_experts wrt (x, topk_weights, w13, w2, shared_w13, shared_w2, shared_gate); the shared ones
  // are empty tensors without a shared expert / gate. Implemented from other aligned ops
  // (python/aligned_ops/ops/moe.py).
  m.def(
      "moe_experts_backward(Tensor grad_out, Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2, "
      "Tensor? shared_w13=None, Tensor? shared_w2=None, Tensor? shared_gate=None, str linear_profile=\"fma\") -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Grouped sigmoid routing with a correction bias (DeepSeek-V3 noaux_tc, Kimi-K2 with n_group=1; moe.h "grouped
  // sigmoid routing"): (weights fp32 [T, k], ids int64 [T, k], scores fp32 [T, E]); the bias gets no gradient.
  m.def(
      "moe_grouped_routing(Tensor router_logits, Tensor? correction_bias, int top_k, int n_group=1, "
      "int topk_group=1, bool renormalize=True, float routed_scaling_factor=1.0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "moe_grouped_routing_backward(Tensor grad_weights, Tensor? grad_scores, Tensor router_logits, "
      "Tensor topk_ids, bool renormalize, float routed_scaling_factor) -> Tensor");
  m.def(
      "_moe_experts_reference(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2, "
      "Tensor? shared_w13=None, Tensor? shared_w2=None, Tensor? shared_gate=None) -> Tensor");

  // exact profile (csrc/common/exact_linear.h): integer digit products, one rounding; the weight is packed once.
  m.def("linear_exact(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("linear_exact_pack_weight(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_exact_packed(Tensor x, Tensor weight_digits, Tensor weight_exponents, Tensor weight_nonfinite, "
      "int out_features, Tensor? bias=None, int k_parts=1, Tensor? weight=None, Tensor? weight_f64_bounds=None) -> Tensor");
  m.def("_linear_exact_reference(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // the CPU fp64 path (exact_linear.h): per weight row its bound b (int32 [N], once per weight version, like the
  // digits); linear_exact_packed given the weight and these takes the path for row pairs meeting bx + bw <= 53
  m.def("linear_exact_f64_bounds(Tensor weight) -> Tensor");
  // test hook: which (x row, weight row) pairs meet that bound (bool [M, N])
  m.def("_linear_exact_f64_pairs(Tensor x, Tensor weight_f64_bounds) -> Tensor");
  // test hook: the route of each output under ALIGNED_EXACT_F64=all (0 fp64 path, 1 split route, 2 digit path)
  m.def("_linear_exact_f64_routes(Tensor x, Tensor weight, Tensor weight_f64_bounds) -> Tensor");
  // tensor parallelism (exact_linear.h, "tensor parallelism"): per-row scans of a K slice (int32 [R, 3], merged over
  // ranks by an elementwise MAX), the weight slice packed against the merged scans, a rank's exact integer
  // partials (int64 [.., N, 2]: summed over ranks by an integer SUM), and the one rounding + epilogue.
  m.def("linear_exact_row_scan(Tensor v) -> Tensor");
  m.def("linear_exact_pack_weight_scanned(Tensor weight, Tensor row_scan) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_exact_partial(Tensor x, Tensor weight_digits, Tensor weight_exponents, Tensor weight_nonfinite, "
      "int out_features, Tensor x_scan) -> Tensor");
  m.def(
      "linear_exact_finish(Tensor partial, Tensor x_scan, Tensor weight_exponents, Tensor weight_nonfinite, "
      "Tensor? bias, ScalarType dtype) -> Tensor");

  // contract.h's scalar linear_partial_dot (CPU only, slow): the conformance reference of the GEMM kernels.
  m.def("_linear_partial_reference(Tensor x, Tensor weight, int lanes) -> Tensor");

  // mma profile (csrc/common/mma.h): the matrix unit's bf16 instruction in the fma profile's 8 lanes and tree
  // (the CPU: AVX512-BF16 vdpbf16ps). bfloat16 x, weight, bias only; same bits on one unit whatever the batch,
  // tiling, threads or TP degree. linear_mma_partial: the sub-tree over `lanes` lanes of the local K, fp32, no
  // bias (TP row-parallel, finished by aligned_ops.tree_all_reduce as linear_partial is). linear_mma_backward: dx,
  // dw on the unit (8 lanes over N / over the M tokens), db fp32 chains.
  m.def("linear_mma(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("linear_mma_partial(Tensor x, Tensor weight, int lanes) -> Tensor");
  m.def(
      "linear_mma_backward(Tensor grad_out, Tensor x, Tensor weight, bool needs_x_grad, bool needs_w_grad, "
      "bool needs_b_grad) -> (Tensor, Tensor, Tensor)");
  // mma.h's scalar model of the CPU unit (any CPU, slow): the conformance reference of the mma kernels.
  m.def("_linear_mma_reference(Tensor x, Tensor weight, int lanes) -> Tensor");
  // The CPU AMX unit's packed weights (csrc/cpu/gemm_amx_mma_kernels.cpp): linear_mma_pack_weight packs once (the
  // rollout engine's registered weights, cached by aligned_ops.linear_mma), linear_mma_packed = linear_mma reading
  // the packing instead of the weight's rows (the same bits). Refused on any other unit.
  m.def("linear_mma_pack_weight(Tensor weight) -> Tensor");
  m.def("linear_mma_packed(Tensor x, Tensor weight, Tensor packed, Tensor? bias=None) -> Tensor");

  // ---- diagnostics and control ops without tensor arguments ----
  // Their kernels are registered as catch-all (TORCH_LIBRARY_IMPL(aligned, CatchAll, m)) next to the backend
  // that implements them: a no-tensor op has no dispatch key to select a backend by.
  m.def("_cpu_isa() -> str");    // the CPU ISA level chosen once (csrc/cpu/cpu_backend.h; backends/cpu_dense.cpp)
  m.def("_exact_unit() -> str");  // the exact linear's CPU unit: amx / avx512-vnni / avx2-madd / generic (cpu_exact.cpp)
  m.def("_cpu_mma_unit() -> str");  // the CPU's mma unit: "avx512_bf16", or "" (none: the mma ops refuse) (cpu_mma.cpp)
  // aligned_ops.emulate (csrc/torch/backends/emulated.cpp): enter/leave an emulated GPU arch, its launch records,
  // the emulated archs, the SIMT runtime's self-test kernels.
  m.def("_emulate_enter(str arch, int fault=0, int mma_model=0) -> ()");
  m.def("_emulate_exit() -> str[]");
  m.def("_emulated_archs() -> str[]");
  m.def("_emulate_selftest(str name) -> int[]");
}

// A bare module: the ops register themselves with the dispatcher when the library is loaded.
static struct PyModuleDef aligned_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&aligned_module); }
