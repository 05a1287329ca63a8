"""Paired comparisons of two sides measured in alternating rounds: the one statistic every side-by-side reports.

On a shared machine the speed moves between rounds by more than most differences being measured, and it moves
both sides of a round alike (they run seconds apart). So the ratio is taken per round, A against B of the same
round, and the figure is the median of those ratios, never the ratio of two medians (which pairs A's median round
with some other round of B's and can put a side ahead that no round had ahead). Every round's ratio is kept.

The verdict says what the rounds show, no more: "every round ahead" only when every round is; otherwise how many
rounds were ahead and behind, and "a tie within the noise" when the split is one a fair coin would give at least
one time in twenty (two-sided sign test, p >= 0.05): ahead in 16 of 25 rounds is such a split, 9 of 10 is not.
A round with a side missing (nan) is listed and counted as missing, never as ahead or behind.
Plain Python (no torch): the comparison scripts' orchestrators import it too.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

SIGN_TEST_ALPHA = 0.05


def _finite_positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def round_ratio(a: float | None, b: float | None, higher_is_better: bool = True) -> float:
    """A against B in one round, > 1 when A is ahead: a / b for rates, b / a for times; nan for a missing value."""
    if not (_finite_positive(a) and _finite_positive(b)):
        return math.nan
    assert a is not None and b is not None
    return a / b if higher_is_better else b / a


def sign_test_p(ahead: int, behind: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven from a fair coin (rounds at exactly 1 are
    left out, as the test does)."""
    n = ahead + behind
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(ahead, behind) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclasses.dataclass(frozen=True)
class Paired:
    """The per-round ratios (> 1: A ahead; nan: a round with a side missing), their median and what they show."""

    ratios: tuple[float, ...]
    median: float
    ahead: int
    behind: int
    even: int  # rounds at exactly 1
    missing: int  # rounds without a ratio
    p_value: float

    @property
    def rounds(self) -> int:
        return len(self.ratios)

    @property
    def measured(self) -> int:
        return self.ahead + self.behind + self.even

    @property
    def kind(self) -> str:
        """'every round ahead', 'ahead', 'tie', 'behind', 'every round behind' or 'no rounds'."""
        n = self.measured
        if n == 0:
            return "no rounds"
        if self.ahead == n and not self.missing:
            return "every round ahead"
        if self.behind == n and not self.missing:
            return "every round behind"
        if self.p_value < SIGN_TEST_ALPHA:
            return "ahead" if self.ahead > self.behind else "behind"
        return "tie"

    @property
    def verdict(self) -> str:
        """'every round ahead (5 of 5)', 'every round behind (5 of 5)' ('ahead in its only round' for one), or
        'ahead' / 'behind' / 'a tie within the noise' with the counts and the sign test's p."""
        kind, n = self.kind, self.measured
        if kind == "no rounds":
            return "no rounds"
        if kind.startswith("every round"):
            return f"{kind} ({n} of {n})" if n > 1 else f"{kind.split()[-1]} in its only round (too few to test)"
        counts = f"{self.ahead} of {n} rounds ahead, {self.behind} behind"
        if self.even:
            counts += f", {self.even} even"
        if self.missing:
            counts += f"; {self.missing} of {self.rounds} missing"
        head = "a tie within the noise" if kind == "tie" else kind
        return f"{head} ({counts}; sign test p = {self.p_value:.2g})"

    def per_round(self, digits: int = 2, sep: str = " ") -> str:
        return sep.join("-" if math.isnan(r) else f"{r:.{digits}f}" for r in self.ratios)

    def describe(self, digits: int = 2) -> str:
        """One line: the median of the per-round ratios, the verdict and every round's ratio."""
        median = "-" if math.isnan(self.median) else f"{self.median:.{digits}f}x"
        rounds = self.per_round(digits)
        return f"{median} (median of {self.rounds} per-round ratios; {self.verdict}; per round: {rounds})"

    def as_dict(self) -> dict:
        """For a result's JSON (strict JSON: a missing round or median is null): the ratios, their median, the
        counts and the verdict."""

        def finite(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {
            "ratios": [finite(r) for r in self.ratios],
            "median": finite(self.median),
            "rounds": self.rounds,
            "ahead": self.ahead,
            "behind": self.behind,
            "even": self.even,
            "missing": self.missing,
            "sign_test_p": self.p_value,
            "kind": self.kind,
            "verdict": self.verdict,
        }


def from_ratios(ratios: Sequence[float | None]) -> Paired:
    """The summary of per-round ratios already taken (> 1: A ahead); a missing round (None, nan, or not a positive
    number) is kept in the list as nan and counted as missing."""
    kept = tuple(float(r) if _finite_positive(r) else math.nan for r in ratios)  # type: ignore[arg-type]
    finite = [r for r in kept if not math.isnan(r)]
    ahead = sum(r > 1 for r in finite)
    behind = sum(r < 1 for r in finite)
    return Paired(
        ratios=kept,
        median=statistics.median(finite) if finite else math.nan,
        ahead=ahead,
        behind=behind,
        even=len(finite) - ahead - behind,
        missing=len(kept) - len(finite),
        p_value=sign_test_p(ahead, behind),
    )


def paired(a: Sequence[float | None], b: Sequence[float | None], higher_is_better: bool = True) -> Paired:
    """A against B round by round (a[k] and b[k] from the same round; > 1: A ahead)."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds need as many values of each side, got {len(a)} and {len(b)}")
    return from_ratios([round_ratio(x, y, higher_is_better) for x, y in zip(a, b)])
