"""Compatibility name of :mod:`aligned_ops.models.tiny`."""
import sys

from ..models import tiny as _tiny

sys.modules[__name__] = _tiny
