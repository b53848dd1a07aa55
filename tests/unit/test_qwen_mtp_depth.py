"""Qwen3.8's MTP depth policy (ds4-spec §5, `qwen4_spec_depth`) on scripted outcomes: a cycle at
depth 2 proposes 1 draft, at depth 3 2; `record(proposed, accepted)` is the loop's result."""

import pytest

from ds4tvm.errors import Ds4Error
from ds4tvm.runtime.drafters.qwen_mtp import DepthPolicy

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def adaptive(monkeypatch):
    monkeypatch.delenv("DS4_QWEN4_MTP_DEPTH", raising=False)


def _run(policy: DepthPolicy, outcomes, exact: bool = False) -> list[int]:
    """The depth chosen before each cycle; outcomes: drafts accepted per cycle."""
    depths = []
    for accepted in outcomes:
        depth = policy.choose(exact)
        depths.append(depth)
        policy.record(depth - 1, min(accepted, depth - 1))
    return depths


def test_promotes_after_eight_clean_cycles():
    assert _run(DepthPolicy(), [1] * 10) == [2] * 8 + [3] * 2


def test_a_miss_in_the_window_delays_promotion_by_eight_cycles():
    assert _run(DepthPolicy(), [1] * 5 + [0] + [1] * 9) == [2] * 14 + [3]


def test_demotes_when_fewer_than_six_of_eight_first_drafts_were_accepted():
    p = DepthPolicy()
    _run(p, [2] * 8)
    assert _run(p, [2, 0, 0, 0, 2]) == [3, 3, 3, 3, 2]   # 6 of 8 set: stays; 5: demoted


def test_demotes_after_two_second_draft_rejections_in_a_row():
    p = DepthPolicy()
    _run(p, [2] * 8)
    assert _run(p, [1, 2, 1, 1, 2]) == [3, 3, 3, 3, 2]   # the streak resets on an accepted d2


def test_no_promotion_while_a_second_draft_rejection_is_pending():
    p = DepthPolicy(depth=3, window=0xFF, cycles=8)
    assert _run(p, [1, 1]) == [3, 3] and p.choose(False) == 2
    assert _run(p, [1] * 9) == [2] * 9    # d2 never tried at depth 2: the streak stays, no promotion


def test_the_variable_pins_the_depth_and_is_read_every_cycle(monkeypatch):
    p = DepthPolicy()
    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", "3")
    assert _run(p, [0, 0, 0]) == [3, 3, 3]
    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", "2")
    assert _run(p, [1] * 12) == [2] * 12
    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", "0")
    assert _run(p, [1]) == [3]     # adaptive again: the clean window promotes at once
    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", "4")
    with pytest.raises(Ds4Error, match="DS4_QWEN4_MTP_DEPTH=4: expected 2 or 3"):
        p.choose(False)


def test_exact_sampling_pins_depth_two_over_the_variable(monkeypatch):
    assert _run(DepthPolicy(), [1] * 20, exact=True) == [2] * 20
    monkeypatch.setenv("DS4_QWEN4_MTP_DEPTH", "3")
    assert _run(DepthPolicy(), [1] * 3, exact=True) == [2] * 3
