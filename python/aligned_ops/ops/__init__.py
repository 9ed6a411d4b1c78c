"""The op families' Python side, one module each: fake (meta) impls for torch.compile, autograd formulas,
documented wrappers. Schemas and checks live in C++ (csrc/torch/bindings.cpp, csrc/torch/checks/).

- :mod:`.dense`        norms, activation, rotary;
- :mod:`.linear`       the ``fma`` profile: ``linear``, its 8 lanes (``linear_partial``, TP helpers, ``tree_combine``);
- :mod:`.linear_exact` the ``exact`` profile (integer-MMA linear), its packed-weight cache (the profiles as objects:
  :mod:`aligned_ops.profiles`);
- :mod:`.linear_mma`   the ``mma`` profile (the matrix unit's bf16 instruction in the 8 lanes), its unit check;
- :mod:`.logits`       log_softmax, logsumexp, token_logprobs (fp32, at a temperature);
- :mod:`.lm_head`      the fused LM-head log-prob (no [T, V] logits, the unfused bits);
- :mod:`.attention`    varlen / paged attention, cache write;
- :mod:`.mla`          latent (MLA) attention over the shared [latent || rope] row, its cache write;
- :mod:`.moe`          routing and experts;
- :mod:`.collective`   the tree all-reduce that finishes the linear tree across TP ranks (Python, no kernel).
- :mod:`.device_errors` the GPU ops' in-kernel value checks, read back outside the hot path.

Importing this package registers all of them; ``_registry`` holds what they share (``register_no_backward``).
"""

from .._extension import load_extension

load_extension()  # the compiled ops first (loaded already unless the aligned-ops command deferred it)

from . import dense  # noqa: F401, E402
from . import linear  # noqa: F401, E402
from . import logits  # noqa: F401, E402
from . import collective  # noqa: F401, E402
from . import linear_exact  # noqa: F401, E402
from . import linear_mma  # noqa: F401, E402
from . import attention  # noqa: F401, E402
from . import mla  # noqa: F401, E402
from . import moe  # noqa: F401, E402
from . import device_errors  # noqa: F401, E402
from . import lm_head  # noqa: F401, E402
