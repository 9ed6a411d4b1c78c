// attention.h — the reduction order of attention (forward and backward) and the paged KV-cache layout,
// written down once. Every attention path (packed varlen training batch, one-shot prefill, chunked
// prefill, decode over a paged cache; CPU, CUDA, HIP) computes each (query row, head) with exactly this
// arithmetic, so a token's output cannot depend on which path, batch, chunking or thread count produced it.
//
// ---- positions -------------------------------------------------------------------------------------
// A query row has an absolute position p in its sequence and sees the keys 0 .. n_keys-1 of that sequence:
//   causal:     n_keys = clamp(p + 1, 0, n_ctx)     (bottom-right aligned: row i of q_len new rows of a
//               sequence of n_ctx keys sits at p = n_ctx - q_len + i, as flash-attn does)
//   non-causal: n_keys = n_ctx
// A row with n_keys = 0 (only possible when q_len > n_ctx) gets out = 0 and lse = -inf (gradients 0).
//
// ---- forward, per (row, head) ---------------------------------------------------------------------
// 1. Score of key j:  s_j = dot(q, k_j) * scale, dot = sequential fma chain over d = 0..D-1 from +0
//    (q and k widened exactly to fp32):  acc = fma(q[d], k_j[d], acc).          [attn_score]
// 2. Keys are consumed in tiles of kAttnTile = 32 keys aligned to absolute position 0 (tile t holds keys
//    [32t, 32t+32) ∩ [0, n_keys)), and tiles are grouped into KV splits of kAttnSplit = 512 keys, also
//    aligned to 0 (split s = tiles 16s .. 16s+15). A row has ceil(n_keys / 512) splits, never an empty one.
// 3. Each split runs an online softmax over its tiles in ascending order, state (m, l, acc[D]) starting at
//    (-inf, 0, 0). Per tile with nv valid keys:                                  [attn_tile_update]
//      mt    = max over j < nv of s_j (sequential, j ascending, starting at -inf)
//      m_new = max(m, mt); mu = (m_new == -inf ? 0 : m_new)
//      alpha = exp_f32(m - mu); p_j = exp_f32(s_j - mu) (p_j = 0 for j >= nv)
//      l     = fma(l, alpha, fold_lanes(p_0..p_31))        (reduce.h halving tree over the 32 lanes)
//      pv[d] = fma chain over j < nv ascending of (p_j, v_j[d]) from +0
//      acc[d]= fma(acc[d], alpha, pv[d]);  m = m_new
// 4. The splits are merged in split order 0, 1, 2, ... with one formula, whatever their number:
//      M = max over s of m_s (ascending); Mu = (M == -inf ? 0 : M); w_s = exp_f32(m_s - Mu)
//      L = fma chain over s ascending of (l_s, w_s) from +0; O[d] = fma chain of (acc_s[d], w_s) from +0
//      out[d] = O[d] / L (0 if L == 0);  lse = M + log_f32(L)   (natural log of the scaled scores)
//    (With one split w_0 = exp_f32(0) = 1 exactly, so the formula is the same for 1 or 16 splits.)
// Splits exist so that long contexts are parallel (across splits) with a result that does not depend on
// how the work was parallelised: the split boundaries are absolute, the merge order is fixed.
//
// ---- backward, per (row, head) --------------------------------------------------------------------
// delta = fma chain over d of (dO[d], O[d]) from +0 (O = the rounded forward output).
// For key j < n_keys: s_j as in the forward (same bits), p_j = exp_f32(s_j - lse),
//   dp_j = fma chain over d of (dO[d], v_j[d]); ds_j = p_j * (dp_j - delta).
// dq[d] = scale * (fma chain over keys j ascending of (ds_j, k_j[d]))
// dk_j[d] = scale * (fma chain over (query row ascending, then q head of the GQA group ascending) of (ds, q[d]))
// dv_j[d] = fma chain over the same (row, head) order of (p_j, dO[d])
// Only rows of the key's own sequence contribute, so gradients do not depend on the batch either.
//
// ---- paged KV cache layout (aligned::reshape_and_cache / aligned::paged_attention) ------------------
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, same dtype as q
// (= vLLM's flash-attn layout: kv_cache[0] / kv_cache[1] of [2, num_blocks, block_size, H_kv, D]).
// Token at absolute position j of sequence b lives in block block_table[b, j / block_size], offset
// j % block_size. reshape_and_cache writes token t to slot = block * block_size + offset (slot_mapping[t];
// -1 = padding, skipped). Any block_size >= 1; the tiles above are independent of block_size.
//
// ---- MLA: latent attention (aligned::mla_attention_varlen / mla_paged_attention / mla_reshape_and_cache) ------
// DeepSeek-V2/V3, Kimi-K2 in the absorbed form: every token has ONE latent KV row c = [c_latent (R dims) ||
// k_rope (D - R dims)] shared by all query heads (R = kv_lora_rank, D - R = qk_rope_head_dim: parameters, e.g.
// 512 + 64), and q = [q_nope W_UK || q_rope] of width D per head. MLA is the attention above with Hkv = 1,
// head_dim = D, K = V = the row, and the outputs' first R dims kept:
//   s_j = dot(q, c_j) * scale over all D dims (step 1's chain); values v_j[d] = c_j[d] for d < R.
// Every output element d is its own chain (steps 3 and 4), so out[d < R] does not depend on the dims >= R that
// a kernel may also compute; lse is the row's as above. Same tiles (32 keys), splits (512 keys), merge order,
// plan (attention_plan with num_kv_heads = 1, head_dim = D) as every other attention path: MLA decode from the
// cache ≡ chunked prefill ≡ prefix hit ≡ the trainer's varlen, bit for bit.
// Backward: the backward above with dO[d] = 0 and O[d] = 0 for d >= R (delta = that padded chain over all D dims:
// each extra step is fma(0, 0, acc), which is acc except that a -0 accumulator becomes +0 — the contract is the
// padded chain, which every backend runs), operands widened exactly to fp32, then
//   dq[d] = round(scale * chain_k) (as above);  dc_j[d] = round(dk_j[d] + dv_j[d]) for d < R (one fp32 add of
//   the fp32 key and value gradients, then one rounding), dc_j[d] = round(dk_j[d]) for d >= R.
// Cache: one row of D values per token, kv_cache [num_blocks, block_size, D] (vLLM's MLA layout), written at
// slot = block * block_size + offset (slot_mapping; -1 skips) as [kv_c || k_pe].
#pragma once

#include "numerics.h"
#include "reduce.h"

namespace aligned {

constexpr int kAttnTile = 32;     // keys per tile (aligned to absolute position 0)
constexpr int kAttnSplit = 512;   // keys per KV split (aligned to absolute position 0)
constexpr int kAttnTilesPerSplit = kAttnSplit / kAttnTile;

ALIGNED_HD float neg_inf_f32() { return -float_of(0x7f800000u); }

// Number of keys a row sees (see "positions").
ALIGNED_HD int64_t attn_row_keys(int64_t p, int64_t n_ctx, bool causal) {
  if (!causal) return n_ctx;
  int64_t n = p + 1;
  if (n < 0) n = 0;
  if (n > n_ctx) n = n_ctx;
  return n;
}
ALIGNED_HD int64_t attn_num_splits(int64_t n_keys) { return (n_keys + kAttnSplit - 1) / kAttnSplit; }

// The paged-KV accessor (host and device): element offset of key/value row j (absolute position in its
// sequence) of KV head g, in packed K/V [Tk, Hkv, D] (blocks == nullptr: row k_begin + j) or in the paged
// cache [num_blocks, block_size, Hkv, D] through the sequence's block-table row. Every backend addresses
// K/V through this one function, so packed and paged paths read the same values for the same position.
struct KvRows {
  int64_t Hkv, D, block_size, k_begin;
  const int32_t* blocks;
  ALIGNED_HD int64_t offset(int64_t j, int64_t g) const {
    if (blocks == nullptr) return ((k_begin + j) * Hkv + g) * D;
    return (((int64_t)blocks[j / block_size] * block_size + j % block_size) * Hkv + g) * D;
  }
};

// Step 1: unscaled dot, one sequential fma chain over d: the same chain as a lane of linear (reduce.h).
template <typename TQ, typename TK>
ALIGNED_HD float attn_dot(const TQ* q, const TK* k, int64_t D) {
  return dot_chain(q, k, D);
}

// Step 3, one tile, in pieces: a GPU computes the per-key values (dot, p_j) one key per lane and the
// per-element values (pv[d], acc[d]) one element per lane, so it calls these pieces directly; the CPU calls
// them through attn_tile_update. Each piece is one expression of the formula above, so both are the same
// arithmetic. (The lane-parallel l sum uses compat.cuh's group_sum_tree, which is fold_lanes exactly.)
ALIGNED_HD float attn_tile_max(const float* s, int nv, float m) {  // m_new
  float mt = neg_inf_f32();
  // j < nv ascending; written with the tile's constant trip count so that a GPU compiler unrolls it and keeps s[] in
  // registers (a loop bounded by nv indexes s[] at run time, which puts it in local memory). Same operations.
  for (int j = 0; j < kAttnTile; ++j)
    if (j < nv) mt = max_f32(mt, s[j]);
  return max_f32(m, mt);
}
ALIGNED_HD float attn_shift(float m_new) { return m_new == neg_inf_f32() ? 0.0f : m_new; }  // mu
ALIGNED_HD float attn_tile_prob(float s_j, int j, int nv, float mu) { return j < nv ? exp_f32(s_j - mu) : 0.0f; }
ALIGNED_HD float attn_tile_l(float l, float alpha, float tile_sum) { return fma_f32(l, alpha, tile_sum); }
// (F: float, or a CPU vector of floats whose lanes are D elements: fma_f32 lane by lane, same bits)
template <typename F>
ALIGNED_HD F attn_pv_step(F p_j, F v_jd, F pv) { return fma_f32(p_j, v_jd, pv); }
template <typename F>
ALIGNED_HD F attn_acc_step(F acc, F alpha, F pv) { return fma_f32(acc, alpha, pv); }

// The probabilities of one tile: p[j] = attn_tile_prob(s[j], j, nv, mu) for j = 0 .. kAttnTile - 1
// (exp_f32(s_j - mu) for j < nv, +0 past nv, whatever s[j] holds there). The scalar form; a vector backend passes
// its own to attn_tile_update (csrc/cpu/simd.h TileProbs: the same operations lane by lane, held to the
// same plain reference by tests/common/simd_conformance.cpp), so the rest of the tile's order exists only here.
struct AttnTileProbs {
  ALIGNED_HD void operator()(const float* s, int nv, float mu, float* p) const {
    for (int j = 0; j < kAttnTile; ++j) p[j] = attn_tile_prob(s[j], j, nv, mu);
  }
};

// m_new of one tile: attn_tile_max, the scalar form; a vector backend passes its own to attn_tile_update (csrc/cpu/
// simd.h TileMax32: the same value and sign on every input, the scalar itself where a NaN or a zero maximum makes
// the fold's order visible), held to this one by tests/common/simd_conformance.cpp.
struct AttnTileMax {
  ALIGNED_HD float operator()(const float* s, int nv, float m) const { return attn_tile_max(s, nv, m); }
};

// Step 3, one tile: s[0..nv) are the scaled scores, v(j) returns a pointer to value row j (fp32 or T).
// State: *m, *l, acc[D]. pv is scratch of D floats. probs(s, nv, mu, p) writes the kAttnTile probabilities
// (AttnTileProbs or a form with its bits); tile_max(s, nv, m) is m_new (AttnTileMax or a form with its bits).
template <typename VRow, typename Probs = AttnTileProbs, typename Max = AttnTileMax>
ALIGNED_HD void attn_tile_update(const float* s, int nv, VRow v, int64_t D, float* m, float* l, float* acc,
                                 float* pv, Probs probs = Probs(), Max tile_max = Max()) {
  const float m_new = tile_max(s, nv, *m);
  const float mu = attn_shift(m_new);
  const float alpha = exp_f32(*m - mu);
  float p[kAttnTile];
  probs(s, nv, mu, p);
  for (int64_t d = 0; d < D; ++d) pv[d] = 0.0f;
  for (int j = 0; j < nv; ++j) {
    const auto* vj = v(j);
    for (int64_t d = 0; d < D; ++d) pv[d] = attn_pv_step(p[j], to_f32(vj[d]), pv[d]);
  }
  const float ts = fold_lanes(p);
  *l = attn_tile_l(*l, alpha, ts);
  for (int64_t d = 0; d < D; ++d) acc[d] = attn_acc_step(acc[d], alpha, pv[d]);
  *m = m_new;
}

// Backward pieces (see "backward"): the probability of a key from its forward score and the row's lse,
// and its score gradient.
ALIGNED_HD float attn_bwd_prob(float s_j, float lse) { return exp_f32(s_j - lse); }
ALIGNED_HD float attn_bwd_ds(float p_j, float dp_j, float delta) { return p_j * (dp_j - delta); }

// Step 4 in pieces (a GPU merges one output element per lane): the statistics M, Mu, L of a row's
// partials, the weight of split s (exp_f32 is deterministic: recomputing w_s gives the same bits as
// storing it), and one output element.
ALIGNED_HD float attn_merge_weight(const float* part, int64_t stride, int64_t s, float Mu) {
  return exp_f32(part[s * stride] - Mu);
}
ALIGNED_HD void attn_merge_stats(const float* part, int64_t stride, int64_t n_splits, float* M_out, float* Mu_out,
                                 float* L_out) {
  float M = neg_inf_f32();
  for (int64_t s = 0; s < n_splits; ++s) M = max_f32(M, part[s * stride]);
  const float Mu = M == neg_inf_f32() ? 0.0f : M;
  float L = 0.0f;
  for (int64_t s = 0; s < n_splits; ++s) L = fma_f32(part[s * stride + 1], attn_merge_weight(part, stride, s, Mu), L);
  *M_out = M;
  *Mu_out = Mu;
  *L_out = L;
}
// (F: float, or a CPU vector of floats whose lanes are D elements: fma_f32 / div_f32 lane by lane, same bits)
template <typename F>
ALIGNED_HD F attn_merge_step(F acc_sd, F w_s, F O) { return fma_f32(acc_sd, w_s, O); }
template <typename F>
ALIGNED_HD F attn_merge_out(F O, float L) { return L == 0.0f ? F(0.0f) : div_f32(O, F(L)); }
ALIGNED_HD float attn_merge_lse(float M, float L) { return M + log_f32(L); }

// Step 4: merge n_splits partials (m_s, l_s, acc_s) laid out as part[s * stride + {0: m, 1: l, 2..: acc}].
// w is scratch for n_splits weights (each w_s is computed once and reused for every d: same bits).
template <typename TO>
ALIGNED_HD void attn_merge(const float* part, int64_t stride, int64_t n_splits, int64_t D, float* w, TO* out,
                           float* lse) {
  float M, Mu, L;
  attn_merge_stats(part, stride, n_splits, &M, &Mu, &L);
  for (int64_t s = 0; s < n_splits; ++s) w[s] = attn_merge_weight(part, stride, s, Mu);
  for (int64_t d = 0; d < D; ++d) {
    float O = 0.0f;
    for (int64_t s = 0; s < n_splits; ++s) O = attn_merge_step(part[s * stride + 2 + d], w[s], O);
    out[d] = from_f32<TO>(attn_merge_out(O, L));
  }
  *lse = attn_merge_lse(M, L);
}

}  // namespace aligned
