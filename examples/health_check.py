"""Wire an external health signal to a running job: straggling rates and re-plans from your code.

    python examples/health_check.py tiny --signal /var/run/gpu-health.json --interval 10

The signal here is a JSON file {"DEVICE": RATE, ...} that some monitor keeps up to date (a DCGM or
NVML exporter, a thermal watchdog, an operator); RATE is how many times slower the device runs
(1.0 = healthy). Every interval the loop reads it, gives the job the rates that changed
(`set_rates`: they override the job's own measurements until cleared), clears those that went
away, and asks for a re-plan when the file says {"replan": "why"}. The job decides whether a new
plan pays for its migration; `job.history()` shows what it decided.
"""
import argparse
import json
import time
from pathlib import Path

import malleus_svc


def read_signal(path: Path) -> tuple[dict[int, float], str | None]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:       # a monitor mid-write, or gone: skip this round
        print(f"signal unreadable ({e}); skipping")
        return {}, None
    reason = data.pop("replan", None)
    return {int(d): float(r) for d, r in data.items()}, reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", help="the malleus job name (or its Ray submission id)")
    ap.add_argument("--signal", required=True, type=Path, help="JSON file {device: rate, 'replan': reason}")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS / local)")
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: run forever)")
    args = ap.parse_args()

    job = malleus_svc.connect(args.job, address=args.address)
    sent: dict[int, float] = {}
    n = 0
    while True:
        rates, reason = read_signal(args.signal)
        changes = {d: r for d, r in rates.items() if sent.get(d) != r}
        changes.update({d: None for d in sent if d not in rates})      # None clears: measured rates count again
        if changes:
            job.set_rates(changes)                                      # validated; a bad rate raises MalleusError
            sent = rates
            print(f"set_rates {changes}")
        if reason:
            print(f"replan requested: {job.replan(reason=reason)}")
        n += 1
        if args.rounds and n >= args.rounds:
            break
        time.sleep(args.interval)
    print(f"job {args.job}: external rates {job.rates()['external']}, {len(job.history())} plan decisions so far")


if __name__ == "__main__":
    main()
