"""A serving process's startup heap, out of the cyclic collector's way.

A frontend or a worker builds its heap once (modules, the app, the tokenizer, the model's
Python objects) and then serves for hours. CPython's full collection walks every tracked
object; in a frontend or an agg worker of the default model that is 200-230 thousand
objects and 100-190 ms (measured on a 2-core AMX VM), a pause that freezes every stream of
the frontend, or one decode step of the worker, whenever the allocation counts set one
off. `freeze_startup_heap` collects once and moves every survivor to the permanent
generation (`gc.freeze`, as vLLM does once it has started): later collections walk only
what was made since (0.6-2.4 ms for the same full collection). Reference counting still
frees a frozen object that falls out of use; only a reference cycle among frozen objects
is never collected.

Until then the collector is off (`pause_collector`, at the start of a worker's engine
build and of the frontend's start): every full collection during startup walked the whole
heap built so far. The default model's `LLMEngine()` built in 4.2-5.2 s without them
against 5.8-7.4 s with them (a Zen 3 VM, paired runs in one process each); a served
start gained less (docs/benchmarks.md "Start-up"). The startup's garbage cycles are
freed by the one collection before the freeze.
"""
from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def pause_collector() -> None:
    """The cyclic collector off until `freeze_startup_heap` (a process that fails to start
    exits with it off)."""
    gc.disable()


def freeze_startup_heap(process: str) -> int:
    """Collects, then freezes what survives, and turns the collector on; returns how many
    objects were frozen. Call it once startup is done and before the first request (the
    collection takes ~0.1-0.2 s)."""
    gc.collect()
    gc.freeze()
    gc.enable()
    frozen = gc.get_freeze_count()
    logger.info("%s: froze the startup heap (%d objects) out of the cyclic collector's walks",
                process, frozen)
    return frozen
