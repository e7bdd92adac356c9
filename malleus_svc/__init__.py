"""malleus-svc: elastic, straggler-resilient hybrid-parallel training on Ray."""
__version__ = "0.1.0"

__all__ = ["connect"]


def connect(job: str, address: str | None = None, timeout_s: float = 60.0):
    """A client for a running job (name or Ray job id); see malleus_svc.control.client."""
    from malleus_svc.control.client import connect as _connect

    return _connect(job, address=address, timeout_s=timeout_s)
