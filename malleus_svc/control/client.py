"""The client API: talk to a running job's coordinator from any process on the Ray cluster.

    import malleus_svc
    job = malleus_svc.connect("demo")          # a job name, its Ray Jobs submission id, or its Ray job id
    job.status()["plan_id"]; job.rates()["effective"]
    job.replan(reason="maintenance window")    # coalesced with any re-plan in flight
    job.set_rates({3: 2.5})                    # an external health signal (DCGM, NVML, an operator)
    job.set_rates({3: None})                   # ... cleared: the measured rate counts again
    job.exclude([5]); job.include([5])
    job.stop()                                 # at the next iteration boundary; the Ray job then succeeds
    job.history()                              # every plan change, with reason, gain, bytes, seconds

Precedence of rates: a rate given with set_rates overrides the measured rate of that device, for
every decision, until it is cleared (set_rates({d: None}) or clear_rates()). Measured rates keep
being collected meanwhile, so clearing falls back to a current measurement at once.

Every call is validated (by the client for shape, by the coordinator authoritatively) and a bad
call raises MalleusError with the reason; a refused call changes nothing. Effects show in status()
(external_rates, excluded, planning, pending_requests) and, once decided, in history().
"""
from __future__ import annotations

from typing import Any, Mapping

from malleus_svc.config.errors import shorten

from .coordinator import ACTOR_PREFIX, NAMESPACE, MalleusError, actor_name, describe_plan
from .requests import check_reason

__all__ = ["Client", "MalleusError", "connect", "list_jobs"]


def _ensure_ray(address: str | None) -> None:
    import ray
    if not ray.is_initialized():
        ray.init(address=address or "auto", log_to_driver=False, configure_logging=False)


def list_jobs() -> list[str]:
    """Names of the jobs whose coordinators run on the connected cluster."""
    from ray.util import list_named_actors
    out = []
    for a in list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a.get("name", "").startswith(ACTOR_PREFIX):
            out.append(a["name"][len(ACTOR_PREFIX):])
    return sorted(out)


def connect(job: str, address: str | None = None, timeout_s: float = 60.0) -> "Client":
    """A Client for `job`: a job name, the Ray Jobs submission id (raysubmit_...) it was submitted
    under, or the Ray job id of the driver that launched it.

    Joins the Ray cluster at `address` (default "auto") unless this process is connected already.
    Raises MalleusError naming the jobs that do exist if none matches.
    """
    import ray
    if not isinstance(job, str) or not job.strip():
        raise MalleusError(f"connect needs a job name or Ray job id, got {shorten(job)}")
    _ensure_ray(address)
    try:
        return Client(ray.get_actor(actor_name(job), namespace=NAMESPACE), job, timeout_s)
    except ValueError:
        pass
    names = list_jobs()
    for name in names:  # maybe a Ray job id
        handle = ray.get_actor(actor_name(name), namespace=NAMESPACE)
        try:
            info = ray.get(handle.job_info.remote(), timeout=timeout_s)
        except Exception:
            continue
        if job in (info.get("ray_job_id"), info.get("actor_job_id"), info.get("submission_id")):
            return Client(handle, name, timeout_s)
    raise MalleusError(f"no malleus job {shorten(job)} on this Ray cluster; running jobs: "
                       f"{', '.join(names) if names else '(none)'}")


class Client:
    """Thin, validated wrapper over the coordinator actor's methods."""

    def __init__(self, handle: Any, name: str, timeout_s: float = 60.0):
        self._h, self.name, self.timeout_s = handle, name, timeout_s

    def __repr__(self) -> str:
        return f"Client(job={self.name!r})"

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray
        try:
            return ray.get(getattr(self._h, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                raise MalleusError(str(cause)) from None
            raise
        except ray.exceptions.RayActorError as e:
            raise MalleusError(f"job {self.name!r} is gone (its coordinator died or finished): {e}") from None

    # ------------------------------------------------------------------ reading
    def status(self) -> dict:
        return self._call("status")

    def rates(self) -> dict:
        """{"measured", "external", "effective", "basis", ...}: device -> straggling rate."""
        return self._call("rates")

    def plan(self) -> dict:
        """The plan in force (Plan.to_dict()); malleus_svc.plan.Plan.from_dict() turns it back."""
        return self._call("current_plan")

    def describe(self) -> str:
        return describe_plan(self.plan())

    def history(self) -> list[dict]:
        return self._call("get_history")

    def metrics(self, since: int = 0) -> list[dict]:
        return self._call("metrics", since)

    # ------------------------------------------------------------------ asking
    def replan(self, reason: str = "user request", force: bool = False, urgent: bool = False) -> dict:
        return self._call("replan", check_reason(reason), force, urgent)

    def set_rates(self, rates: Mapping[int, float | None]) -> dict:
        if not isinstance(rates, Mapping) or not rates:
            raise MalleusError(f"set_rates needs a non-empty mapping of device -> rate (>= 1.0, None clears), "
                               f"got {shorten(rates)}")
        return self._call("set_rates", dict(rates))

    def clear_rates(self) -> dict:
        return self._call("clear_rates")

    def stop(self) -> dict:
        """Stop training at the next iteration boundary; the job ends normally with the steps done."""
        return self._call("stop")

    def exclude(self, devices) -> dict:
        return self._call("exclude", _as_list(devices, "exclude"))

    def include(self, devices) -> dict:
        return self._call("include", _as_list(devices, "include"))


def _as_list(devices, what: str) -> list:
    if isinstance(devices, int) and not isinstance(devices, bool):
        return [devices]
    if not isinstance(devices, (list, tuple, set, frozenset)) or not devices:
        raise MalleusError(f"{what} needs a non-empty list of device ids, got {shorten(devices)}")
    return list(devices)
