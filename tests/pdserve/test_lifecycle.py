"""Process lifecycle: the start-up heap is frozen out of the garbage collector's way."""
from __future__ import annotations

import gc

from pdserve.lifecycle import freeze_startup_heap


def test_start_up_objects_leave_the_collectors_view():
    before = [object(), {"a": 1}]                   # alive at start-up: frozen
    try:
        frozen = freeze_startup_heap()
        # Another thread (an earlier test's) may free a frozen object meanwhile.
        assert 0 < gc.get_freeze_count() <= frozen
        after = [object()]                          # made while serving: collected as usual
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before) not in tracked and id(after) in tracked
    finally:
        gc.unfreeze()
    assert id(before) in {id(o) for o in gc.get_objects()}


def test_full_collections_can_be_spaced_out():
    threshold = gc.get_threshold()
    counts = []

    def collected(phase, info):
        if phase == "stop":
            counts.append(info["generation"])
    try:
        freeze_startup_heap(full_every=1000)
        gc.callbacks.append(collected)
        assert gc.get_threshold() == (threshold[0], threshold[1], 1000)
        # Many younger collections, with a heap that keeps growing: no full one
        # (with Python's default of 10, several).
        keep = []
        for _ in range(40):
            keep += [[i] for i in range(threshold[0] * threshold[1])]
        assert counts.count(1) >= 30 and counts.count(2) == 0
    finally:
        if collected in gc.callbacks:
            gc.callbacks.remove(collected)
        gc.set_threshold(*threshold)
        gc.unfreeze()
