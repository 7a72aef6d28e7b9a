"""Divisors in bounded time: the degrees a dimension can take, and the short lists that error messages suggest.

Both are called with numbers a user typed (model.dim, n_heads, a world size), so neither may loop up to the number
itself: `divisors` pairs each divisor below the square root with its cofactor, and `divisor_hint` also stops trial
division at HINT_TRIALS, so a message is built in bounded time whatever the value (model.dim = 10**30 included).
"""

from __future__ import annotations

from math import isqrt

HINT_COUNT = 12  # divisors a message lists at most
HINT_TRIALS = 100_000  # trial divisions a message spends at most


def divisors(n: int) -> list[int]:
    """Every divisor of n >= 1, ascending, in O(sqrt n) steps (callers bound n: a world size, a head count)."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def divisor_hint(n: int, count: int = HINT_COUNT) -> list[int]:
    """Up to `count` of the smallest divisors of n >= 1, ascending, for a message's 'choose from': bounded time for
    any n (when n has no cofactor found under HINT_TRIALS, only the small divisors found are listed)."""
    root = isqrt(n)
    small = []
    for d in range(1, min(root, HINT_TRIALS) + 1):
        if n % d == 0:
            small.append(d)
            if len(small) == count:
                return small
    if root > HINT_TRIALS:
        return small + [n]
    return (small + [n // d for d in reversed(small) if d * d != n])[:count]
