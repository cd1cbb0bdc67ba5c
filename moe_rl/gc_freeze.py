"""Keep a long-lived process's setup objects out of the cyclic garbage collector's full passes.

A run's processes import torch, transformers, Ray and megatron-core and build models and tasks:
millions of objects that live as long as the process. CPython's full (generation 2) collection
walks every one of them, holding the GIL all the while: in the async bench's rollout worker one such
pass took 117 ms and stopped request submission while the trainer waited for its batch (the
timeline's "gc" lane shows each pass). `freeze_setup` collects once and moves what survives into
the permanent generation, which later passes skip; what the loop allocates afterwards (samples,
batches) is still collected as before. Each process calls it once, at the end of its setup (the
embedded engine freezes its models itself, `moe_rl.engine.embedded.runner`, again once its spare
model exists); a process that goes on after the run (the driver inside tests or a notebook) calls
`thaw`, since a frozen object in a reference cycle is never collected.
"""

from __future__ import annotations

import gc


def freeze_setup() -> None:
    """Collect the garbage of setup, then freeze every object alive (`gc.freeze`)."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (`gc.unfreeze`)."""
    gc.unfreeze()
