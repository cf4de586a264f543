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
