"""The paired statistic every side-by-side reports: the median of per-round ratios and what the rounds show."""

from __future__ import annotations

import json
import math

import pytest

from prefixkv.bench.paired import from_ratios, paired, sign_test_p


def test_the_median_of_per_round_ratios_is_not_the_ratio_of_medians():
    """A ahead of B only in the round where both were slow: the ratio of the medians (2.0 / 2.0 = 1) hides the
    rounds, the per-round ratios show A behind in two of three."""
    a, b = [1.0, 2.0, 3.0], [1.1, 2.2, 1.0]
    p = paired(a, b)
    assert p.ratios == pytest.approx((1 / 1.1, 2 / 2.2, 3.0))
    assert p.median == pytest.approx(2 / 2.2) and (p.ahead, p.behind) == (1, 2)


def test_times_are_compared_the_other_way():
    p = paired([0.5, 0.5], [1.0, 1.5], higher_is_better=False)  # A takes half the time: A ahead
    assert p.ratios == (2.0, 3.0) and p.kind == "every round ahead"


def test_verdicts_say_only_what_the_rounds_show():
    assert from_ratios([1.2, 1.1, 1.3]).verdict == "every round ahead (3 of 3)"
    assert from_ratios([1.2]).verdict == "ahead in its only round (too few to test)"
    assert from_ratios([0.9, 0.8]).kind == "every round behind"
    tie = from_ratios([1.1] * 16 + [0.9] * 9)  # 16 of 25 ahead: a fair coin gives such a split often enough
    assert tie.kind == "tie" and tie.verdict.startswith("a tie within the noise (16 of 25 rounds ahead, 9 behind")
    assert from_ratios([1.1] * 9 + [0.9]).kind == "ahead"  # 9 of 10 is not a coin's split


def test_sign_test():
    assert sign_test_p(5, 5) == 1.0 and sign_test_p(0, 0) == 1.0
    assert sign_test_p(10, 0) == pytest.approx(2 / 2**10)
    assert sign_test_p(16, 9) == pytest.approx(0.2295, abs=1e-4)


def test_a_missing_round_is_listed_and_never_counted_ahead():
    p = paired([1.2, None, 1.3], [1.0, 1.0, float("nan")])
    assert math.isnan(p.ratios[1]) and math.isnan(p.ratios[2]) and p.missing == 2 and p.ahead == 1
    assert p.kind == "tie"  # one measured round: too few to call
    assert "1 of 3 missing" in from_ratios([1.2, None, 1.1]).verdict  # never 'every round ahead'
    as_json = json.loads(json.dumps(p.as_dict(), allow_nan=False))  # strict JSON: nan becomes null
    assert as_json["ratios"][1] is None and as_json["missing"] == 2
    assert p.per_round() == "1.20 - -"


def test_rounds_must_pair_up():
    with pytest.raises(ValueError, match="as many values"):
        paired([1.0, 2.0], [1.0])
