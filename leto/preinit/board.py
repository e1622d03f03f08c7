"""The controller's words in each local rank's slot of the node's heartbeat board.

The agent and its trainers already share that page (``leto.health``); it is node-local, as
shadows are, and reading it costs the agent's 20 ms monitor tick nothing. Counters only
grow (``HangWatch.arm`` zeroes the heartbeat words, never these), so a request is pending
while ``OOM_REQUEST > OOM_ACK`` and a report is new when ``MEM_SEQ`` moved. A writer sets
the payload words before the counter that publishes them.
"""

from __future__ import annotations

from collections.abc import Callable

SHADOW_LEVEL = 2
"""agent → trainers: level of the live shadow generation on this node (0: none)."""
OOM_REQUEST = 3
"""trainer → agent: reclaim requests made so far."""
OOM_RECLAIMED = 4
"""agent → trainer: level of the shadows reclaimed for the newest answer (0: there were none)."""
OOM_ACK = 5
"""agent → trainer: requests answered so far (written after ``OOM_RECLAIMED``)."""
MEM_DEVICE, MEM_TOTAL, MEM_FREE, MEM_RESERVED, MEM_PEAK = 6, 7, 8, 9, 10
"""trainer → agent: its memory after the newest committed step (see ``probe.MemoryReading``)."""
MEM_SEQ = 11
"""trainer → agent: memory reports so far (written after the report's words)."""
SHADOW_READY = 12
"""shadow → trainers: its generation once it is pre-initialised and waits (it holds its
memory now); ready while that is ``SHADOW_GEN``. Cleared by the agent when it spawns,
reclaims or closes shadows; a shadow promoted while it pre-initialised announces late, and
its older generation keeps the next one from reading as ready."""
SHADOW_PID = 13
"""shadow → trainers: its pid, written with ``SHADOW_READY`` (test hooks kill it by this)."""
SHADOWS_GIVEN_UP = 14
"""agent → trainers: 1 once the agent stopped relaunching this node's shadows (they kept dying
before becoming ready): none will be ready; cleared when shadows are spawned."""
SHADOW_GEN = 15
"""agent → trainers: generation of the live shadows on this node (0: none), written when
they are spawned."""

MEM_WORDS = (MEM_DEVICE, MEM_TOTAL, MEM_FREE, MEM_RESERVED, MEM_PEAK)


def shadow_ready(word: Callable[[int], int]) -> bool:
    """A slot's shadow of the live generation is pre-initialised and waits (``word(i)``
    reads word ``i`` of the slot)."""
    return 0 < word(SHADOW_GEN) == word(SHADOW_READY)
