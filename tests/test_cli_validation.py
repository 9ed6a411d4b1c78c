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


@pytest.mark.parametrize("command", ["verify", "train", "demo"])
@pytest.mark.parametrize("what", ["missing", "file", "no_config", "config"])
def test_model_folder_check_loads_torch_only_for_a_config_it_reads(command, what, tmp_path):
    """A --model that is no checkpoint folder (missing, a file, no config.json) is refused from the file system
    alone, torch-free (probe s47: `verify --model /nonexistent` took 3.4 s, the integrations package imported torch
    before the folder was looked at; cli.check_model_dir says "well under a second"). Control: a config.json is
    checked by the integrations' rules, which load torch (here one they refuse: a qwen2 naming Llama's class)."""
    model = {"missing": tmp_path / "nope", "file": tmp_path / "f", "no_config": tmp_path / "empty",
             "config": tmp_path / "m"}[what]
    (tmp_path / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(QWEN2, architectures=["LlamaForCausalLM"])))
    argv = [command, "--model", str(model)] + ([] if command == "verify" else ["--out", str(tmp_path / "out")])
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "aligned_ops.apps.cli", *argv],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [x for x in proc.stderr.splitlines() if not x.startswith("import time:")]
    assert len(line) == 1 and line[0].startswith(f"aligned-ops {command}: error: ") and "--model" in line[0], line
    assert _imported(proc.stderr, "aligned_ops")
    assert _imported(proc.stderr, "torch") == (what == "config")


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


# ---- a probe's findings (each failed after the fact, or with a traceback, before these checks) ------------------

def run_main(capsys, monkeypatch, *argv):
    """``aligned-ops <argv>`` in this process, stopped right after validation: (exit status, stdout, stderr). A
    command whose flags pass raises instead of starting anything (aligned_ops.load is the first step after the
    checks), so a missed refusal fails the test without a model build or an engine."""
    import aligned_ops
    from aligned_ops.apps import cli

    def passed():
        raise AssertionError(f"aligned-ops {' '.join(argv)}: the flags passed validation")

    monkeypatch.setattr(aligned_ops, "load", passed)
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc, out, err, *needles):
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and out == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 512, "hidden_act": "silu",
         "intermediate_size": 256, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512,
               "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32, "kv_lora_rank": 64,
               "q_lora_rank": None, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 2,
               "first_k_dense_replace": 1, "intermediate_size": 256, "moe_intermediate_size": 64,
               "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
GLM4_MOE = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 128,
            "num_attention_heads": 4, "head_dim": 32, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "vocab_size": 512, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "intermediate_size": 256,
            "moe_intermediate_size": 64}


def _without(cfg, name):
    return {k: v for k, v in cfg.items() if k != name}


# (the config.json, what the one line must name); each crashed the --model check with a traceback (AttributeError,
# ZeroDivisionError, TypeError) or passed it (no model_type: vLLM failed after its start-up)
BAD_CONFIGS = [
    (_without(QWEN2, "hidden_size"), "config has no hidden_size"),
    (dict(QWEN2, num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
    (dict(QWEN2, num_attention_heads="4"), "num_attention_heads must be an integer >= 1, got '4'"),
    (dict(QWEN2, architectures=[["Qwen2ForCausalLM"]]), "architectures must be a list of class names"),
    (_without(QWEN2, "max_position_embeddings"), "config has no max_position_embeddings"),
    (dict(QWEN2, rope_parameters="yarn"), "rope_parameters must be a mapping"),
    # a string would be read a character at a time by the sliding-window check
    (dict(QWEN2, layer_types="full_attention"), "layer_types must be a list of layer kinds"),
    # a window only Qwen's use_sliding_window switches on: a Llama's is vLLM's (HF's Llama ignores it)
    (dict(QWEN2, architectures=["LlamaForCausalLM"], model_type="llama", sliding_window=64),
     "sliding-window attention is not supported (sliding_window=64)"),
    (_without(DEEPSEEK_V3, "n_group"), "config has no n_group (a DeepseekV3ForCausalLM config must set it)"),
    (_without(GLM4_MOE, "n_group"), "config has no n_group (a Glm4MoeForCausalLM config must set it)"),
    (_without(QWEN2, "model_type"), "config.json needs a model_type"),
    (dict(QWEN2, model_type=""), "config.json needs a model_type"),
    (_without(QWEN2, "architectures"), "config.json has no architectures"),
    (dict(QWEN2, architectures=None), "config.json has no architectures"),
    (dict(QWEN2, architectures=[]), "config.json has no architectures"),
]


def _model_dir(root, cfg, name="m"):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("cfg,message", BAD_CONFIGS, ids=[m.split(" (")[0] for _, m in BAD_CONFIGS])
@pytest.mark.parametrize("command", ["verify", "train", "demo"])
def test_malformed_model_config_is_one_line_naming_the_field(cfg, message, command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model_dir(tmp_path, cfg)
    rc, out, err = run_main(capsys, monkeypatch, command, "--model", model)
    assert_one_line(rc, out, err, "--model", message)
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no default --out folder (train_out, demo_out) was made


def test_well_formed_model_configs_are_accepted(tmp_path):
    # controls of BAD_CONFIGS: the same configs, whole, pass the --model check
    from aligned_ops.apps import cli

    for i, cfg in enumerate((QWEN2, DEEPSEEK_V3, GLM4_MOE)):
        cli.check_model_dir(_model_dir(tmp_path, cfg, f"m{i}"))


LLAMA2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 512, "hidden_act": "silu",
          "intermediate_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_scaling": None}


@pytest.mark.parametrize("cfg", [LLAMA2, _without(QWEN2, "rope_theta"), _without(DEEPSEEK_V3, "rope_theta")],
                         ids=["llama2", "qwen2", "deepseek_v3"])
def test_config_without_rope_theta_is_checked_with_transformers_default(cfg, tmp_path):
    # Llama-2's config.json has no rope_theta: transformers' config class (both sides load the checkpoint through
    # it) gives 10000, and the --model check reads the same (it refused such a folder: "config has no rope_theta")
    from types import SimpleNamespace

    from transformers import AutoConfig

    from aligned_ops.apps import cli
    from aligned_ops.integrations import rope_theta_of
    from aligned_ops.runner.config import _fill_class_defaults

    folder = _model_dir(tmp_path, cfg)
    cli.check_model_dir(folder)
    fields = SimpleNamespace(**cfg)
    _fill_class_defaults(fields, cfg["model_type"])
    assert fields.rope_theta == rope_theta_of(AutoConfig.from_pretrained(folder)) == 10000.0  # what the trainer reads


@pytest.mark.parametrize("theta,message", [(None, "no rope_theta"), (0, "must be a finite number > 0"),
                                           ("1e4", "rope_theta must be a number")])
def test_config_with_a_bad_rope_theta_is_still_refused(theta, message, tmp_path, capsys, monkeypatch):
    # controls: a rope_theta the config does set (null included) is its own value, never replaced by the default
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(capsys, monkeypatch, "verify", "--model", _model_dir(tmp_path, dict(LLAMA2, rope_theta=theta)))
    assert_one_line(rc, out, err, "--model", message)


def test_malformed_model_config_end_to_end(tmp_path):
    # the same refusal in a process of its own: one line, no traceback, exit 2 (three commands, one bad field each)
    for command, cfg in (("verify", _without(QWEN2, "hidden_size")), ("train", _without(DEEPSEEK_V3, "n_group")),
                         ("demo", _without(QWEN2, "model_type"))):
        model = _model_dir(tmp_path, cfg, command)
        proc, seconds = run_cli(command, "--model", model, "--out", str(tmp_path / f"{command}_out"))  \
            if command != "verify" else run_cli(command, "--model", model)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1 and "--model" in proc.stderr
        assert not os.path.exists(tmp_path / f"{command}_out")


def test_model_flag_naming_a_file_says_so(tmp_path, capsys, monkeypatch):
    model = _model_dir(tmp_path, QWEN2)
    rc, out, err = run_main(capsys, monkeypatch, "verify", "--model", os.path.join(model, "config.json"))
    assert_one_line(rc, out, err, "config.json: is a file; --model takes the checkpoint folder")


# (argv, what the one line must say): each passed validation (or crashed later, with a traceback) before
PROBE_CASES = [
    # 3: vLLM >= 0.24 refuses T > 2; verify refused it, train and demo started the run (one rule now)
    (["train", "--temperature", "3"], "--temperature must be in [0, 2] (vLLM"),
    (["demo", "--temperature", "3"], "--temperature must be in [0, 2] (vLLM"),
    # 5: fixed-width arguments downstream (numpy's seed: 32 bits; torch.set_num_threads: a C int)
    (["train", "--seed", "99999999999999999999999"], "--seed must be <= 4294967295"),
    (["demo", "--seed", "4294967296"], "--seed must be <= 4294967295, got 4294967296"),
    (["verify", "--seed", "99999999999999999999999"], "--seed must be <= 4294967295"),
    (["verify", "--threads", "99999999999999999999"], "--threads must be <= 1024"),
    (["train", "--threads", "1025"], "--threads must be <= 1024, got 1025"),
    # probe s47: torch.randint's bound is an int64 (a traceback "Overflow when unpacking long long" after the
    # model build); a worker past --steps generates nothing (100000 workers started 100000 engines)
    (["train", "--a-range", str(2**63)], f"--a-range must be <= {2**63 - 1}, got {2**63}"),
    (["demo", "--a-range", "10000000000000000000000"], f"--a-range must be <= {2**63 - 1}"),
    (["train", "--rollout-workers", "100000"], "--rollout-workers 100000 must be <= --steps 60"),
    (["train", "--steps", "3", "--rollout-workers", "4"], "--rollout-workers 4 must be <= --steps 3"),
    # probe s47: the built-in model's build ran out of memory (an allocator traceback after 16 s) or never ended
    (["train", "--hidden", "100000000"], "--hidden 100000000 --layers 2: the built-in tiny moe model would have"),
    (["demo", "--layers", "100000000"], "--hidden 128 --layers 100000000: the built-in tiny moe model"),
    (["train", "--tiny", "dense", "--hidden", "100000512"], "--hidden 100000512 --layers 2: the built-in tiny dense model would have"),
    # probe s47: verify drew prompts until memory ran out (after the model build)
    (["verify", "--num-prompts", "99999999999"], "--num-prompts 99999999999: the prompts' token ids alone take"),
    # probe s47: a batch of 10**23 prompts started the run (the workers' draw failed after the warm-up)
    (["train", "--prompts", str(10**23)], f"--prompts {10**23} x --samples 4: one batch's prompt token ids alone"),
    (["demo", "--samples", str(10**23)], f"--prompts 64 x --samples {10**23}: one batch's prompt token ids alone"),
    # review 125: 400-digit values overflowed the float formatting of these messages (OverflowError traceback)
    (["train", "--hidden", str(8 * 10**400)], "e+803 parameters, 5.72e+794 GiB in fp32 alone"),
    (["train", "--hidden", str(8 * 10**4000)], "e+8003 parameters, 5.72e+7994 GiB"),  # review 128: str() of the count failed
    (["demo", "--layers", str(10**400)], "GiB in fp32 alone, more than this machine's"),
    (["train", "--prompts", str(8 * 10**400)], "one batch's prompt token ids alone take 1.43e+394 GiB"),
    (["verify", "--num-prompts", str(8 * 10**400)], "the prompts' token ids alone take "),
    # the child run's hidden pair alone: a TypeError traceback from open(None) (probe s47)
    (["verify", "--kernels", "aligned"], "--kernels is the internal child run's flag: it needs --model and --result"),
    (["verify", "--kernels", "standard", "--result", "r.json"], "--kernels is the internal child run's flag"),
    (["verify", "--result", "r.json"], "--result is the internal child run's flag: it needs --kernels"),
]


@pytest.mark.parametrize("argv,message", PROBE_CASES, ids=[" ".join(a) for a, _ in PROBE_CASES])
def test_probe_flags_refused_up_front(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(capsys, monkeypatch, *argv)
    assert_one_line(rc, out, err, message)
    assert os.listdir(tmp_path) == []  # no --out folder


@pytest.mark.parametrize("argv", [["train", "--seed", str(2**32 - 1), "--threads", "1024", "--temperature", "2"],
                                  ["demo", "--seed", "0", "--threads", "1"],
                                  ["train", "--a-range", str(2**63 - 1), "--steps", "3", "--rollout-workers", "3"],
                                  ["demo", "--a-range", str(2**63 - 1)],
                                  ["train", "--hidden", "1024", "--layers", "4"],
                                  ["verify", "--num-prompts", "100000"],
                                  ["train", "--prompts", "4096", "--samples", "64"]])
def test_probe_bounds_accept_their_limits(argv, tmp_path, monkeypatch):
    # controls: the largest seed and thread count, and T = 2, pass
    monkeypatch.chdir(tmp_path)
    from aligned_ops.apps import cli

    cli.validate_args(cli.build_parser().parse_args(argv))


def _has_mma_unit() -> bool:
    from aligned_ops.ops.linear_mma import mma_model_reasons

    return not mma_model_reasons("bfloat16")


@pytest.mark.parametrize("command", ["train", "demo", "verify"])
def test_linear_mma_without_the_unit_is_refused_like_verify(command, tmp_path, capsys, monkeypatch):
    # 4: train/demo --linear mma passed validation on a CPU without the unit and failed in patch_model after the
    # model build; one check now (runner.config.check_profile_runs_here), and its advice names the flag used (10)
    if _has_mma_unit():
        pytest.skip("this CPU has the mma profile's unit: nothing to refuse")
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(capsys, monkeypatch, command, "--linear", "mma")
    assert_one_line(rc, out, err, "--linear mma: mma needs", "use --linear fma")
    assert "ALIGNED_OPS_LINEAR" not in err and os.listdir(tmp_path) == []
    # the environment's switch is named where the profile came from there
    monkeypatch.setenv("ALIGNED_OPS_LINEAR", "mma")
    rc, out, err = run_main(capsys, monkeypatch, command)
    assert_one_line(rc, out, err, "ALIGNED_OPS_LINEAR mma: mma needs", "use ALIGNED_OPS_LINEAR=fma")


def test_linear_mma_float32_names_the_flag(capsys, monkeypatch):
    # 10: the refusal said "use ALIGNED_OPS_LINEAR=fma" to a user who passed --linear
    rc, out, err = run_main(capsys, monkeypatch, "verify", "--linear", "mma", "--dtype", "float32")
    assert_one_line(rc, out, err, "--linear mma:", "got float32; use --linear fma")
    assert "ALIGNED_OPS_LINEAR" not in err


# 6, 7, 8: argparse's own errors, one line each (verify printed the usage block; an unknown flag or command the
# top-level usage), and no abbreviations (`demo --mode sync` meant --model sync)
ARGPARSE_CASES = [
    (["verify", "--num-prompts", "x"], "aligned-ops verify: error: argument --num-prompts: invalid int value: 'x'"),
    (["verify", "--dtype", "int8"], "aligned-ops verify: error: argument --dtype: invalid choice: 'int8'"),
    (["train", "--bogus"], "aligned-ops train: error: unrecognized arguments: --bogus"),
    (["demo", "--bogus"], "aligned-ops demo: error: unrecognized arguments: --bogus"),
    (["verify", "--bogus", "1"], "aligned-ops verify: error: unrecognized arguments: --bogus 1"),
    ([], "aligned-ops: error: the following arguments are required: {verify,demo,train}"),
    (["bogus"], "aligned-ops: error: argument {verify,demo,train}: invalid choice: 'bogus'"),
    (["demo", "--mode", "sync"], "aligned-ops demo: error: unrecognized arguments: --mode sync"),
    (["verify", "--num-prompt", "3"], "aligned-ops verify: error: unrecognized arguments: --num-prompt 3"),
    (["train", "--out", "o", "--ste", "3"], "aligned-ops train: error: unrecognized arguments: --ste 3"),
]


@pytest.mark.parametrize("argv,message", ARGPARSE_CASES, ids=[" ".join(a) or "(none)" for a, _ in ARGPARSE_CASES])
def test_argparse_errors_are_one_line(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and os.listdir(tmp_path) == []


def test_no_parser_takes_abbreviations():
    from aligned_ops.apps import cli

    p = cli.build_parser()
    subs = next(a for a in p._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    assert not p.allow_abbrev and sorted(subs) == ["demo", "train", "verify"]
    assert not any(s.allow_abbrev for s in subs.values())


def test_help_is_still_the_usage():
    for argv in (["--help"], ["verify", "--help"], ["train", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: aligned-ops") and proc.stderr == ""


# 9: --out and --resume


def test_failing_validation_makes_no_output_folder(tmp_path, capsys, monkeypatch):
    # demo --steps 0 made ./demo_out, train --model /nonexistent ./train_out (the folder check ran first)
    monkeypatch.chdir(tmp_path)
    for argv in (["demo", "--steps", "0"], ["train", "--model", "/nonexistent"], ["demo", "--model", "/nonexistent"],
                 ["train", "--out", "a/b/c", "--tiny", "dense", "--train-scope", "head"]):
        rc, out, err = run_main(capsys, monkeypatch, *argv)
        assert_one_line(rc, out, err)
        assert os.listdir(tmp_path) == [], argv
    # control: a command whose flags pass makes its folder (validation writes a probe file in it)
    from aligned_ops.apps import cli

    cli.validate_args(cli.build_parser().parse_args(["train", "--out", "a/b/c"]))
    assert os.path.isdir(tmp_path / "a" / "b" / "c")


def test_out_folder_check_removes_what_it_made(tmp_path, monkeypatch):
    # a folder made by the check and then found unwritable is removed again (the parents it made too)
    from aligned_ops.runner import config

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(config.ConfigError, match="cannot create or write this folder"):
        config.check_writable_folder(str(tmp_path / "x" / "y"))
    assert os.listdir(tmp_path) == []


def _run_folder(root, metrics=True, checkpoint=None):
    """An --out folder as a killed run leaves it: its settings, metrics.jsonl, and maybe checkpoint/state.pt."""
    from aligned_ops.runner.config import RunConfig

    out = root / "run"
    (out / "checkpoint").mkdir(parents=True)
    cfg = RunConfig(out=str(out)).validate(check_out=False)
    (out / "checkpoint" / "config.json").write_text(json.dumps(cfg.to_dict()))
    if metrics:
        (out / "metrics.jsonl").write_text('{"step": 0}\n')
    if checkpoint is not None:
        (out / "checkpoint" / "state.pt").write_bytes(checkpoint)
    return out


def test_resume_with_an_unreadable_checkpoint_is_refused_up_front(tmp_path, capsys, monkeypatch):
    # 9a: a garbage state.pt passed validation, the model was built (~1 min), then torch.load failed in loop.py
    for garbage in (b"not a checkpoint", b"PK\x03\x04 truncated"):
        out = _run_folder(tmp_path, checkpoint=garbage)
        rc, err_out, err = run_main(capsys, monkeypatch, "train", "--resume", "--out", str(out))
        assert_one_line(rc, err_out, err, "--resume:", "state.pt is not a readable checkpoint")
        import shutil

        shutil.rmtree(out)


def _resume_passes(capsys, monkeypatch, out, *flags):
    """``train --resume --out OUT FLAGS`` passes validation (run_main's stop after the checks raises)."""
    with pytest.raises(AssertionError, match="the flags passed validation"):
        run_main(capsys, monkeypatch, "train", "--resume", "--out", str(out), *flags)


def test_resume_accepts_a_torch_checkpoint(tmp_path, capsys, monkeypatch):
    # control of the above and below: a checkpoint as learner_main writes it passes (at step 2 of the default
    # --steps 60, lag 1: versions 1 and 2 needed; metrics.jsonl as long as its offset)
    from _tiny_checkpoints import runner_checkpoint_bytes

    from aligned_ops.runner.config import check_checkpoint_file

    out = _run_folder(tmp_path, checkpoint=runner_checkpoint_bytes(step=2, metrics_offset=12, versions=(1, 2)))
    assert check_checkpoint_file(str(out / "checkpoint" / "state.pt")) == 2
    _resume_passes(capsys, monkeypatch, out)


def _corrupt(raw: bytes, how: str) -> bytes:
    """A zip-valid torch.save archive, damaged in one way that the zip directory does not show."""
    import io
    import struct
    import zipfile

    z = zipfile.ZipFile(io.BytesIO(raw))
    tensor = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    if how == "flipped tensor bytes":  # torch.load checks no CRC: it loaded these as silently wrong weights
        name_len, extra_len = struct.unpack("<HH", raw[tensor.header_offset + 26: tensor.header_offset + 30])
        at = tensor.header_offset + 30 + name_len + extra_len + 4
        return raw[:at] + bytes(b ^ 0xFF for b in raw[at: at + 4]) + raw[at + 4:]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as w:  # rewritten: every CRC right
        for info in z.infolist():
            data = z.read(info.filename)
            if how == "garbage pickle" and info.filename.endswith("data.pkl"):
                data = data[:20] + b"\x00" * 20 + data[40:]
            if how == "missing tensor record" and info is tensor:
                continue
            if how == "compressed pickle" and info.filename.endswith("data.pkl"):
                info.compress_type = zipfile.ZIP_DEFLATED  # how a zip bomb of opcodes would come
            w.writestr(info, data)
    return out.getvalue()


@pytest.mark.parametrize("how, needle", [
    ("flipped tensor bytes", "record archive/data/0 fails its CRC check: the file is corrupt"),
    ("garbage pickle", "its pickle does not load: UnpicklingError"),
    ("missing tensor record", "tensor data record(s) 0 missing"),
    ("another torch.save", "a torch.save archive without metrics_offset, policy, history, rng: not this runner's"),
    ("a version short", "it lacks weight version(s) 1, which the next batches are generated with"),
    ("compressed pickle", "record archive/data.pkl is compressed, which torch.save never writes"),
    ("self-doubling step", "its step is a value of type tuple"),
])
def test_resume_with_a_corrupt_checkpoint_is_refused_up_front(how, needle, tmp_path, capsys, monkeypatch):
    # 9a': a zip-valid state.pt passed the zip-directory check: a foreign or damaged one failed after the model was
    # built (KeyError 'policy', UnpicklingError, a missing record), and flipped tensor bytes loaded silently
    import io

    import torch
    from _tiny_checkpoints import runner_checkpoint_bytes

    good = runner_checkpoint_bytes(step=2, metrics_offset=12, versions=(1, 2))
    if how == "another torch.save":
        buf = io.BytesIO()
        torch.save({"step": 1}, buf)
        bad = buf.getvalue()
    elif how == "a version short":
        bad = runner_checkpoint_bytes(step=2, metrics_offset=12, versions=(2,))
    elif how == "self-doubling step":  # 1.3 kB whose repr doubles per level (the message was 29 MB at 22 levels)
        step = ()
        for _ in range(40):
            step = (step, step)
        buf = io.BytesIO()
        torch.save(dict(step=step, metrics_offset=0, policy={}, history={}, rng=None), buf)
        bad = buf.getvalue()
    else:
        bad = _corrupt(good, how)
    out = _run_folder(tmp_path, checkpoint=bad)
    rc, err_out, err = run_main(capsys, monkeypatch, "train", "--resume", "--out", str(out))
    assert_one_line(rc, err_out, err, f"--resume: {out}/checkpoint/state.pt is not a readable checkpoint", needle)
    (out / "checkpoint" / "state.pt").write_bytes(good)  # control: the intact checkpoint passes
    _resume_passes(capsys, monkeypatch, out)


def test_checkpoint_check_reads_hashable_objects_and_refuses_odd_storage_keys(tmp_path):
    # the stand-in for every rebuilt object is hashable (a torch.device as a dict key refused a valid file), and a
    # storage key is a record name (a crafted one whose repr grows was turned into text)
    import io
    import pickle

    import torch
    from _tiny_checkpoints import runner_checkpoint_bytes

    from aligned_ops.runner.config import ConfigError, check_checkpoint_file

    good = runner_checkpoint_bytes(step=2, metrics_offset=0)
    state = torch.load(io.BytesIO(good), weights_only=False)
    state["cfg"] = {torch.device("cpu"): 1}
    buf = io.BytesIO()
    torch.save(state, buf)
    f = tmp_path / "state.pt"
    f.write_bytes(buf.getvalue())
    assert check_checkpoint_file(str(f)) == 2

    class Keyed(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", None, (1, 2), "cpu", 4) if obj == "marker" else None

    raw = io.BytesIO()
    Keyed(raw, protocol=2).dump(dict(state, rng="marker"))
    import zipfile

    bad = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z, zipfile.ZipFile(bad, "w") as w:
        for info in z.infolist():
            w.writestr(info, raw.getvalue() if info.filename.endswith("data.pkl") else z.read(info.filename))
    f.write_bytes(bad.getvalue())
    with pytest.raises(ConfigError, match="a tensor storage key that is not a record name"):
        check_checkpoint_file(str(f))


def test_resume_with_nothing_left_to_do_is_refused_up_front(tmp_path, capsys, monkeypatch):
    # a checkpoint at step 2 resumed with --steps 2: a ValueError traceback after the model build
    from _tiny_checkpoints import runner_checkpoint_bytes

    out = _run_folder(tmp_path, checkpoint=runner_checkpoint_bytes(step=2, metrics_offset=12))
    for steps in ("2", "1"):
        rc, err_out, err = run_main(capsys, monkeypatch, "train", "--resume", "--out", str(out), "--steps", steps)
        assert_one_line(rc, err_out, err, f"--resume: the checkpoint is at step 2, the run has --steps {steps}: "
                        "nothing to do (pass --steps > 2")
    _resume_passes(capsys, monkeypatch, out, "--steps", "3")  # control


def test_resume_with_a_cut_metrics_log_is_refused_up_front(tmp_path, capsys, monkeypatch):
    # metrics.jsonl shorter than the checkpoint's offset: the resume "cut it back" by extending it with NUL bytes
    from _tiny_checkpoints import runner_checkpoint_bytes

    out = _run_folder(tmp_path, checkpoint=runner_checkpoint_bytes(step=2, metrics_offset=13))  # the file has 12
    rc, err_out, err = run_main(capsys, monkeypatch, "train", "--resume", "--out", str(out))
    assert_one_line(rc, err_out, err, "--resume: the checkpoint continues metrics.jsonl at byte 13, but "
                    "metrics.jsonl has 12 bytes (it was cut or removed)")
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # control: a longer one is cut back to 13
    _resume_passes(capsys, monkeypatch, out)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "group_mean"])
def test_a_group_of_one_sample_is_refused(advantage, tmp_path, capsys, monkeypatch):
    # --samples 1 --advantage group_mean passed: A = R - mean of a group of one is 0 for every rollout, so the run
    # trained nothing (grpo and rloo were refused; all three are 0 there)
    from aligned_ops import rl
    import torch

    assert rl.group_mean_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=1).tolist() == [0.0, 0.0, 0.0]
    out = str(tmp_path / "run")
    rc, o, err = run_main(capsys, monkeypatch, "train", "--out", out, "--samples", "1", "--advantage", advantage)
    assert_one_line(rc, o, err, f"--samples must be >= 2 for --advantage {advantage} (a group needs two samples")
    with pytest.raises(AssertionError, match="the flags passed validation"):  # control: a group of two passes
        run_main(capsys, monkeypatch, "train", "--out", out, "--samples", "2", "--advantage", advantage)


@pytest.mark.parametrize("resume", [False, True])
def test_run_killed_before_its_first_checkpoint_says_what_to_do(resume, tmp_path, capsys, monkeypatch):
    # 9b: such a folder could neither be reused ("pass --resume") nor resumed ("no checkpoint")
    out = _run_folder(tmp_path)
    rc, o, err = run_main(capsys, monkeypatch, "train", "--out", str(out), *(["--resume"] if resume else []))
    assert_one_line(rc, o, err, f"--out {out} holds a run with no checkpoint (interrupted before its first save",
                    "remove that folder or choose another --out")
    assert sorted(os.listdir(out)) == ["checkpoint", "metrics.jsonl"]  # nothing deleted


def test_verify_child_flags_pass_as_run_child_gives_them(tmp_path, monkeypatch):
    # control of the --kernels / --result refusals: the parent's child command line (common.run_child) passes
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN2))
    from aligned_ops.apps import cli

    cli.validate_args(cli.build_parser().parse_args(
        ["verify", "--model", str(tmp_path / "m"), "--kernels", "aligned", "--result", str(tmp_path / "r.json")]))


@pytest.mark.parametrize("tiny,hidden,layers", [("moe", 128, 2), ("moe", 64, 1), ("dense", 128, 2), ("dense", 256, 3)])
def test_tiny_parameter_count_is_the_built_models(tiny, hidden, layers, tmp_path):
    """The memory check's count (torch-free) against the checkpoint runner.models.build_tiny writes."""
    import math

    from safetensors import safe_open

    from aligned_ops.runner.config import tiny_parameter_count
    from aligned_ops.runner.models import build_tiny

    path = build_tiny(tiny, str(tmp_path / "m"), "bfloat16", 0, hidden, layers, 0.08)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert tiny_parameter_count(tiny, hidden, layers) == n


@pytest.mark.parametrize("command", ["verify", "train", "demo"])
def test_linear_help_lists_every_profile(command, capsys):
    # train's and demo's --linear help said "(fma, exact; ...)" while they take mma too (probe s47)
    from aligned_ops.apps import cli
    from aligned_ops.choices import PROFILE_NAMES

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(" + ", ".join(PROFILE_NAMES) + ";" in text, text[text.find("--linear"):][:300]


@pytest.mark.parametrize("command", ["verify", "train", "demo"])
def test_extension_load_error_is_one_line_and_leaves_no_folder(command, tmp_path):
    """A kernel level the CPU cannot run (ALIGNED_CPU_ISA) is the extension's one-line ImportError; the command
    printed it as a 16-line traceback, exit 1, and train/demo left the --out folder validation had made (probe
    s47). Now: that line, exit 2, no folder. The control is the same command's message naming the variable."""
    argv = [command] + ([] if command == "verify" else ["--out", str(tmp_path / "a" / "b")])
    proc = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ, ALIGNED_CPU_ISA="not-a-level"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0] == (f"aligned-ops {command}: error: aligned_ops: ALIGNED_CPU_ISA='not-a-level' is not a kernel "
                        "level; use generic, avx2, avx512 or amx (or unset it)")
    assert os.listdir(tmp_path) == []


def test_an_extension_that_cannot_load_is_one_line(tmp_path):
    """A truncated / mismatched ``_C`` (import_module's own ImportError: "file too short", "undefined symbol") was a
    traceback, exit 1, and left the --out folder (review 125): now the extension's one line, exit 2, no folder.
    A copy of the package with a garbage ``_C.abi3.so``; control: the same copy's _build_info check still runs first
    (the line names the compiled extension, not the build info)."""
    import shutil

    import aligned_ops

    pkg = tmp_path / "site" / "aligned_ops"
    shutil.copytree(os.path.dirname(aligned_ops.__file__), pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (pkg / "_C.abi3.so").write_bytes(b"not an ELF file")
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.run([sys.executable, "-m", "aligned_ops.apps.cli", "train", "--out", str(run / "a" / "b")],
                          capture_output=True, text=True, timeout=120, cwd=run,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("aligned-ops train: error: aligned_ops: the compiled extension cannot load ("), lines[0]
    assert "rebuild it with `pip install --no-build-isolation .`" in lines[0]
    assert os.listdir(run) == []


def test_approx_formats_sizes_of_any_magnitude():
    # the CLI's size messages (runner.config.approx): floats where they fit, exact integer arithmetic past 1e300
    # (review 128: 10**400 - 1 printed "10e+399"; str() of a count past 4300 digits raised)
    from aligned_ops.runner.config import approx

    assert approx(123456) == "1.23e+05" and approx(5 * 2**30, 2**30) == "5" and approx(0) == "0"
    assert approx(8 * 10**400) == "8e+400" and approx(-(8 * 10**400)) == "-8e+400"
    assert approx(10**400 - 1) == "1e+400" and approx(99951 * 10**396) == "1e+401"
    assert approx(8 * 10**400, 2**30) == "7.45e+391"
    assert approx(7 * 10**5000) == "7e+5000"
