"""The coordinator's states and request kinds, each named once."""
from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """The job's lifecycle: CREATED -> STARTING -> READY -> TRAINING -> DONE | STOPPED | FAILED."""
    CREATED = "created"
    STARTING = "starting"     # workers, data and the first plan being set up
    READY = "ready"           # set up, not training yet
    TRAINING = "training"
    DONE = "done"             # all steps trained
    STOPPED = "stopped"       # stopped on request (or shut down) before the last step
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (JobState.DONE, JobState.STOPPED, JobState.FAILED)


class RoundState(str, Enum):
    """The re-plan round in flight: at most one at a time."""
    IDLE = "idle"             # no round; a request starts one at once
    PLANNING = "planning"     # the planner thread weighs keep / rebalance / replan
    DECIDED = "waiting for the iteration boundary"   # a new plan waits for the training thread
    MIGRATING = "migrating"   # the training thread moves the state to the new plan


class RequestKind(str, Enum):
    """Why a re-plan was asked for."""
    RATES = "rates"                      # measured rates moved past the policy's band
    EXTERNAL_RATES = "external-rates"    # set_rates: an operator's or a health monitor's rates
    MEMBERSHIP = "membership"            # devices excluded, included, gone or back
    REQUEST = "request"                  # a user's replan()
    LENGTHS = "lengths"                  # the sampled sequence lengths drifted
    LINKS = "links"                      # the job's links are measured: communication priced from them
