"""Compatibility name of :mod:`aligned_ops.models.spec`."""
import sys

from .models import spec as _spec

sys.modules[__name__] = _spec
