"""Soft overlong penalty (DAPO / Magistral) and the token-count estimate."""
from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_rl.reward.length import estimate_tokens, overlong_penalty


def reference(n: int, l_max: int, l_cache: int, p: Fraction) -> Fraction:
    """Exact rational reference of the piecewise formula."""
    if n <= l_max - l_cache:
        return Fraction(0)
    if n <= l_max:
        return -p * Fraction(n - l_max + l_cache, l_cache)
    return -p


@pytest.mark.parametrize("l_max, l_cache, p", [(4096, 512, "0.1"), (100, 20, "0.3"), (10, 10, "1")])
def test_matches_exact_reference_on_every_length(l_max, l_cache, p):
    p = Fraction(p)
    prev = 0.0
    for n in range(0, l_max + 50):
        got = overlong_penalty(n, l_max, l_cache, float(p))
        assert got == pytest.approx(float(reference(n, l_max, l_cache, p)), abs=1e-12)
        assert got <= prev + 1e-15  # non-increasing in the length
        prev = got


def test_landmarks_with_magistral_defaults():
    assert overlong_penalty(3584, 4096, 512) == 0.0
    assert overlong_penalty(3585, 4096, 512) == pytest.approx(-0.1 / 512)
    assert overlong_penalty(3840, 4096, 512) == pytest.approx(-0.05)
    assert overlong_penalty(4096, 4096, 512) == pytest.approx(-0.1)
    assert overlong_penalty(10**6, 4096, 512) == pytest.approx(-0.1)


def test_zero_cache_is_a_step_at_l_max():
    assert overlong_penalty(100, 100, 0) == 0.0
    assert overlong_penalty(101, 100, 0) == pytest.approx(-0.1)


@pytest.mark.parametrize("args", [(-1, 10, 5), (5, 0, 0), (5, 10, 11), (5, 10, -1)])
def test_invalid_arguments(args):
    with pytest.raises(ValueError):
        overlong_penalty(*args)


def test_estimate_tokens():
    assert estimate_tokens("") == 0
    assert estimate_tokens("a" * 400) == 100
    assert estimate_tokens("a" * 401) == 101
    assert estimate_tokens("我们计算方程") == 6  # one per CJK character
    assert estimate_tokens("abcd我们") == 3


@pytest.mark.parametrize("p", ["0.1", "0.3", "0.7"])
def test_exactly_minus_p_at_l_max_and_within_an_ulp_on_the_ramp(p):
    """At len == l_max the ramp ends at -p exactly (the same value as every longer length), whatever
    l_cache; inside the ramp the float is the correctly rounded rational up to ~2 ulp."""
    pf = float(p)
    for l_cache in range(1, 400):
        l_max = 1000
        assert overlong_penalty(l_max, l_max, l_cache, pf) == -pf == overlong_penalty(l_max + 1, l_max, l_cache, pf)
        assert overlong_penalty(l_max - l_cache, l_max, l_cache, pf) == 0.0
        for n in (l_max - l_cache + 1, l_max - l_cache // 2, l_max - 1):
            want = reference(n, l_max, l_cache, Fraction(pf))
            if want:
                assert abs(Fraction(overlong_penalty(n, l_max, l_cache, pf)) - want) <= abs(want) * Fraction(1, 2**51)
