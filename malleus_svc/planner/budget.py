"""The planner's wall-clock budget: one deadline for a whole search.

The search checks it between units of work (a node-option combination, a pipeline count, a local
search move, a DFS template) and, once it has passed, finishes with what it has: the greedy
organisation of the combinations already scored, no further improvement. So a search overruns its
budget by at most one unit of work plus the concretisation of its finalists.
"""
from __future__ import annotations

import math
import time


class Deadline:
    def __init__(self, seconds: float | None = None):
        self.seconds = seconds
        self._end = math.inf if seconds is None else time.monotonic() + seconds
        self.hit = False          # whether the search was cut short (said in the plan's notes)

    def passed(self) -> bool:
        if not self.hit and time.monotonic() >= self._end:
            self.hit = True
        return self.hit


NEVER = Deadline()   # for callers that search without a budget (tests of the pieces)
