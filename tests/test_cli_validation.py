"""`aligned-ops` refuses bad flags and model folders up front: one line on stderr, exit status 2, no
traceback, before any engine starts (issue 8: `demo --steps 0` failed after both vLLM runs, `--lag -1` with an
IndexError, `verify --model /nonexistent` with a Hugging Face "Repo id" error, a GPT-2 folder only after the
whole standard pass, `--temperature 0` exited 0 with an all-NaN column)."""

import json
import os
import subprocess
import sys
import time

import pytest


def run_cli(*argv, timeout=120):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, time.time() - t0


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                               "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}))
    return str(d)


CASES = [
    (["demo", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["demo", "--lag", "-1"], "--max-lag must be >= 0, got -1"),
    (["demo", "--prompts", "0"], "--prompts must be >= 1"),
    (["demo", "--samples", "0"], "--samples must be >= 1"),
    (["demo", "--hidden", "12"], "--hidden must be a positive multiple of 8"),
    (["demo", "--lr", "0"], "--lr must be a finite number > 0"),
    (["demo", "--sft-steps", "-2"], "--sft-steps must be >= 0"),
    (["demo", "--lr-warmup", "-1"], "--lr-warmup must be >= 0, got -1"),
    (["demo", "--max-lag", "0"], "--max-lag 0: the demo's async runs need a lag >= 1"),
    (["demo", "--moe", "--router-scale", "0"], "--router-scale must be a finite number > 0"),
    (["demo", "--tiny", "dense", "--train-scope", "head"], "--train-scope head needs a MoE model"),
    (["demo", "--moe", "--a-range", "0"], "--a-range must be >= 1, got 0"),
    (["demo", "--a-range", "-5"], "--a-range must be >= 1, got -5"),
    (["verify", "--linear", "bogus"], "--linear must be one of ('fma', 'exact'"),
    (["train", "--linear", "fast"], "--linear: linear profile must be one of"),
    (["train", "--linear", "mma", "--dtype", "float32"], "--linear mma takes --dtype bfloat16"),
    (["demo", "--linear", "fast"], "--linear: linear profile must be one of"),
    (["verify", "--model", "/nonexistent"], "--model /nonexistent: no such directory"),
    (["verify", "--temperature", "0"], "--temperature must be a finite number > 0"),
    (["verify", "--temperature", "nan"], "--temperature must be a finite number > 0"),
    (["verify", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["verify", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["verify", "--threads", "0"], "--threads must be >= 1"),
    # issue 21.8: these failed after the fact (inside a child after ~1.5 min; after ~50 s; with a traceback)
    (["verify", "--temperature", "2.5"], "--temperature must be in [0, 2] (vLLM >= 0.24"),
    (["verify", "--temperature", "-1"], "--temperature must be a finite number > 0, got -1.0"),
    (["verify", "--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (["demo", "--tiny", "dense", "--hidden", "8"],
     "--hidden 8 gives head size 2 (4 heads), which vLLM-CPU's attention does not take"),
    (["train", "--tiny", "dense", "--hidden", "64"], "--hidden 64 gives head size 16 (4 heads)"),
    (["demo", "--out", "/proc/x"], "--out /proc/x: cannot create or write this folder"),
    (["demo", "--out", "/proc/version"], "--out /proc/version: exists and is not a folder"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_flags_fail_fast_with_one_line(argv, message):
    proc, seconds = run_cli(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert seconds < 30  # no engine, no model build (a generous bound: the machine may be loaded)
    if "--model" not in argv:  # the structural form of "within seconds": torch is not even imported
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "aligned_ops.apps.cli", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert not _imported(proc.stderr, "torch"), "a flag check imported torch"


def _imported(importtime_stderr: str, top: str) -> bool:
    """Whether ``python -X importtime`` reports a module ``top`` or one under it."""
    names = [line.rsplit("|", 1)[-1].strip() for line in importtime_stderr.splitlines() if line.startswith("import time:")]
    return any(n == top or n.startswith(top + ".") for n in names)


@pytest.mark.parametrize("linear,loads_torch", [("fma", False), ("EXACT", False), ("mma", True)])
def test_linear_profile_check_loads_torch_only_for_a_refusing_profile(linear, loads_torch):
    """verify's --linear check asks the profile objects (which import torch) only for a profile that can refuse a
    model (mma: its unit and bf16); fma and exact run every model, so a later bad flag still fails torch-free. mma
    is the control: the same command loads torch to ask the profile."""
    argv = ["verify", "--linear", linear, "--num-prompts", "0"]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "aligned_ops.apps.cli", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _imported(proc.stderr, "aligned_ops")
    assert _imported(proc.stderr, "torch") == loads_torch
    assert _imported(proc.stderr, "aligned_ops.profiles") == loads_torch


@pytest.mark.parametrize("argv", [["--help"], ["verify", "--help"], ["demo", "--help"], ["demo", "--steps", "x"]])
def test_help_and_argparse_errors_do_not_load_torch(argv):
    """Issue 21.8: `--help` took 6-14 s (aligned_ops imported torch and the extension first). In a process started
    as the command the package defers loading until the flags are checked (aligned_ops/__init__.py)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "aligned_ops.apps.cli", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    # --help prints the usage; an argparse error is the one-line "aligned-ops <command>: error: ..."
    assert "usage: aligned-ops" in proc.stdout or "aligned-ops demo: error: argument --steps" in proc.stderr
    assert _imported(proc.stderr, "aligned_ops")  # negative control of the parse: the package itself was imported
    assert not _imported(proc.stderr, "torch")


def test_library_import_still_registers_the_ops_at_once():
    """The deferral is for the command only: `import aligned_ops` anywhere else registers torch.ops.aligned.* at
    import, and in the command's process the first attribute read (or aligned_ops.ops) loads everything."""
    code = "import aligned_ops, torch; torch.ops.aligned.linear; print(aligned_ops._loaded)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True"], proc.stderr[-2000:]
    import aligned_ops

    assert aligned_ops._loaded and callable(aligned_ops.linear)


def test_head_sizes_are_vllm_cpus():
    """The CLI's copy of vLLM-CPU's attention head sizes is the installed vLLM's (a vLLM bump that changes them
    fails here, not in a user's 50-second demo)."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from aligned_ops.apps import cli

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == cli.VLLM_CPU_ATTENTION_HEAD_SIZES
    args = cli.build_parser().parse_args(["demo", "--tiny", "dense", "--hidden", "384", "--out", "/tmp/aligned-ops-cli-ok"])
    cli.validate_args(args)  # head size 96: accepted
    args = cli.build_parser().parse_args(["demo", "--hidden", "64", "--out", "/tmp/aligned-ops-cli-ok"])
    cli.validate_args(args)  # the tiny MoE's head size is 32 at any --hidden

    from aligned_ops.models import tiny
    from aligned_ops.runner import config

    assert tiny.DEFAULT_CONFIG["num_attention_heads"] == config.TINY_DENSE_HEADS


def test_model_folder_with_a_head_size_vllm_cpu_refuses(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 512, "hidden_act": "silu",
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    # one check wherever vLLM-CPU's own attention runs: verify and demo (their standard side), train --kernels
    # standard; an aligned-only train run takes the model (the plugin's attention has no such list)
    for command in ("verify", "demo", "train --kernels standard"):
        out = [] if command == "verify" else ["--out", str(tmp_path / f"out_{command.split()[0]}")]
        proc, _ = run_cli(*command.split(), "--model", str(model), *out)
        assert proc.returncode == 2 and "head size 16 is not one vLLM-CPU's attention takes" in proc.stderr, command
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_unsupported_model_folder_is_refused_before_any_engine(gpt2_dir, tmp_path):
    proc, _ = run_cli("verify", "--model", gpt2_dir)
    assert proc.returncode == 2
    assert "unsupported architecture 'GPT2LMHeadModel'" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    (tmp_path / "config.json").write_text("{not json")
    proc, _ = run_cli("verify", "--model", str(tmp_path))
    assert proc.returncode == 2 and "cannot read config.json" in proc.stderr
    proc, _ = run_cli("verify", "--model", os.path.dirname(gpt2_dir))
    assert proc.returncode == 2 and "no config.json in that folder" in proc.stderr


@pytest.mark.parametrize("command", ["verify", "demo", "demo --moe", "train", "train --mode sync --tiny dense"])
def test_validation_accepts_the_defaults(command, tmp_path, monkeypatch):
    # Positive control: the default flags pass the same validation (checked without starting the runs). The
    # default --out is relative: validation creates it (a writable folder), so it runs in a scratch directory.
    monkeypatch.chdir(tmp_path)
    from aligned_ops.apps import cli

    cli.validate_args(cli.build_parser().parse_args(command.split()))


def test_demo_defaults_are_the_demos_and_explicit_flags_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is created by validation
    from aligned_ops.apps import cli
    from aligned_ops.apps.demo import DEMO_DEFAULTS, RUNS

    args = cli.build_parser().parse_args(["demo"])
    cli.validate_args(args)
    assert set(args.configs) == set(RUNS)
    cfg = args.configs[("aligned", "async")]
    assert (cfg.steps, cfg.prompts, cfg.lr, cfg.tiny) == tuple(DEMO_DEFAULTS[k] for k in ("steps", "prompts", "lr", "tiny"))
    assert cfg.lag == 1 and args.configs[("aligned", "sync")].lag == 0 and cfg.train_scope == "head"
    args = cli.build_parser().parse_args(["demo", "--lag", "3", "--steps", "7"])
    cli.validate_args(args)
    assert args.configs[("standard", "async")].lag == 3 and args.configs[("standard", "sync")].lag == 0
    assert all(c.steps == 7 for c in args.configs.values())
    # the linear profile is decided once (flag, else ALIGNED_OPS_LINEAR, else fma) and passed to every run by name
    from aligned_ops import profiles
    from aligned_ops.apps.demo import _train_argv

    assert {c.linear for c in args.configs.values()} == {profiles.from_env().name}
    args = cli.build_parser().parse_args(["demo", "--linear", "EXACT"])
    cli.validate_args(args)
    assert {c.linear_profile() for c in args.configs.values()} == {profiles.EXACT}
    argv = _train_argv(args.configs[("aligned", "async")], "/m")
    assert argv[argv.index("--linear") + 1] == "exact"


def test_demo_pins_torch_and_onednn_isa_levels():
    # The demo's table differed between CPUs with and without AVX-512/AMX: torch's optimiser/norm kernels and
    # the stock engine's oneDNN matmuls are chosen per CPU. The demo pins torch's level before it runs a kernel
    # (oneDNN cannot be pinned: vLLM-CPU's bf16 engine crashes under ONEDNN_MAX_CPU_ISA=AVX2).
    code = ("import os; os.environ.pop('ATEN_CPU_CAPABILITY', None)\n"
            "from aligned_ops.apps import cli\n"
            "cli.pin_reproducible_env()\n"
            "import torch; torch.randn(8).sum()\n"
            "print(torch.backends.cpu.get_cpu_capability())")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if " avx2 " not in open("/proc/cpuinfo").read():
        pytest.skip("CPU without AVX2: torch stays at its default level")
    assert proc.stdout.split() == ["AVX2"]


def test_moe_folder_written_by_transformers_is_accepted(tmp_path):
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts: the demo's own warm checkpoint was
    # refused ("got 2/0") before check_moe_config read that name. Negative control: no expert count at all.
    from aligned_ops.apps import cli

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 1,
           "vocab_size": 512, "hidden_act": "silu", "num_experts_per_tok": 2, "num_local_experts": 8,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cli.check_model_dir(str(tmp_path))
    del cfg["num_local_experts"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(cli.UsageError, match="num_experts_per_tok must be in"):
        cli.check_model_dir(str(tmp_path))
