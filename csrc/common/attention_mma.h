// attention_mma.h — attention under the `mma` numerics profile (issue 27): its forward and backward order, once.
// attention.h is the `fma` contract (fp32 fma chains: CPU == CUDA == HIP); this file changes ONLY its two matrix
// products, which run on the GPU's bf16 matrix instruction (mma.h "the GPU units": mma.sync m16n8k16 bf16 on
// CUDA, v_mfma_f32_16x16x16_bf16 on HIP; one STEP = the unit's fused dot of 16 products onto the fp32 C). Every
// other step — the 32-key tiles and the 512-key KV splits aligned to absolute position 0, the online softmax with
// exp_f32, the fold of l, the split merge — is attention.h's, called through its helpers (never copied).
//
// ---- the profile (aligned::attention_varlen / paged_attention with profile = "mma") ------------------------
// q, k, v in bfloat16 (the unit's input type; float16 / float32 are refused by name: converting would be a
// second, hidden rounding of the model — use profile "fma"). Per (query row, head), attention.h steps 1-4 with:
//   1'. s_j = attn_mma_dot(q, k_j) * scale: the unit's block chain (mma.h mma_block_chain) over d in blocks of 16,
//       ascending, from C = +0 (a head_dim that is not a multiple of 16 pads its last block with q = k = +0),
//       then ONE fp32 multiply by scale.
//   3'. in each tile, after attention.h's m_new, mu, alpha, p_j (fp32; p_j = +0 for j >= nv) and
//       l = fma(l, alpha, fold_lanes(p_0..p_31)) (the fp32 p — l is not a matrix product):
//         P_j   = round_bf16(p_j)                         (round to nearest even; P_j = +0 for j >= nv)
//         pv[d] = the unit's chain over the tile's 2 key-blocks of 16 (keys 0..15, then 16..31), from C = +0:
//                 A = the row's P_0..P_31, B = column d of the tile's V rows WITH EVERY KEY j >= nv AS +0
//         acc[d] = fma(acc[d], alpha, pv[d])              (attention.h attn_acc_step)
//       Out and lse: attention.h step 4 unchanged (fp32 merge of the splits, one rounding of out to bf16).
// What a masked key contributes (j >= nv: the row's causal future, or past its context's end): the product
// (+0) x (+0), in both operands, so its value never reaches the unit. This is stated on purpose, and is stronger
// than "p = +0": the unit's models (csrc/emu/bf16_mma_models.h, MMA-Sim's characterisation) align a step's terms
// to the LARGEST product exponent, and a zero operand counts with exponent -126 — (+0) x v has exponent -126 +
// e(v), so a large finite v of a masked key would move the alignment and change the row's other terms' bits
// (+0 x v is NOT neutral on these units). The V operand of one instruction is shared by its 16 rows, so a kernel
// whose rows mask different keys of a tile (the causal diagonal in prefill) issues the tile's PV once per
// distinct nv among the rows, each with V cut at that nv, and keeps for each row the pass of its own nv (each D
// element of the unit depends only on its A row, its B column and its C: the other rows of a pass cannot change
// it). A non-finite value of a masked key therefore poisons nothing (unlike FlashAttention's kernels, where
// 0 x inf = NaN reaches every row of the tile); the score of a masked key (from a non-finite k) is never read.
// Decode packs the GQA group's query heads of a KV head into the instruction's rows (rows are independent as
// above), so a (row, head) gets the same bits whichever rows share its instructions.
//
// INVARIANT (on one GPU model and build; the emulator: one arch and mma_model): batch size and composition,
// the row's position in the batch, other rows and sequences, chunked vs one-shot prefill, prefill vs decode vs a
// prefix-cache hit (paged, part cached), packed vs paged K/V and the block size, the thread-block schedule, the
// KV-split parallelism (absolute split boundaries, fixed merge), the run.
// NOT INVARIANT: across GPU models / vendors / generations (the unit's STEP differs: A100 vs H100 vs MI300X),
// against the `fma` profile (other bits, same math), against another head_dim padding. There is NO CPU kernel of
// this profile: the CPU backend refuses mma attention by name (the CPU's mma profile covers linear, the LM head
// and MoE experts only); the emulated backend runs the GPU kernel (csrc/gpu/attention_mma_kernels.cuh) and holds
// it to attn_mma_row_reference below with the arch's unit model (aligned::_attention_mma_reference).
//
// ---- backward (aligned::attention_varlen_backward with profile = "mma"; packed K/V) ------------------------------
// Per sequence and KV head g, the pairs e = (new row r ascending, then query head h of the group ascending), as
// attention.h's backward; n_e = the keys row r sees. With the forward's lse and the bf16 forward output O:
//   delta_e = attention.h's fma chain over d of (dO_e, O_e)                         (not a matrix product)
//   s_ej    = attn_mma_dot(q_e, k_j) * scale (the forward's bits), dp_ej = attn_mma_dot(dO_e, v_j) (the unit's
//             chain over head_dim), for j < n_e
//   p_ej    = attn_bwd_prob(s_ej, lse_e), ds_ej = attn_bwd_ds(p_ej, dp_ej, delta_e) (fp32);
//   P_ej = round_bf16(p_ej), dS_ej = round_bf16(ds_ej); both +0 for j >= n_e
//   dq_e[d] = round(scale * chain over the key-blocks of 16 (keys 16b .. 16b+15) with b < ceil(n_e / 16), ascending,
//             from +0, of (dS_e., k_.[d]))
//   dk_j[d] = round(scale * chain over the pair-blocks of 16 (pairs 16b .. 16b+15) that hold a pair seeing key j,
//             ascending, from +0, of (dS_.j, q_.[d]));   dv_j[d] = round(the same chain of (P_.j, dO_.[d]))
// where, as in the forward, a masked element (j >= n_e) is +0 in BOTH operands (a kernel issues one pass per
// distinct mask among an instruction's rows). dq is batch-invariant row by row; dk / dv depend on the sequence's
// own rows (fixed blocks, fixed order: deterministic, run-to-run and schedule invariant), never on other sequences.
#pragma once

#include "attention.h"
#include "mma.h"

#include <vector>  // the host references below

namespace aligned {

// The numerics profile of an attention call (AttnProblem::profile).
enum AttnProfile : int { kAttnProfileFma = 0, kAttnProfileMma = 1 };

constexpr int kAttnMmaKeyBlocks = kAttnTile / kMmaGpuKBlock;  // key-blocks of 16 per 32-key tile: 2
static_assert(kAttnTile % kMmaGpuKBlock == 0, "a tile is whole key-blocks");

// Step 1': the unscaled score, the unit's chain over head_dim (mma.h mma_block_chain).
template <class Step>
ALIGNED_HD float attn_mma_dot(const bf16_t* q, const bf16_t* k, int64_t D, const Step& step) {
  return mma_block_chain(q, 1, k, 1, 0, D, step);
}

// Step 3': the bf16 P operand of a probability.
ALIGNED_HD bf16_t attn_mma_prob(float p) { return from_f32<bf16_t>(p); }

// Step 3': pv[d] of one row over one tile: P the row's 32 bf16 probabilities, v(j) key j's value row (bf16),
// keys j >= nv as +0 in both operands.
template <class VRow, class Step>
ALIGNED_HD float attn_mma_pv(const bf16_t* P, VRow v, int nv, int64_t d, const Step& step) {
  float acc = 0.0f;
  for (int b = 0; b < kAttnMmaKeyBlocks; ++b) {
    uint16_t pb[kMmaGpuKBlock], vb[kMmaGpuKBlock];
    for (int e = 0; e < kMmaGpuKBlock; ++e) {
      const int j = b * kMmaGpuKBlock + e;
      pb[e] = j < nv ? P[j].bits : (uint16_t)0;
      vb[e] = j < nv ? v(j)[d].bits : (uint16_t)0;
    }
    acc = step(acc, pb, vb);
  }
  return acc;
}

// Step 3' for one tile (the scalar reference's form): s[0..nv) the scaled scores; state *m, *l, acc[D].
template <class VRow, class Step>
ALIGNED_HD void attn_mma_tile_update(const float* s, int nv, VRow v, int64_t D, float* m, float* l, float* acc,
                                     const Step& step) {
  const float m_new = attn_tile_max(s, nv, *m);
  const float mu = attn_shift(m_new);
  const float alpha = exp_f32(*m - mu);
  float p[kAttnTile];
  bf16_t P[kAttnTile];
  for (int j = 0; j < kAttnTile; ++j) {
    p[j] = attn_tile_prob(s[j], j, nv, mu);
    P[j] = attn_mma_prob(p[j]);
  }
  *l = attn_tile_l(*l, alpha, fold_lanes(p));
  for (int64_t d = 0; d < D; ++d) acc[d] = attn_acc_step(acc[d], alpha, attn_mma_pv(P, v, nv, d, step));
  *m = m_new;
}

// The whole forward of one (row, head) — the reference every kernel variant is held to, bit for bit. q: the row's
// D values; kv: its sequence's K/V rows (attention.h KvRows, packed or paged) of KV head g; n_keys: the keys it
// sees (attention.h attn_row_keys). part: scratch of attn_num_splits(n_keys) * (D + 2) floats, w: of as many
// splits. Splits, tiles and the merge are attention.h's.
template <class Step>
inline void attn_mma_row_reference(const bf16_t* q, const bf16_t* K, const bf16_t* V, const KvRows& kv, int64_t g,
                                   int64_t n_keys, int64_t D, float scale, const Step& step, float* part, float* w,
                                   bf16_t* out, float* lse) {
  const int64_t ns = attn_num_splits(n_keys), stride = D + 2;
  for (int64_t sp = 0; sp < ns; ++sp) {
    float* st = part + sp * stride;
    float m = neg_inf_f32(), l = 0.0f;
    for (int64_t d = 0; d < D; ++d) st[2 + d] = 0.0f;
    const int64_t end = n_keys < (sp + 1) * kAttnSplit ? n_keys : (sp + 1) * kAttnSplit;
    for (int64_t j0 = sp * kAttnSplit; j0 < end; j0 += kAttnTile) {
      const int nv = (int)(end - j0 < kAttnTile ? end - j0 : kAttnTile);
      float s[kAttnTile];
      for (int j = 0; j < kAttnTile; ++j)
        s[j] = j < nv ? attn_mma_dot(q, K + kv.offset(j0 + j, g), D, step) * scale : 0.0f;
      const auto vrow = [&](int j) { return V + kv.offset(j0 + j, g); };
      attn_mma_tile_update(s, nv, vrow, D, &m, &l, st + 2, step);
    }
    st[0] = m;
    st[1] = l;
  }
  attn_merge(part, stride, ns, D, w, out, lse);
}

// The unit's chain over blocks of 16 elements (element e = 16 b + i) for the blocks b < n_blocks whose live(b)
// holds, ascending, from C = +0; a(e) / b(e) the operands' bit patterns (+0 where masked, the caller's).
template <class AOf, class BOf, class Live, class Step>
ALIGNED_HD float attn_mma_chain(int64_t n_blocks, const AOf& a, const BOf& b, const Live& live, const Step& step) {
  float acc = 0.0f;
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    if (!live(blk)) continue;
    uint16_t ab[kMmaGpuKBlock], bb[kMmaGpuKBlock];
    for (int i = 0; i < kMmaGpuKBlock; ++i) {
      ab[i] = a(blk * kMmaGpuKBlock + i);
      bb[i] = b(blk * kMmaGpuKBlock + i);
    }
    acc = step(acc, ab, bb);
  }
  return acc;
}

// (Host only, and hidden from nvcc: its front end (EDG, nvcc 13.0) stops with an internal error ("il.c",
// i_copy_expr_tree) on this template's nested lambdas; the references run in the host library, never in a kernel.)
#if !defined(__CUDACC__)
// The backward of one (sequence, KV head g) — the reference of the mma backward kernels. Packed K/V (rows k_begin +
// j, [Tk, Hkv, D]); q, dO, O: [Tq, Hq, D] from row q_begin; lse [Tq, Hq]. Writes dq of the group's rows and dk, dv of
// the group's keys (bf16). Host only (scratch vectors).
template <class Step>
inline void attn_mma_backward_reference(const bf16_t* q, const bf16_t* K, const bf16_t* V, const bf16_t* dO,
                                        const bf16_t* O, const float* lse, int64_t q_begin, int64_t q_len,
                                        int64_t k_begin, int64_t n_ctx, int64_t Hq, int64_t Hkv, int64_t D,
                                        int64_t g, bool causal, float scale, const Step& step, bf16_t* dq,
                                        bf16_t* dk, bf16_t* dv) {
  const int64_t G = Hq / Hkv, P = q_len * G;
  const auto qrow = [&](int64_t e) { return ((q_begin + e / G) * Hq + g * G + e % G); };  // (row, head) index
  const auto krow = [&](int64_t j) { return ((k_begin + j) * Hkv + g) * D; };
  const auto nkeys = [&](int64_t e) { return attn_row_keys(n_ctx - q_len + e / G, n_ctx, causal); };
  std::vector<bf16_t> Pm((size_t)(P * n_ctx)), dS((size_t)(P * n_ctx));
  for (int64_t e = 0; e < P; ++e) {
    const int64_t i = qrow(e), n = nkeys(e);
    const float delta = attn_dot(dO + i * D, O + i * D, D);
    for (int64_t j = 0; j < n_ctx; ++j) {
      float pj = 0.0f, dsj = 0.0f;
      if (j < n) {
        const float s = attn_mma_dot(q + i * D, K + krow(j), D, step) * scale;
        const float dp = attn_mma_dot(dO + i * D, V + krow(j), D, step);
        pj = attn_bwd_prob(s, lse[i]);
        dsj = attn_bwd_ds(pj, dp, delta);
      }
      Pm[(size_t)(e * n_ctx + j)] = j < n ? attn_mma_prob(pj) : bf16_t{0};
      dS[(size_t)(e * n_ctx + j)] = j < n ? attn_mma_prob(dsj) : bf16_t{0};
    }
  }
  const auto all = [](int64_t) { return true; };
  for (int64_t e = 0; e < P; ++e) {
    const int64_t i = qrow(e), n = nkeys(e);
    for (int64_t d = 0; d < D; ++d) {
      const float acc = attn_mma_chain(
          (n + kMmaGpuKBlock - 1) / kMmaGpuKBlock,
          [&](int64_t j) { return j < n ? dS[(size_t)(e * n_ctx + j)].bits : (uint16_t)0; },
          [&](int64_t j) { return j < n ? K[krow(j) + d].bits : (uint16_t)0; }, all, step);
      dq[i * D + d] = from_f32<bf16_t>(acc * scale);
    }
  }
  const int64_t pair_blocks = (P + kMmaGpuKBlock - 1) / kMmaGpuKBlock;
  for (int64_t j = 0; j < n_ctx; ++j) {
    const auto sees = [&](int64_t e) { return e < P && j < nkeys(e); };
    const auto live = [&](int64_t b) {
      for (int64_t e = b * kMmaGpuKBlock; e < (b + 1) * kMmaGpuKBlock; ++e)
        if (sees(e)) return true;
      return false;
    };
    for (int64_t d = 0; d < D; ++d) {
      const float ak = attn_mma_chain(
          pair_blocks, [&](int64_t e) { return sees(e) ? dS[(size_t)(e * n_ctx + j)].bits : (uint16_t)0; },
          [&](int64_t e) { return sees(e) ? q[qrow(e) * D + d].bits : (uint16_t)0; }, live, step);
      const float av = attn_mma_chain(
          pair_blocks, [&](int64_t e) { return sees(e) ? Pm[(size_t)(e * n_ctx + j)].bits : (uint16_t)0; },
          [&](int64_t e) { return sees(e) ? dO[qrow(e) * D + d].bits : (uint16_t)0; }, live, step);
      dk[krow(j) + d] = from_f32<bf16_t>(ak * scale);
      dv[krow(j) + d] = from_f32<bf16_t>(av);
    }
  }
}

#endif  // !__CUDACC__

}  // namespace aligned
