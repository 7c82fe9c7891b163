"""Needs attention (watchdog/mlx_watchdog/attention.py): a class a restart
cannot fix, on three starts in a row. Pure: driven with class names, with the
real table of signatures deciding which classes a restart cannot fix."""

from __future__ import annotations

import pytest

from mlx_watchdog import signatures
from mlx_watchdog.attention import NEEDS_ATTENTION_STARTS, AttentionTracker

CONFIG = "config-missing-parameters"


def test_three_starts_in_a_row_need_attention_and_the_remedy_is_said_once():
    tracker = AttentionTracker()
    assert NEEDS_ATTENTION_STARTS == 3
    assert tracker.observe(CONFIG) is None
    assert tracker.observe(CONFIG) is None
    first = tracker.observe(CONFIG)
    assert first is not None and first.announce
    assert (first.cause, first.starts) == (CONFIG, 3)
    assert first.remedy == signatures.entry(CONFIG).remedy
    assert first.message() == (f"needs attention: {CONFIG} on 3 starts in a row, and a restart "
                               f"cannot fix it; {first.remedy}")
    # Restarts go on; the state holds, and the remedy is not said again.
    for starts in (4, 5, 6):
        again = tracker.observe(CONFIG)
        assert again is not None and not again.announce and again.starts == starts
    assert tracker.current == again


def test_restarts_wait_at_the_cap_while_attention_is_needed():
    tracker = AttentionTracker()
    assert tracker.wait_s(2.0, 60.0) == 2.0
    for _ in range(3):
        tracker.observe("config-model-path")
    assert tracker.wait_s(2.0, 60.0) == 60.0
    assert tracker.wait_s(90.0, 60.0) == 90.0  # never shorter than the backoff's own
    tracker.served()
    assert tracker.wait_s(2.0, 60.0) == 2.0


def test_a_start_that_serves_clears_it():
    tracker = AttentionTracker()
    for _ in range(3):
        tracker.observe(CONFIG)
    assert tracker.current is not None
    tracker.served()  # the model was fixed
    assert tracker.current is None
    assert tracker.observe(CONFIG) is None  # counting starts again
    assert tracker.observe(CONFIG) is None
    assert tracker.observe(CONFIG).announce  # a new episode says it again


@pytest.mark.parametrize("cause", ["gpu-timeout", "extend", "metal-buffer-count", "killed",
                                   "unknown", "a-class-from-a-newer-shim", None, ""])
def test_a_death_a_restart_can_fix_breaks_the_row(cause):
    tracker = AttentionTracker()
    tracker.observe(CONFIG)
    tracker.observe(CONFIG)
    assert tracker.observe(cause) is None
    assert tracker.observe(CONFIG) is None  # the row starts over
    assert tracker.observe(CONFIG) is None
    assert tracker.observe(CONFIG) is not None


def test_different_classes_a_restart_cannot_fix_count_together_each_said_once():
    tracker = AttentionTracker()
    tracker.observe("config-bad-pair")
    tracker.observe("config-bad-pair")
    pair = tracker.observe("config-bad-pair")
    assert pair.announce and pair.cause == "config-bad-pair"
    # The pair was fixed by hand, and now the weights do not match: say that.
    weights = tracker.observe(CONFIG)
    assert weights.announce and weights.cause == CONFIG and weights.starts == 4
    assert not tracker.observe(CONFIG).announce
    assert not tracker.observe("config-bad-pair").announce


def test_the_threshold_and_the_lookups_can_be_given():
    tracker = AttentionTracker(1, cannot_fix=lambda cause: cause == "x",
                               remedy_for=lambda cause: "do y")
    got = tracker.observe("x")
    assert got is not None and got.remedy == "do y" and got.starts == 1
    assert tracker.observe("z") is None
    with pytest.raises(ValueError):
        AttentionTracker(0)
