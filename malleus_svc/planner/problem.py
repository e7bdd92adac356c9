"""The planner's input: everything `plan()` needs, as plain validated numbers.

`planner.build` makes a `PlannerProblem` from a user's scenario (presets, defaults from the
cost model); the planner itself never reads files. Times are in units of t0, the forward+backward
time of one block for one micro-batch on a healthy, full-size TP group (the Malleus time model);
`t0_seconds` converts them to seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..config.scenario import DEFAULT_OBJECTIVE, Objective, Search, Solver, tp_sizes
from ..costmodel.profile import CommCosts, MemoryProfile
from ..plan import StateSizes

@dataclass(frozen=True)
class PlannerProblem:
    num_nodes: int
    gpus_per_node: int
    num_layers: int
    dp: int                         # baseline layout: pipelines
    tp: int                         # baseline (= largest) TP group size k
    pp: int                         # baseline stages per pipeline S0
    num_micro_batches: int          # M = global batch / micro-batch size
    micro_batch_size: int
    rates: tuple[float, ...]        # straggling rate per device (1.0 healthy)
    tp_alpha: tuple[float, ...]     # slowdown of a block on tp/2^r devices instead of tp, r = 0, 1, ...
    memory: MemoryProfile
    excluded: frozenset[int] = frozenset()   # dead or user-excluded devices: never planned
    objective: Objective = DEFAULT_OBJECTIVE   # type: ignore[assignment]  # the default lives in config
    comm: CommCosts = CommCosts()
    optimizer_per_block: float = 0.0       # one block's optimizer step on a healthy full-size group ('full')
    t0_seconds: float = 1.0
    straggler_threshold: float = 1.2        # τ: rates below it count as healthy
    tp_weight: tuple[float, ...] | None = None  # authors' grouping-score weights w_r (baseline mode only)
    allow_split: bool = True                # split groups to isolate stragglers
    allow_reshape: bool = True              # let the number of pipelines change and whole nodes drop
    time_limit_s: float = 10.0              # per HiGHS solve
    time_budget_s: float = 60.0             # the whole search (planner.budget): then the best plan found
    mip_gap: float = 0.0
    solver: Solver = "closed_form"
    search: Search = "default"              # 'exhaustive': every plan of a small cluster (planner.exhaustive)
    state_sizes: StateSizes = field(default_factory=StateSizes)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def max_split(self) -> int:
        """Number of halvings allowed: group sizes tp, tp/2, ..., 1."""
        return len(self.tp_sizes) - 1

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tp_sizes(self.tp)

    def alpha(self, group_size: int) -> float:
        return self._alpha_of[group_size]

    @cached_property
    def _alpha_of(self) -> dict[int, float]:   # the search asks this thousands of times
        return {size: a for size, a in zip(self.tp_sizes, self.tp_alpha)}

    def node_of(self, device: int) -> int:
        return device // self.gpus_per_node
