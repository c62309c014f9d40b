"""StopMatcher's shortcut: a piece with none of the stops' first characters, fed at the root state,
moves nothing (the usual token); against the plain string search on pieces that mix such text in."""

from __future__ import annotations

import random

from pyggml.runner.sequence import StopMatcher, check_stops, find_stop, partial_stop


def test_pieces_without_a_stop_start_are_skipped_correctly():
    rng = random.Random(29)
    for _ in range(20_000):
        stops = check_stops(["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                             for _ in range(rng.randint(1, 3))])
        matcher, held = StopMatcher(stops), ""
        for _ in range(rng.randint(1, 10)):
            piece = "".join(rng.choice("abcxyz" if rng.random() < 0.5 else "xyzb") for _ in range(rng.randint(0, 3)))
            cut = matcher.feed(piece, len(held))
            held += piece
            assert cut == find_stop(held, stops), (stops, held)
            if cut is not None:
                break
            assert matcher.partial == partial_stop(held, stops), (stops, held)
            held = held[len(held) - matcher.partial:]


def test_matchers_of_the_same_stops_share_their_tables_not_their_state():
    a, b = StopMatcher(["\n\nUser:", "END"]), StopMatcher(["\n\nUser:", "END"])
    assert a._goto is b._goto and a.starts is b.starts  # (one automaton for every request of these stops)
    assert StopMatcher(["END"])._goto is not a._goto
    assert a.feed("xx\n\nUs", 0) is None and a.state and not b.state
    assert b.feed("an END", 0) == 3 and a.feed("er:", 6) == 2
