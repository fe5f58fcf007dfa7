"""Speculative decoding with EAGLE-1 and EAGLE-3 heads (chains): greedy identity to AR for every
policy with EAGLE-3 and the policies that exercise EAGLE-1's own paths (spec_tiny.combos). Tiny random models (spec_tiny.py), one compile per combination; the other drafters are in
test_spec.py, trees in test_tree.py."""

import pytest
from spec_tiny import check_greedy_identical_to_ar, combos, make_target


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.mark.parametrize("drafter_name,policy_name", combos(("eagle", "eagle3")))
def test_greedy_identical_to_ar(target, drafter_name, policy_name):
    check_greedy_identical_to_ar(target, drafter_name, policy_name)
