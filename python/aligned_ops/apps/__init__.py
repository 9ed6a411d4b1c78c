"""Applications over the library: ``aligned-ops`` (:mod:`.cli`) and its jobs, :mod:`.verify` (rollout vs
trainer mismatch) and :mod:`.demo` (a small async RL run). Nothing in the library imports this package."""
