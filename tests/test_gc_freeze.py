"""`moe_rl.gc_freeze.freeze_setup`: setup's garbage is collected first, what is alive is frozen out
of later passes, what the loop allocates afterwards is collected as before, and `thaw` gives the
frozen objects back."""

from __future__ import annotations

import gc
import weakref

from moe_rl.gc_freeze import freeze_setup, thaw


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_setup_collects_then_freezes():
    garbage, kept = _Node(), _Node()
    dead = weakref.ref(garbage)
    del garbage
    try:
        freeze_setup()
        assert dead() is None  # setup's garbage went first, it is not kept alive frozen
        assert gc.get_freeze_count() > 0
        assert kept not in gc.get_objects(generation=2)  # frozen: no pass walks it
        later = _Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None  # the loop's objects are still collected
        kept_ref = weakref.ref(kept)
        del kept
        gc.collect()
        assert kept_ref() is not None  # frozen in its cycle: no pass frees it
    finally:
        thaw()
    gc.collect()
    assert kept_ref() is None  # thawed, it is collected
