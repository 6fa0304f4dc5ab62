"""When a frame builds a panel again: at once for what it shows changing, else at its pace.

The app builds a few panels at their own pace, not every frame: the comm panel once a
second, the charts' data every other second (plotext takes 5 to 20 ms a plot), and,
for a run shown as the rank map (thousands of ranks), the header and the banner once
a second. Those two ask the RunState for every rank's state (`RunState.throughput`,
`eta`, `hang`: a `rank_states` each, about 25 ms at 16,384 ranks on 2 cores), which
the map's own pass (rankstats.py) needs anyway, once. A new status, event, note or
connection still draws them at the next frame.
"""

from __future__ import annotations

import time

PANELS_EVERY_S = 1.0  # the comm panel is built again this often
CHARTS_EVERY_S = 2.0  # ... and the charts' data (a plot costs plotext 5 to 20 ms)
HEADER_EVERY_S = 1.0  # ... and, for a run shown as the map, the header and the banner


class Every:
    """Says when something is due again: what it is built from (`key`) changed, it
    must be (`force`), or `every_s` passed since it was last built."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.key: object = None
        self.at: float | None = None

    def due(self, key: object, force: bool = False) -> bool:
        """True (and the clock restarted) when it is to be built now."""
        now = time.monotonic()
        if force or self.at is None or key != self.key or now - self.at >= self.every_s:
            self.key, self.at = key, now
            return True
        return False
