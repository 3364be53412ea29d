"""The window of parts in flight adapts between rounds (``transfers.AdaptiveWindow``): wider
while a wider one uploads a round's parts faster, back when it does not, tried again after a
while, and never past its most or the sync's memory bound. Driven here by the rates a link
of a given shape would give (each connection at most ``per_connection``, all of them at most
``link``): the rule is what is under test, not this machine's timing; the round through a
shaped link is ``diloco bench sync --window-max`` (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from diloco_anywhere.collective.transfers import (
    MEMORY_SHARE,
    SETTLED_ROUNDS,
    WIDER_GAIN,
    AdaptiveWindow,
)
from diloco_anywhere.config import parse_config

PART = 1 << 20  # float32 values a part (4 MiB)
PARTS = 1024  # a 4 GiB contribution (a 1B model's): room for a window of 128


def upload(window: AdaptiveWindow, per_connection: float, link: float, parts: int = PARTS) -> int:
    """One round's upload through such a link at the window in use; the window it ran at."""
    used = window.size
    rate = min(used * per_connection, link)
    window.observe(used, parts, parts * PART, PART, parts * PART * 4 / rate)
    return used


def test_the_window_widens_to_what_the_link_is_worth_then_settles():
    """Connections of 2 MB/s on a link of 16 MB/s are worth 8 at a time: from 2 the window
    doubles to 8, tries 16, which moves nothing faster, and goes back to 8."""
    window = AdaptiveWindow(2, 32)
    used = [upload(window, 2e6, 16e6) for _ in range(6)]
    assert used == [2, 4, 8, 16, 8, 8]


def test_a_settled_window_tries_a_wider_one_again_and_follows_a_faster_link():
    window = AdaptiveWindow(8, 64)
    used = [upload(window, 2e6, 16e6) for _ in range(3)]  # 8, tries 16: no gain, back to 8
    assert used == [8, 16, 8]
    used = [upload(window, 2e6, 64e6) for _ in range(SETTLED_ROUNDS + 3)]  # the link got faster
    assert used[: SETTLED_ROUNDS - 1] == [8] * (SETTLED_ROUNDS - 1)  # settled until then
    assert used[SETTLED_ROUNDS - 1 :] == [16, 32, 64, 32]  # probing again: the link's 32


def test_a_wider_window_that_gains_less_than_its_threshold_is_not_kept():
    """Where the host (the codec on its cores) or the store is the limit, a wider window
    moves parts barely faster, within noise: it costs requests and memory, and is not kept."""
    window = AdaptiveWindow(8, 32)
    host = 8 * 2e6 * (WIDER_GAIN - 0.02)  # 16 connections' worth: just under the gain asked
    used = [upload(window, 2e6, host) for _ in range(4)]
    assert used == [8, 16, 8, 8]


@pytest.mark.parametrize(("parts", "most"), [(128, 16), (1024, 32)])
def test_the_window_stays_within_the_sync_s_memory_and_its_most(parts, most):
    """A round's parts in flight stay within an eighth of its payload's float32 bytes (128
    parts of 4 MiB, 512 MiB: 16 at once), and within window_max."""
    window = AdaptiveWindow(2, 32)
    used = [upload(window, 1e6, 1e12, parts) for _ in range(8)]  # every wider one pays
    assert max(used) == most
    assert most * PART <= MEMORY_SHARE * parts * PART


def test_a_round_that_ran_at_a_window_since_changed_says_nothing():
    """Rounds of several fragments overlap: one that started before another's upload
    changed the window does not judge the new one by its rate."""
    window = AdaptiveWindow(8, 32)
    upload(window, 2e6, 1e12)  # 8, then tries 16
    window.observe(8, PARTS, PARTS * PART, PART, 1e-3)  # a late round at 8, however fast
    assert window.size == 16
    assert upload(window, 2e6, 1e12) == 16  # 16 judged on its own rate: wider still
    assert window.size == 32


def test_a_round_of_too_few_parts_to_fill_the_window_says_nothing():
    window = AdaptiveWindow(8, 32)
    for _ in range(5):
        upload(window, 2e6, 1e12, parts=15)  # fewer than twice the window
    assert window.size == 8
    fixed = AdaptiveWindow(8, 8)  # window_max = window: fixed
    assert [upload(fixed, 2e6, 1e12) for _ in range(3)] == [8, 8, 8]


def test_run_toml_s_window_is_the_start_and_window_max_the_most():
    round_ = parse_config(
        '[run]\nname = "w"\n[sync]\nwindow = 4\nwindow_max = 64\n', "run.toml"
    ).sync.round_policy(parse_config('[run]\nname = "w"\n', "run.toml").run)
    assert (round_.window, round_.window_max) == (4, 64)
    below = parse_config('[run]\nname = "w"\n[sync]\nwindow = 16\nwindow_max = 8\n', "run.toml")
    policy = below.sync.round_policy(below.run)
    assert AdaptiveWindow(policy.window, policy.window_max).most == 16  # below: fixed there
