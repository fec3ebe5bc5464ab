"""The single-core pool that updates compact moments: its threads start together, and a failure is not a hang."""

import threading

import pytest

from lightning_slide.piece_pool import PiecePool


def test_every_thread_makes_its_own_scratch_and_runs_its_share_of_the_pieces():
    pool = PiecePool(3, lambda: threading.get_ident())
    seen = []
    pool.run(lambda scratch, k, threads: seen.append((scratch == threading.get_ident(), k, threads)))
    pool.close()
    assert len(set(pool.scratches)) == 3
    assert sorted(seen) == [(True, 0, 3), (True, 1, 3), (True, 2, 3)]


def test_a_thread_whose_scratch_cannot_be_made_stops_the_pool_with_that_error():
    made = []

    def scratch() -> int:
        made.append(None)
        if len(made) == 2:
            raise MemoryError("injected: no room for this thread's scratch")
        return len(made)

    with pytest.raises(MemoryError, match="injected"):
        PiecePool(3, scratch)
