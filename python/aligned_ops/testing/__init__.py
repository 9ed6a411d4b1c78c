"""Test helpers shared by the test suite and by anyone checking aligned_ops' claims on their own models.

Bitwise claims are checked on bits, never on values: ``torch.equal(+0., -0.)`` is True and NaN != NaN, so an
equality of values can both hide a difference (the sign of zero) and invent one (NaN). ``bits`` reinterprets
a floating tensor as the signed integers of the same width; ``assert_bitwise_equal`` compares those.
"""

from .bits import assert_bitwise_equal, bits, bitwise_equal, count_bitwise_equal

__all__ = ["assert_bitwise_equal", "bits", "bitwise_equal", "count_bitwise_equal"]
