"""What one RL run is: :class:`RunConfig`, one field per ``aligned-ops train`` flag, checked up front.

Every check here runs before a model is built or an engine starts: reading the model's config.json is the most
it does, so a bad value fails in well under a second (``aligned-ops train`` prints it as one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from ..choices import VLLM_CPU_ATTENTION_HEAD_SIZES
from .task import REWARD_KINDS

TINY_DENSE_HEADS = 4  # aligned_ops.models.tiny.DEFAULT_CONFIG["num_attention_heads"] (torch-free copy; tested equal)


def tiny_parameter_count(tiny: str, hidden: int, layers: int) -> int:
    """Parameters of the built-in tiny model (runner.models.build_tiny) at ``--hidden`` / ``--layers``, torch-free
    (tests/test_cli_validation.py compares it with the built checkpoints): vocabulary 512, tied embeddings; dense:
    Qwen2, 4 heads (2 KV), q/k/v biases, MLP 2·hidden; moe: Qwen3-MoE, 4 heads of 32 (2 KV), q/k norms, 8 experts of
    hidden/2."""
    if tiny == "moe":
        per_layer = 12 * hidden * hidden + 394 * hidden + 64
    else:
        per_layer = 8 * hidden * hidden + 3 * hidden + 2 * (hidden // 2) * (hidden + 1)
    return 513 * hidden + layers * per_layer


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_writable_folder(path: str) -> None:
    """``--out``: a folder this process can create and write. Created now (a bad path fails before the run), so it is
    the LAST check of a command's validation: a command refused for another flag leaves no folder behind. Where it
    fails, the folders it made are removed again."""
    made = missing_folders(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".aligned-ops-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        remove_empty_folders(made)
        raise ConfigError(f"--out {path}: cannot create or write this folder ({e.strerror or e})") from None


def missing_folders(path: str) -> list[str]:
    """The folders of ``path`` that do not exist yet, deepest first (what creating it would make)."""
    made, parent = [], os.path.abspath(path)
    while parent and not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    return made


def remove_empty_folders(made: list[str]) -> None:
    """Undo :func:`check_writable_folder` for the folders :func:`missing_folders` listed: only the empty ones."""
    for d in made:  # deepest first
        try:
            os.rmdir(d)
        except OSError:
            pass

# What learner_main's checkpoint (loop.py) holds; --resume reads all of it.
CHECKPOINT_KEYS = ("step", "metrics_offset", "policy", "history", "rng")


class _Opaque(dict):
    """Stands for every object a ``torch.save`` pickle rebuilds (tensors, storages, OrderedDicts): the check below
    reads the checkpoint's structure without torch and without running any of the pickle's callables."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass

    __hash__ = object.__hash__  # a dict key in the pickle (a torch.device, an Enum) must stay usable


# A checkpoint's data.pkl describes the tensors, it does not hold them: ~430 + 130 * (lag + 1) bytes per trainable
# tensor (a few MB for an 8B model, ~50 MB for a DeepSeek-V3-sized one at lag 7). Beyond this the
# check refuses (a crafted pickle could otherwise make it build gigabytes of objects).
_MAX_CHECKPOINT_PICKLE_BYTES = 256 << 20


def _short(value) -> str:
    """A value read from a checkpoint, for a message: ints, strings and None as they are, anything else by its type
    (a crafted nested tuple's repr can be exponentially long)."""
    if value is None or (isinstance(value, (int, str)) and len(str(value)) <= 80):
        return repr(value)
    return f"a value of type {type(value).__name__}"


def approx(num: int, den: int = 1) -> str:
    """``num / den`` (integers of any size) to 3 significant digits for a message: a flag of 400 digits made
    ``f"{n:.3g}"`` and ``n / 2**30`` overflow a float, a traceback instead of the flag's one line."""
    import math
    from fractions import Fraction

    x = Fraction(num, den)
    if abs(x) < 10**300:
        return f"{float(x):.3g}"
    q = abs(x)
    e = int(math.log10(q.numerator // q.denominator))  # math.log10 takes an int of any size (str() stops at 4300 digits)
    e += (q >= 10 ** (e + 1)) - (q < 10**e)
    m = round(q / 10 ** (e - 2))  # 3 digits, rounded exactly: 10**400 - 1 is 1e+400, not "10e+399"
    if m == 1000:
        m, e = 100, e + 1
    return f"{'-' if x < 0 else ''}{float(Fraction(m, 100)):.3g}e+{e}"


def check_checkpoint_file(path: str, steps: int | None = None, lag: int | None = None,
                          metrics_path: str | None = None) -> int:
    """``--resume``: ``path`` (checkpoint/state.pt) is a whole checkpoint of this runner, read torch-free before the
    model is built (torch.load would fail only after it — or load flipped bytes silently: it checks no checksum).
    Checked: a ``torch.save`` zip whose every record matches its CRC (the whole file is read once), a pickle that
    unpickles (its callables are never run) to a dict with ``CHECKPOINT_KEYS``, every tensor's storage record
    present, a step >= 1 and, given ``steps`` / ``lag`` / ``metrics_path``, a step < ``steps`` (else nothing is left
    to do), the weight versions steps ``step - lag .. step`` need, and a metrics.jsonl at least as long as the
    checkpoint's offset. Returns the checkpoint's step; any failure is one ``ConfigError`` naming ``--resume``."""
    import pickle
    import zipfile

    def refuse(why: str):
        raise ConfigError(f"--resume: {path} is not a readable checkpoint ({why}); restore it, or start the run "
                          "again in another --out")

    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            pkl = [n for n in names if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(pkl) != 1:
                refuse("a zip, but not one torch.save wrote")
            packed = [i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED]
            if packed:  # torch.save stores every record uncompressed; a compressed one could be a zip bomb
                refuse(f"record {packed[0]} is compressed, which torch.save never writes")
            if z.getinfo(pkl[0]).file_size > _MAX_CHECKPOINT_PICKLE_BYTES:
                refuse(f"its pickle is {z.getinfo(pkl[0]).file_size} bytes, more than a checkpoint's description of "
                       f"its tensors ({_MAX_CHECKPOINT_PICKLE_BYTES} at most)")
            bad = z.testzip()
            if bad is not None:
                refuse(f"record {bad} fails its CRC check: the file is corrupt")
            prefix = pkl[0][: -len("data.pkl")]
            storages: list[str] = []

            class Reader(pickle.Unpickler):
                def find_class(self, module, name):
                    return _Opaque

                def persistent_load(self, pid):
                    if isinstance(pid, tuple) and len(pid) > 2 and pid[0] == "storage":
                        if not isinstance(pid[2], str) or len(pid[2]) > 64:
                            raise ValueError("a tensor storage key that is not a record name")
                        storages.append(pid[2])
                    return _Opaque()

            with z.open(pkl[0]) as f:
                state = Reader(f).load()
    except ConfigError:
        raise
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        refuse(str(e))
    except Exception as e:  # a pickle that does not unpickle (UnpicklingError, EOFError, an opcode on the wrong type)
        refuse(f"its pickle does not load: {type(e).__name__}: {str(e)[:200] or 'no detail'}")
    missing = sorted({k for k in storages if f"{prefix}data/{k}" not in names})
    if missing:
        refuse(f"tensor data record(s) {', '.join(missing[:3])} missing")
    if not isinstance(state, dict) or type(state) is _Opaque:
        what = "an object" if isinstance(state, _Opaque) else type(state).__name__
        refuse(f"a torch.save archive of {what}, not of this runner's checkpoint")
    absent = [k for k in CHECKPOINT_KEYS if k not in state]
    if absent:
        refuse(f"a torch.save archive without {', '.join(absent)}: not this runner's checkpoint")
    step, offset, history = state["step"], state["metrics_offset"], state["history"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        refuse(f"its step is {_short(step)}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        refuse(f"its metrics.jsonl offset is {_short(offset)}")
    if steps is not None and step >= steps:
        raise ConfigError(f"--resume: the checkpoint is at step {step}, the run has --steps {steps}: nothing to do "
                          f"(pass --steps > {step} to train further)")
    if lag is not None:
        need = [v for v in range(max(0, step - lag), step + 1) if not isinstance(history, dict) or v not in history]
        if need:
            refuse(f"it lacks weight version(s) {', '.join(map(str, need))}, which the next batches are generated "
                   "with")
    if metrics_path is not None:
        size = os.path.getsize(metrics_path) if os.path.isfile(metrics_path) else None
        if size is None or size < offset:
            have = "no metrics.jsonl" if size is None else f"metrics.jsonl has {size} bytes"
            raise ConfigError(f"--resume: the checkpoint continues metrics.jsonl at byte {offset}, but {have} (it was "
                              "cut or removed); restore it, or start the run again in another --out")
    return step


# Upper bounds of integer flags that reach a library with a fixed-width argument (a larger one crashed there, after
# the model build): --seed seeds vLLM's engine, whose set_random_seed calls numpy.random.seed (0 <= seed < 2**32;
# torch.manual_seed takes 64 bits); --threads goes to torch.set_num_threads (a C int) — 1024 is far above any CPU
# these runs use. The same bounds for verify, train and demo (their --help states them).
MAX_SEED = 2**32 - 1
MAX_THREADS = 1024
# --a-range: the task draws a < A with torch.randint (the supervised warm-up) and numpy's integers, int64 bounds
MAX_A_RANGE = 2**63 - 1

MODES = ("sync", "async")
KERNEL_SETS = ("standard", "aligned")
TINY_MODELS = ("moe", "dense")
BACKENDS = ("processes", "ray")
TRAIN_SCOPES = ("all", "head")
ADVANTAGES = ("grpo", "rloo", "group_mean")
REWARDS = tuple(REWARD_KINDS)


class ConfigError(ValueError):
    """A bad run setting, named by its ``aligned-ops train`` flag."""


@dataclass
class RunConfig:
    """One RL run. Defaults are ``aligned-ops train``'s; ``aligned-ops demo`` runs four of these (apps/demo.py)."""

    out: str = "train_out"                 # --out: metrics.jsonl, summary.json, checkpoint/, model/
    mode: str = "async"                    # --mode sync|async
    max_lag: int | None = None             # --max-lag K (async: default 1; sync: 0)
    kernels: str = "aligned"               # --kernels aligned|standard (both sides)
    linear: str | None = None              # --linear: aligned kernels' linear profile (default ALIGNED_OPS_LINEAR)
    model: str | None = None               # --model DIR (default: the built-in tiny model, see `tiny`)
    tiny: str = "moe"                      # --tiny moe|dense: which built-in model when --model is not given
    dtype: str = "bfloat16"                # --dtype
    steps: int = 60                        # --steps: learner updates
    prompts: int = 32                      # --prompts per batch
    samples: int = 4                       # --samples per prompt (the GRPO group)
    lr: float = 3e-5                       # --lr (AdamW on fp32 master weights)
    lr_warmup: int = 10                    # --lr-warmup: linear warm-up steps
    loss: str = "reinforce_zero"           # --loss: any aligned_ops.rl.LOSS_MODES
    clip_c: float = 2.0                    # --clip-c (tis/seq_tis/ppo_clip truncation)
    advantage: str = "grpo"                # --advantage grpo|rloo|group_mean
    temperature: float = 1.0               # --temperature (sampling and scoring)
    train_scope: str | None = None         # --train-scope all|head (MoE default head)
    freeze_router: bool | None = None      # --freeze-router (MoE default on)
    a_range: int = 1000                    # --a-range: prompts a+b= with a < A, b < 10
    reward: str = "exact"                  # --reward exact|digits (runner.task.AdditionTask.reward)
    seed: int = 0                          # --seed
    d3_from: int | None = None             # --d3-from: first step of the D3 summary (default: --lr-warmup)
    checkpoint_every: int = 10             # --checkpoint-every N steps (and the last step)
    resume: bool = False                   # --resume: continue from out/checkpoint
    backend: str = "processes"             # --backend processes|ray
    rollout_workers: int = 1               # --rollout-workers
    ray_address: str | None = None         # --ray-address (default: start a local head on loopback)
    threads: int = 1                       # --threads per process (rollout worker, learner)
    pin_cores: bool | None = None          # --pin-cores: one core per process (default: when there are enough)
    progress: bool = True                  # --no-progress hides the bar
    # built-in tiny model and its supervised warm-up (ignored with --model)
    hidden: int = 128                      # --hidden
    layers: int = 2                        # --layers
    router_scale: float = 0.08             # --router-scale (MoE)
    logit_scale: float = 1.0               # --logit-scale: the final norm's weight times this (sharper logits)
    sft_steps: int = 60                    # --sft-steps
    sft_lr: float = 3e-3                   # --sft-lr
    extra: dict = field(default_factory=dict)  # free-form notes copied into summary.json (the demo's labels)

    # ---- derived ----------------------------------------------------------------------------------------

    @property
    def lag(self) -> int:
        """The maximum staleness k: batch b is generated with weights version max(0, b - k)."""
        if self.max_lag is not None:
            return self.max_lag
        return 0 if self.mode == "sync" else 1

    @property
    def batch_size(self) -> int:
        return self.prompts * self.samples

    @property
    def summary_from(self) -> int:
        """First step of the D3 summary: --d3-from, else the first step after the lr warm-up (0 for runs that
        end inside it)."""
        if self.d3_from is not None:
            return self.d3_from
        return self.lr_warmup if self.lr_warmup < self.steps else 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # ---- checks -----------------------------------------------------------------------------------------

    def validate(self, check_out: bool = True) -> "RunConfig":
        """Raise :class:`ConfigError` for the first bad setting; fill the MoE/dense defaults. Returns self.
        ``check_out=False`` skips the checks of an earlier run in ``out`` (the demo replaces its own runs)."""
        from ..choices import (  # torch-free: flags are checked before torch loads
            BF16_ONLY_PROFILES, LOSS_MODES, PROFILE_ENV_VAR, resolve_profile_name)

        _choice("--mode", self.mode, MODES)
        _choice("--kernels", self.kernels, KERNEL_SETS)
        _choice("--tiny", self.tiny, TINY_MODELS)
        _choice("--backend", self.backend, BACKENDS)
        _choice("--loss", self.loss, LOSS_MODES)
        _choice("--advantage", self.advantage, ADVANTAGES)
        _choice("--reward", self.reward, REWARDS)
        linear_flag = self.linear is not None
        try:  # decided once, here, and recorded (a resume must run the same one; both sides get it by name)
            self.linear = resolve_profile_name(self.linear)
        except ValueError as e:
            raise ConfigError(f"--linear: {e}") from None
        _choice("--dtype", self.dtype, ("bfloat16", "float32", "float16"))
        if self.kernels != "standard" and self.linear in BF16_ONLY_PROFILES and self.dtype != "bfloat16":
            # (torch-free; the matrix unit itself is checked where the engine starts)
            raise ConfigError(f"--linear {self.linear} takes --dtype bfloat16 (its matrix units multiply bf16), got "
                              f"{self.dtype}")
        if self.kernels != "standard":  # the machine has the profile's unit (mma: loads torch to ask; verify's check)
            check_profile_runs_here(self.linear, self.dtype, "--linear" if linear_flag else PROFILE_ENV_VAR)
        for name in ("steps", "prompts", "samples", "checkpoint_every", "rollout_workers", "threads", "layers",
                     "a_range"):
            _at_least(name, getattr(self, name), 1)
        for name in ("lr_warmup", "seed", "sft_steps"):
            _at_least(name, getattr(self, name), 0)
        _at_most("seed", self.seed, MAX_SEED)
        _at_most("threads", self.threads, MAX_THREADS)
        _at_most("a_range", self.a_range, MAX_A_RANGE)
        if self.rollout_workers > self.steps:  # worker w generates batches w, w + W, ...: one past --steps makes none
            raise ConfigError(f"--rollout-workers {self.rollout_workers} must be <= --steps {self.steps}: worker w "
                              "generates batches w, w + W, ..., so a worker beyond the steps would only start an engine")
        for name in ("lr", "clip_c", "router_scale", "sft_lr", "logit_scale"):
            _positive(name, getattr(self, name))
        check_temperature_flag(self.temperature)
        if self.max_lag is not None:
            _at_least("max_lag", self.max_lag, 0)
            if self.mode == "sync" and self.max_lag != 0:
                raise ConfigError(f"--max-lag {self.max_lag} with --mode sync: sync means lag 0 (use --mode async)")
            if self.mode == "async" and self.max_lag == 0:
                raise ConfigError("--max-lag 0 with --mode async: lag 0 is --mode sync")
        if self.d3_from is not None:
            _at_least("d3_from", self.d3_from, 0)
        if self.samples < 2:  # every advantage is relative to the prompt's group: a group of one gets A = 0
            raise ConfigError(f"--samples must be >= 2 for --advantage {self.advantage} (a group needs two samples: "
                              "a group of one has advantage 0, the run would never learn)")
        if self.hidden < 8 or self.hidden % 8:
            raise ConfigError(f"--hidden must be a positive multiple of 8 (4 heads of an even head_dim), got {self.hidden}")
        memory = physical_memory_bytes()
        # a batch's prompt token ids (int64, "a+b=" each: the digits of a, "+", one digit, "="), which the learner,
        # the queue and the engine all hold: a floor; --prompts 10**23 ran until a worker's draw failed
        batch_bytes = 8 * self.prompts * self.samples * (len(str(self.a_range - 1)) + 3)
        if memory is not None and batch_bytes > memory:
            raise ConfigError(f"--prompts {self.prompts} x --samples {self.samples}: one batch's prompt token ids alone "
                              f"take {approx(batch_bytes, 2**30)} GiB, more than this machine's {approx(memory, 2**30)} GiB "
                              "of memory")
        if self.model is None and memory is not None:
            # a floor (fp32 weights once; the learner also keeps masters and AdamW state): beyond the machine's
            # memory the model build ended in an allocator traceback (--hidden 100000000) or ran for ever (--layers)
            n = tiny_parameter_count(self.tiny, self.hidden, self.layers)
            if 4 * n > memory:
                raise ConfigError(
                    f"--hidden {self.hidden} --layers {self.layers}: the built-in tiny {self.tiny} model would have "
                    f"{approx(n)} parameters, {approx(4 * n, 2**30)} GiB in fp32 alone, more than this machine's "
                    f"{approx(memory, 2**30)} GiB of memory (--model takes a checkpoint)")
        if self.model is None and self.tiny == "dense":  # the tiny MoE has head_dim 32 at any --hidden
            head = self.hidden // TINY_DENSE_HEADS
            if head not in VLLM_CPU_ATTENTION_HEAD_SIZES:
                ok = [TINY_DENSE_HEADS * h for h in VLLM_CPU_ATTENTION_HEAD_SIZES]
                raise ConfigError(f"--hidden {self.hidden} gives head size {head} ({TINY_DENSE_HEADS} heads), which "
                                  f"vLLM-CPU's attention does not take; use one of {', '.join(map(str, ok))}")
        if self.ray_address is not None and self.backend != "ray":
            raise ConfigError("--ray-address needs --backend ray")
        if self.backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ConfigError("--backend ray: the ray package is not installed (pip install ray)")
        if os.path.exists(self.out) and not os.path.isdir(self.out):
            raise ConfigError(f"--out {self.out}: exists and is not a folder")
        ckpt = os.path.join(self.out, "checkpoint", "state.pt")
        if check_out and not os.path.isfile(ckpt) and os.path.isfile(os.path.join(self.out, "metrics.jsonl")):
            # a run killed before its first checkpoint: nothing to resume, and a new run must not append to it
            raise ConfigError(f"--out {self.out} holds a run with no checkpoint (interrupted before its first save, "
                              "so there is nothing to resume): remove that folder or choose another --out")
        if check_out and self.resume and not os.path.isfile(ckpt):
            raise ConfigError(f"--resume: no checkpoint in {self.out} (expected {ckpt})")
        if check_out and self.resume:  # the settings first: the checkpoint's check reads --steps and the lag
            self._check_resume_matches(os.path.join(self.out, "checkpoint", "config.json"))
            check_checkpoint_file(ckpt, self.steps, self.lag, os.path.join(self.out, "metrics.jsonl"))
        if self.summary_from >= self.steps:  # after --resume took the run's --d3-from
            raise ConfigError(f"--d3-from {self.summary_from} must be < --steps {self.steps}: the D3 summary would "
                              "have no step")
        if check_out and not self.resume and os.path.isfile(os.path.join(self.out, "metrics.jsonl")):
            raise ConfigError(f"--out {self.out} already holds a run (metrics.jsonl); pass --resume to continue "
                              "it or choose another folder")
        moe = self.is_moe()
        if self.train_scope is None:
            self.train_scope = "head" if moe else "all"
        if self.freeze_router is None:
            self.freeze_router = moe
        _choice("--train-scope", self.train_scope, TRAIN_SCOPES)
        if self.train_scope == "head" and not moe:
            raise ConfigError("--train-scope head needs a MoE model (it trains the weights after the last router)")
        if check_out:  # last: no folder is made for a command refused for another flag
            check_writable_folder(self.out)
        return self

    # what a resumed run may change: how it runs, not what it computes
    RESUME_MAY_CHANGE = ("steps", "resume", "progress", "out", "checkpoint_every", "threads", "pin_cores", "backend",
                         "ray_address", "extra")

    # flags whose omission (None) means a default: a resume that omits one continues with the run's value
    RESUME_OMITTED_TAKES_THE_RUNS = ("max_lag", "d3_from", "train_scope", "freeze_router", "model")

    def _check_resume_matches(self, path: str) -> None:
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--resume: cannot read the run's settings ({path}: {e})") from None
        mine = self.to_dict()
        taken = [k for k in self.RESUME_OMITTED_TAKES_THE_RUNS if mine.get(k) is None and saved.get(k) is not None]
        diff = [k for k in mine if k not in self.RESUME_MAY_CHANGE and k not in taken and k in saved
                and saved[k] != mine[k]]
        if diff:
            raise ConfigError("--resume with other settings than the run in --out: " + ", ".join(
                f"{_flag(k)} {mine[k]} (the run has {saved[k]})" for k in diff))
        for k in taken:  # not the default's value: a run with --max-lag 3 resumed without it ran at lag 1
            setattr(self, k, saved[k])

    def linear_profile(self):
        """The :mod:`aligned_ops.profiles` object both sides run with aligned kernels."""
        from .. import profiles

        return profiles.resolve(self.linear)

    def is_moe(self) -> bool:
        if self.model is None:
            return self.tiny == "moe"
        # a supported architecture, or a ConfigError naming the folder; the head size only matters where the stock
        # engine runs
        read_model_config(self.model, stock_engine=self.kernels == "standard")
        from .trainer import is_moe_model

        return is_moe_model(self.model)


def _fill_class_defaults(fields, model_type: str) -> None:
    """Set on ``fields`` (a config.json's fields) the RoPE base transformers' config class gives a config.json that
    leaves it out (Llama-2's has no ``rope_theta``): both sides load the checkpoint through that class, so they run
    its default, and the checks must read the same. Imported only when the field is missing (transformers takes
    seconds to import); an unknown ``model_type`` fills nothing (the checks refuse its architecture)."""
    from ..rope import hf_rope_params

    try:
        params = hf_rope_params(fields)
    except (TypeError, ValueError):  # not a mapping: the checks refuse it by name
        params = {}
    if getattr(fields, "rope_theta", None) is not None or "rope_theta" in params:
        return
    if hasattr(fields, "rope_theta"):  # an explicit null is the config's own value: the checks refuse it
        return
    try:
        from transformers import AutoConfig

        defaults = AutoConfig.for_model(model_type)
    except (ImportError, ValueError, KeyError):
        return
    from ..integrations import rope_theta_of

    try:
        fields.rope_theta = rope_theta_of(defaults)
    except ValueError:  # a class without a RoPE base: nothing to fill
        pass


def read_model_config(path: str, stock_engine: bool = True) -> dict:
    """config.json of a model folder, checked for an architecture both sides support (no engine) and, with
    ``stock_engine``, for a head size vLLM-CPU's own attention takes."""
    from types import SimpleNamespace

    # the folder and its JSON first, torch-free: a wrong --model fails in well under a second (the integrations
    # package loads torch, ~2-3 s)
    if os.path.isfile(path):
        raise ConfigError(f"--model {path}: is a file; --model takes the checkpoint folder (the one holding "
                          "config.json and the weights)")
    if not os.path.isdir(path):
        raise ConfigError(f"--model {path}: no such directory (pass a local checkpoint folder)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"--model {path}: no config.json in that folder (not a Hugging Face checkpoint)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {path}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model {path}: config.json is not a JSON object")
    # transformers (AutoConfig / AutoModelForCausalLM) and vLLM pick the config class by model_type: without one
    # both fail when they load the folder (vLLM after its ~17 s start-up, with a traceback)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        got = "it has none" if model_type is None else f"got {model_type!r}"
        raise ConfigError(f"--model {path}: config.json needs a model_type (e.g. \"qwen2\"; transformers and vLLM "
                          f"read it to load the checkpoint), {got}")
    if not cfg.get("architectures"):  # absent, null or []
        raise ConfigError(f"--model {path}: config.json has no architectures (e.g. [\"Qwen2ForCausalLM\"]: the "
                          "model class both sides build)")
    from ..integrations import check_hf_config

    fields = SimpleNamespace(**cfg)
    _fill_class_defaults(fields, model_type)
    try:
        check_hf_config(fields, "--model")
    except ValueError as e:
        raise ConfigError(f"{e} (folder {path})") from None
    try:
        if cfg.get("qk_rope_head_dim") is not None:  # DeepSeek's MLA, expanded: the attention layer's head size
            head = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg["qk_rope_head_dim"])  # is q/k's (V padded to it)
        else:
            head = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ConfigError(f"--model {path}: config.json has no usable head_dim / hidden_size / num_attention_heads")
    if stock_engine and head not in VLLM_CPU_ATTENTION_HEAD_SIZES:
        raise ConfigError(f"--model {path}: head size {head} is not one vLLM-CPU's attention takes "
                          f"({', '.join(map(str, VLLM_CPU_ATTENTION_HEAD_SIZES))}); the standard run would fail")
    return cfg


def check_profile_runs_here(name: str, dtype: str, where: str) -> None:
    """ConfigError ``"<where> <name>: <reasons>"`` where linear profile ``name`` cannot run a ``dtype`` model on this
    machine (the mma profile: bf16 only, and the CPU's matrix unit). The one check of ``aligned-ops verify``, ``train``
    and ``demo`` (``where``: the flag or setting the user chose it by, named in the advice too). Only a profile of
    ``MODEL_REFUSING_PROFILES`` loads the profile objects (and torch); the others run every model."""
    from ..choices import MODEL_REFUSING_PROFILES, PROFILE_ENV_VAR

    if name not in MODEL_REFUSING_PROFILES:
        return
    from .. import profiles

    bad = profiles.get(name, where).model_refusals(dtype)
    if bad:
        if where != PROFILE_ENV_VAR:  # the advice names the switch the user used ("use --linear fma")
            bad = [r.replace(f"{PROFILE_ENV_VAR}=", f"{where} ") for r in bad]
        raise ConfigError(f"{where} {name}: " + "; ".join(bad))


def check_temperature_flag(value) -> None:
    """``--temperature`` of every command (verify, train, demo): a temperature vLLM samples from (> 0: greedy
    decoding samples no distribution to score or compare) and accepts — its rule for the installed release
    (:func:`aligned_ops.sampling_rules.check_temperature`: vLLM >= 0.24 refuses T > 2)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 < float(value) < math.inf):
        why = " (greedy decoding samples no distribution; use e.g. 1.0)" if value == 0 else ""
        raise ConfigError(f"--temperature must be a finite number > 0, got {value}{why}")
    from ..sampling_rules import check_temperature  # torch-free

    try:
        check_temperature(value, "--temperature")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(map(str, choices))}, got {value!r}")


def _at_least(name: str, value, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{_flag(name)} must be >= {lo}, got {value}")


def _at_most(name: str, value: int, hi: int) -> None:
    if value > hi:
        raise ConfigError(f"{_flag(name)} must be <= {hi}, got {value}")


def _positive(name: str, value) -> None:
    if not isinstance(value, (int, float)) or not (0.0 < float(value) < math.inf):
        raise ConfigError(f"{_flag(name)} must be a finite number > 0, got {value}")
