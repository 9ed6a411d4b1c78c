"""DeepSeek-V3 trainer attention: ABSORBED (latent) vs EXPANDED MLA form (issue 26 item 4) — FLOPs and time.

Times one layer's attention as the HF trainer patch runs it (``models.deepseek_v3.absorbed_attention`` vs
``attention``: q/kv down-projections, norms, rope, kv_b_proj or the absorbed per-head projections, the aligned
attention op; o_proj excluded — both forms run the same one) on packed causal sequences, forward and
forward+backward, and prints the analytic FLOPs of each form with the ratio (the quadratic part per query-key pair
and head: expanded 2·(d_nope + d_rope) + 2·(d_nope + d_rope) [v zero-padded to d_qk], absorbed 2·(R + d_rope)
+ 2·R; DeepSeek-V3's dims give ~3.4x against the unpadded expanded 2·192 + 2·128). Ratios are same-run; note the
load average printed next to them.

    PYTHONPATH=python nice -n 10 python bench/bench_mla_trainer_forms.py [--full]   # --full: DeepSeek-V3 head dims
"""

import argparse
import os
import time

import torch

import aligned_ops  # noqa: F401
from aligned_ops import profiles
from aligned_ops.integrations.hf import TRAINER_SIDE, _ForwardContext, _ForwardPlans
from aligned_ops.models import deepseek_v3 as ds
from aligned_ops.rope import cos_sin_cache, rope_spec_from_hf_config


def flops(T_pairs, T, H, dn, dr, dv, R, qr, hidden):
    """(expanded, expanded without v padding, absorbed) multiply-add FLOPs x2 of one layer's attention part."""
    down = 2 * T * hidden * (qr + R + dr) + 2 * T * qr * H * (dn + dr)
    exp = down + 2 * T * R * H * (dn + dv) + T_pairs * H * (2 * (dn + dr) + 2 * (dn + dr))
    exp_unpadded = down + 2 * T * R * H * (dn + dv) + T_pairs * H * (2 * (dn + dr) + 2 * dv)
    absorbed = down + 2 * T * H * dn * R + T_pairs * H * (2 * (R + dr) + 2 * R) + 2 * T * H * R * dv
    return exp, exp_unpadded, absorbed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="DeepSeek-V3's head dims (R=512, d_nope=128, d_rope=64)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lens", type=str, default="128,96")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    dims = (dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=384,
                 hidden_size=512) if a.full else
            dict(kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=96,
                 hidden_size=256))
    cfg = DeepseekV3Config(num_attention_heads=a.heads, num_key_value_heads=a.heads, rope_interleave=True,
                           max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                           "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                           "mscale": 1.0, "mscale_all_dim": 1.0}, **dims)
    attn = DeepseekV3Attention(cfg, 0).float()
    lens = [int(x) for x in a.lens.split(",")]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    ctx = _ForwardContext(pos, cu, cos_sin_cache(rope_spec_from_hf_config(cfg)), _ForwardPlans(cu, "cpu"),
                          profiles.FMA)
    rules = ds.RULES
    x = torch.randn(T, cfg.hidden_size) * 0.5

    def run(fn, backward):
        xi = x.clone().requires_grad_(backward)
        out = fn(ds.ARCHITECTURE, TRAINER_SIDE, ctx, attn, xi, rules)
        if backward:
            out.sum().backward()
        return out

    rows = []
    for backward in (False, True):
        t = {}
        for name, fn in (("expanded", ds.attention), ("absorbed", ds.absorbed_attention)):
            ctx_grad = torch.enable_grad() if backward else torch.no_grad()
            with ctx_grad:
                run(fn, backward)
                best = float("inf")
                for _ in range(a.repeat):
                    t0 = time.perf_counter()
                    run(fn, backward)
                    best = min(best, time.perf_counter() - t0)
            t[name] = best
        rows.append((("fwd+bwd" if backward else "fwd"), t))
    # the attention op alone, on the shapes each form hands it (expanded: Hq KV heads of d_qk, v zero-padded;
    # absorbed: one latent row of R + d_rope, values its first R dims)
    H, dqk, D = a.heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    qe, ke, ve = (torch.randn(T, H, dqk) for _ in range(3))
    qa, kva = torch.randn(T, H, D), torch.randn(T, D)
    for backward in (False, True):
        t = {}
        for name, make in (("expanded", lambda: TRAINER_SIDE.attention(ctx, attn, *args, 0.1)),
                           ("absorbed", lambda: TRAINER_SIDE.mla_attention(ctx, attn, *args, cfg.kv_lora_rank, 0.1))):
            best = float("inf")
            for _ in range(a.repeat + 1):
                args = [x.clone().requires_grad_(backward) for x in ((qe, ke, ve) if name == "expanded" else (qa, kva))]
                with torch.enable_grad() if backward else torch.no_grad():
                    t0 = time.perf_counter()
                    out = make()
                    if backward:
                        out.sum().backward()
                    best = min(best, time.perf_counter() - t0)
            t[name] = best
        rows.append((("op fwd+bwd" if backward else "op fwd"), t))
    pairs = sum(n * (n + 1) // 2 for n in lens)
    fe, fe_u, fa = flops(pairs, T, a.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank, cfg.q_lora_rank, cfg.hidden_size)
    R, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    print(f"dims: H={a.heads} R={R} d_nope={dn} d_rope={dr} d_v={dv} hidden={cfg.hidden_size} lens={lens} "
          f"threads=1 load={os.getloadavg()}")
    print(f"per (query, key, head) pair FLOPs: expanded {2 * (dn + dr) + 2 * dv} (+{2 * (dn + dr - dv)} v padding),"
          f" absorbed {2 * (R + dr) + 2 * R}: ratio {(2 * (R + dr) + 2 * R) / (2 * (dn + dr) + 2 * dv):.2f}x "
          f"(vs padded {(2 * (R + dr) + 2 * R) / (4 * (dn + dr)):.2f}x)")
    print(f"layer attention FLOPs (fwd): expanded {fe / 1e6:.1f}M (unpadded v {fe_u / 1e6:.1f}M), absorbed "
          f"{fa / 1e6:.1f}M: ratio {fa / fe_u:.2f}x vs unpadded, {fa / fe:.2f}x vs padded")
    print("time (best of --repeat, 1 thread): 'fwd' = the layer's attention part (projections, rope, op), 'op' = "
          "the attention op alone")
    for label, t in rows:
        print(f"{label:10s} expanded {t['expanded'] * 1e3:8.2f} ms  absorbed {t['absorbed'] * 1e3:8.2f} ms  "
              f"time ratio absorbed/expanded {t['absorbed'] / t['expanded']:.2f}x")


if __name__ == "__main__":
    main()
