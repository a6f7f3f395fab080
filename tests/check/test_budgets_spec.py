"""Budgets-file units and forms: "80GB" is 10^9-based, "80GiB" 2^30-based; nothing is guessed."""

from __future__ import annotations

import pytest

from memplan.check.spec import Budget, BudgetsFile, parse_budget, parse_share, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GB", 80 * 10**9),
        ("80GiB", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512MiB", 512 * 2**20),
        ("4KiB", 4096),
        ("100B", 100),
        (123456789, 123456789),
    ],
)
def test_sizes(text, size):
    assert parse_size(text) == size


def test_gb_and_gib_differ_by_seven_percent():
    assert parse_size("80GiB") / parse_size("80GB") == pytest.approx(1.073741824)


@pytest.mark.parametrize(
    "text", ["80G", "80", "80Gb", "80 gigs", "80GiB/s", "80TFLOPS", "-5GiB", "0GiB", 0, -1, 1.5, True]
)
def test_sizes_without_a_clear_unit_are_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(("text", "share"), [("10%", 0.10), ("0%", 0.0), ("2.5 %", 0.025), ("4GiB", 4 * 2**30), (0, 0)])
def test_shares(text, share):
    assert parse_share(text) == share


@pytest.mark.parametrize("text", ["100%", "150%", 0.1, "ten percent", "4G"])
def test_bad_shares(text):
    with pytest.raises(ValueError):
        parse_share(text)


def test_budget_forms_and_limits():
    capacity = 80 * 2**30
    fixed = Budget(**parse_budget("70GiB"))
    assert fixed.limit(capacity) == 70 * 2**30
    share = Budget(**parse_budget({"fits": True, "headroom": "10%"}))
    assert share.limit(capacity) == int(capacity * 0.9)
    spare = Budget(**parse_budget({"fits": True, "headroom": "4GiB"}))
    assert spare.limit(capacity) == 76 * 2**30
    assert Budget(**parse_budget({"fits": True})).limit(capacity) == capacity


@pytest.mark.parametrize(
    ("value", "word"),
    [
        ({"fits": False}, "fits: true"),
        ({"headroom": "10%"}, "fits: true"),
        ({"fits": True, "margin": "10%"}, "margin"),
        ({"fits": True, "headroom": "10"}, "headroom"),
    ],
)
def test_bad_budget_mappings(value, word):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    assert word in str(err.value)


def test_file_defaults():
    spec = BudgetsFile.model_validate({"entries": [{"name": "a", "model": "llama3-8b", "budget": "70GiB"}]})
    assert spec.metric == "reserved"
    assert spec.threshold == 0.02
