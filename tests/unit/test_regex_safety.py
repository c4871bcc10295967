"""The static regex check: the classic catastrophic patterns are refused, everyday ones pass."""

from __future__ import annotations

import pytest

from services.processor.expressions.regex_safety import MAX_PATTERN_LENGTH, like_problem, regex_problem


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(a+)+$", "nested quantifiers"),
        ("^(.*a){10}$", "nested quantifiers"),
        ("(a?){20}", "nested quantifiers"),
        ("(a|aa)*b", "alternatives"),
        ("(\\d|x)+", "alternatives"),
        (".*a.*a.*a.*a", "open quantifiers"),
        ("(a)\\1", "ackreference"),
        ("a" * (MAX_PATTERN_LENGTH + 1), "longer than"),
        ("(?x)a b", "x"),
    ],
)
def test_patterns_that_can_backtrack_without_bound_are_refused(pattern: str, why: str) -> None:
    problem = regex_problem(pattern)
    assert problem is not None, pattern
    assert why in problem, problem


@pytest.mark.parametrize(
    "pattern",
    [
        "^/products/(\\d+)$",
        "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$",
        "(GET|PUT|DELETE)+",
        "(ab{2})+",
        "\\s+",
        ",",
        "^(?i)mobile",
    ],
)
def test_everyday_patterns_pass(pattern: str) -> None:
    assert regex_problem(pattern) is None


def test_like_patterns_are_limited_in_wildcards() -> None:
    assert like_problem("/products/%") is None
    assert like_problem("%a%b%") is None
    assert like_problem("100\\%%") is None  # an escaped % is a character, not a wildcard
    problem = like_problem("%a%a%a%a%")
    assert problem is not None and "wildcards" in problem
