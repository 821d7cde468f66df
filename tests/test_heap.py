"""heap: a serving process's heap frozen out of the collector's walks
(``gc.freeze``), and a bench cell's thawed again when it ends."""
import gc
import weakref

from simple_sampler import heap


class Node:
    """A reference cycle: only the collector frees it, never a refcount."""

    def __init__(self):
        self.me = self


def test_freeze_collects_the_garbage_first_and_freezes_the_living():
    garbage, alive = Node(), Node()
    garbage_ref, alive_ref = weakref.ref(garbage), weakref.ref(alive)
    del garbage
    try:
        frozen = heap.freeze("test")
        assert garbage_ref() is None  # collected, not frozen for good
        # what is frozen now, give or take the few frozen objects that die (a refcount
        # frees them) or other threads of the worker freeze meanwhile
        assert frozen > 0 and abs(frozen - gc.get_freeze_count()) < 0.01 * frozen
        del alive
        gc.collect()
        assert alive_ref() is not None  # frozen: no collection walks it
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive_ref() is None


def test_frozen_thaws_when_the_body_ends_so_a_cell_s_engine_is_collected():
    engine = Node()
    engine_ref = weakref.ref(engine)
    with heap.frozen("test") as frozen:
        assert frozen > 0
        del engine  # the cell is over: its engine is garbage, in a cycle
        gc.collect()
        assert engine_ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert engine_ref() is None


def test_the_pause_clock_counts_each_collection_and_its_time():
    clock = heap.PauseClock().install()
    try:
        for _ in range(3):
            Node()  # garbage for the collection to find
            gc.collect()
        assert clock.collections[2] == 3
        assert clock.seconds > 0
        gc.collect(0)
        assert clock.collections[0] == 1 and clock.collections[2] == 3
    finally:
        gc.callbacks.remove(clock._on_collection)
