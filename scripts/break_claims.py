"""Break each reliability claim on purpose and check that the test backing it fails.

RELIABILITY.md names, per claim, the test that backs it. A test that still passes with the claim
broken backs nothing, so each entry below is one small edit that breaks one claim (what a careless
change could do), and the tests that must then fail. The script applies the edit in place, runs
the tests, and restores the file whatever happens; it refuses files with uncommitted changes, so
the restored file is the committed one.

    .venv/bin/python scripts/break_claims.py            # all, a markdown table at the end
    .venv/bin/python scripts/break_claims.py --only sha256 safetensors-only
    .venv/bin/python scripts/break_claims.py --list
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Break:
    name: str
    claim: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


REL = "tests/test_reliability.py::"
BREAKS = (
    Break("resume-from-checkpoint", "a restarted coordinator resumes from its newest checkpoint",
          "malleus_svc/control/coordinator.py",
          'ckpt = self.checkpoints.latest(lambda text: self._event("error", text))', "ckpt = None",
          (REL + "test_coordinator_killed_mid_iteration_resumes_from_its_checkpoint",)),
    Break("resume-external-rates", "a checkpoint carries the operator's rates: they are in force after a restart",
          "malleus_svc/control/coordinator.py",
          "            self.measurement.set_external(clean)\n            self.excluded |= set(excluded)",
          "            self.excluded |= set(excluded)",
          (REL + "test_coordinator_killed_mid_iteration_resumes_from_its_checkpoint",)),
    Break("redo-interrupted-batch", "the interrupted global batch is given back to the sampler and trained again",
          "malleus_svc/control/membership.py",
          "            self.sampler.load_state_dict(sampler_before)\n", "            pass\n",
          (REL + "test_worker_lost_mid_iteration_is_replaced_from_a_replica[crash]",)),
    Break("survivors-stay-up", "survivors of a lost worker are not restarted",
          "malleus_svc/runtime/cluster.py",
          'lost |= self._answers("ping", [d for d in self.live if d not in lost], timeout=30)[1]',
          "lost |= set(self.live)",
          (REL + "test_worker_lost_mid_iteration_is_replaced_from_a_replica[crash]",)),
    Break("hang-blames-the-stuck", "a hang is blamed on the device that did not finish its step, not on its peers",
          "malleus_svc/runtime/cluster.py",
          "lost = {refs[r] for r in stuck}", "lost = {refs[r] for r in refs if r not in stuck}",
          (REL + "test_worker_lost_mid_iteration_is_replaced_from_a_replica[hang]",)),
    Break("no-replica-uses-checkpoint", "without a replica, the state comes from the newest checkpoint",
          "malleus_svc/control/membership.py",
          'ckpt = None if rep.source == "replicas" else self.checkpoints.latest(lambda text: self._event("error", text))',
          "ckpt = None",
          (REL + "test_worker_without_replica_is_restored_from_the_checkpoint",)),
    Break("rejoin", "devices whose node returns are taken back into the plan",
          "malleus_svc/control/membership.py",
          "if not self.failure.rejoin_due(self.group.gone) or not (ready := self.group.rejoinable()):",
          "if True:",
          ("tests/test_node_loss.py::test_a_new_node_is_taken_back_into_the_plan",
           "tests/test_node_loss.py::test_a_job_starts_on_the_nodes_there_are_and_grows_when_one_joins")),
    Break("rejoin-planner-guard", "a planner failure while devices rejoin keeps the job and its plan",
          "malleus_svc/control/membership.py",
          "            except Exception as e:  # noqa: BLE001 - whatever the planner raised, the job goes on",
          "            except ZeroDivisionError as e:",
          ("tests/test_coordinator_logic.py::test_a_planner_failure_when_devices_rejoin_keeps_the_job_and_its_plan",)),
    Break("loss-planner-fallback", "a planner failure when devices are lost falls back to a simpler plan",
          "malleus_svc/control/membership.py",
          "            if self.hooks.planner.fallback is None:\n                raise\n", "            raise\n",
          ("tests/test_coordinator_logic.py::test_a_planner_failure_when_devices_are_lost_falls_back_and_the_job_goes_on",)),
    Break("call-budget", "changing client calls are limited per job",
          "malleus_svc/control/requests.py", "        if self.tokens < 1.0:\n", "        if False:\n",
          ("tests/test_coordinator_logic.py::test_a_loop_of_client_calls_is_refused_past_the_budget_and_refusals_change_nothing",)),
    Break("forced-replan-hold", "a forced re-plan waits for min_interval unless urgent",
          "malleus_svc/control/api.py",
          "hold = bool(force) and not urgent and not self.policy.due(self.step, self.policy.last_change_step)",
          "hold = False",
          ("tests/test_coordinator_logic.py::test_a_forced_replan_waits_for_min_interval_unless_urgent",)),
    Break("atomic-publish", "a checkpoint is published only once complete (temporary directory, then rename)",
          "malleus_svc/checkpoint/writer.py",
          "tmp, final = self.root / tmp_dir_name(step), self.root / step_dir_name(step)",
          "tmp = final = self.root / step_dir_name(step)",
          ("tests/test_checkpoint.py::test_sigkill_mid_write_never_yields_a_partial_checkpoint",)),
    Break("sha256", "a damaged checkpoint is skipped (sha256 per file)",
          "malleus_svc/runtime/shard_files.py",
          "    if actual != sha256:\n", "    if False:\n",
          ("tests/test_checkpoint.py::test_damaged_checkpoint_falls_back_to_the_previous_good_one",)),
    Break("safetensors-only", "checkpoints are read as safetensors only: a pickled payload never runs",
          "malleus_svc/runtime/shard_files.py",
          "        first = str(e).strip().splitlines()[0] if str(e).strip() else \"\"\n",
          "        first = str(torch.load(open(Path(folder) / name, \"rb\"), weights_only=False))\n",
          ("tests/test_checkpoint.py::test_a_pickle_in_place_of_a_shard_file_is_refused_not_executed",)),
    Break("no-aliases", "YAML anchors and aliases are refused before anything is built",
          "malleus_svc/config/files.py",
          "        if isinstance(event, yaml.AliasEvent) or getattr(event, \"anchor\", None):",
          "        if False:",
          ("tests/test_hostile_input.py",)),
    Break("emulation-opt-in", "the emulate call works only for jobs whose file enables it",
          "malleus_svc/control/api.py", "        if not self.job.emulation_allowed:\n", "        if False:\n",
          ("tests/test_coordinator_logic.py::test_emulation_is_refused_unless_the_job_file_enables_it",)),
    Break("owner-key", "only the launching driver starts or shuts down the coordinator",
          "malleus_svc/control/coordinator.py",
          "        if self._owner is not None and not (isinstance(owner, str) and hmac.compare_digest(owner, self._owner)):",
          "        if False:",
          ("tests/test_coordinator_logic.py::test_only_the_owner_key_starts_or_shuts_down_the_coordinator",)),
    Break("manifest-structure", "a manifest of the wrong structure, even with a valid checksum, is skipped with the reason",
          "malleus_svc/checkpoint/manifest.py",
          "    if not (isinstance(v, Mapping) or (optional and v is None)):\n", "    if False:\n",
          ("tests/test_checkpoint.py::test_malformed_manifests_with_a_valid_checksum_are_skipped_with_the_reason",)),
    Break("plan-whole-numbers", "plan files take ints for device ids, layers and counts (no truncated fractions, no bools)",
          "malleus_svc/plan.py",
          '    if isinstance(v, bool) or not isinstance(v, int):\n        raise _wrong(where, v, "an integer")\n    return v\n',
          "    return int(v)\n",
          ("tests/test_hostile_input.py::test_previous_plans_take_whole_numbers_and_typed_fields_only",)),
    Break("number-options", "number options on command lines are finite and in range, refused in one line",
          "malleus_svc/config/options.py", "        if value is None or not low <= value <= high:", "        if value is None:",
          ("tests/test_hostile_input.py::test_number_options_refuse_bad_values_in_one_line[simulate---backward-ratio-nan]",
           "tests/test_hostile_input.py::test_number_options_refuse_bad_values_in_one_line[simulate---backward-ratio-inf]")),
    Break("device-id-digits", "a device id given as text has a few digits: a huge one is a MalleusError, not Python's ValueError",
          "malleus_svc/control/requests.py", " and len(text) <= _DEVICE_DIGITS", "",
          ("tests/test_control_requests.py::test_huge_values_are_refused_in_one_short_line",)),
    Break("reason-cap", "a re-plan reason is at most 200 characters",
          "malleus_svc/control/requests.py", "    if len(reason.strip()) > MAX_REASON:\n", "    if False:\n",
          ("tests/test_control_requests.py::test_reasons_are_capped",)),
    Break("shard-files-regular", "a checkpoint's shard files are read only if they are regular files (no symlink, no FIFO)",
          "malleus_svc/runtime/shard_files.py", "    if not stat.S_ISREG(st.st_mode):\n", "    if False:\n",
          ("tests/test_checkpoint.py::test_crafted_part_files_are_skipped_before_they_are_read",)),
    Break("rate-bound", "a client's straggling rate is at most limits.MAX_RATE",
          "malleus_svc/control/requests.py", "        if not 1.0 <= float(r) <= MAX_RATE:\n",
          "        if not 1.0 <= float(r):\n", ("tests/test_control_requests.py::test_rates",)),
    Break("planner-budget", "the planner stops at planner.time_budget_s with the best plan it has found",
          "malleus_svc/planner/budget.py", "        if not self.hit and time.monotonic() >= self._end:\n",
          "        if False:\n",
          ("tests/test_planner_search.py::test_the_search_stops_at_its_time_budget_with_the_best_plan_it_found",)),
    Break("value-budget", "a JSON file of more values than limits.MAX_VALUES is refused before it is parsed",
          "malleus_svc/config/files.py", "    if values > MAX_VALUES:\n", "    if False:\n",
          ("tests/test_hostile_input.py::test_hostile_files_are_refused_fast_in_bounded_memory[json-under-the-size-cap]",)),
    Break("simulate-budget", "simulate refuses a batch beyond its op budget at once, its judge too",
          "malleus_svc/simulate/timeline.py", "MAX_SIMULATED_OPS = 100_000\n", "MAX_SIMULATED_OPS = 10 ** 12\n",
          ("tests/test_hostile_input.py::test_hostile_files_are_refused_fast_in_bounded_memory[simulate-a-huge-batch]",)),
    Break("rendezvous-address", "the rendezvous store listens on the cluster address only",
          "malleus_svc/runtime/rendezvous.py", ", wait_for_workers=False,\n                              master_listen_fd=listener.detach())",
          ", wait_for_workers=False)",
          ("tests/test_rendezvous.py::test_the_rendezvous_store_listens_on_the_given_address_only",)),
)


def uncommitted(path: str) -> bool:
    return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=REPO).returncode != 0


def run(b: Break, timeout_s: float) -> tuple[str, float, str]:
    """('failed' as it must | 'PASSED' | 'not applied'), seconds, the first failure line."""
    path = REPO / b.path
    text = path.read_text()
    if text.count(b.old) != 1:
        return "not applied", 0.0, f"the text to break occurs {text.count(b.old)} times in {b.path}"
    if uncommitted(b.path):
        return "not applied", 0.0, f"{b.path} has uncommitted changes"
    t0 = time.monotonic()
    try:
        path.write_text(text.replace(b.old, b.new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", *b.tests],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "failed (timeout)", time.monotonic() - t0, f"ran past {timeout_s:g} s"
    finally:
        path.write_text(text)
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        return "PASSED", seconds, ""
    first = next((x for x in proc.stdout.splitlines() if x.startswith(("FAILED", "ERROR"))), proc.stdout[-200:])
    return "failed", seconds, first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these breaks only")
    ap.add_argument("--list", action="store_true", help="list the breaks and exit")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per break")
    args = ap.parse_args(argv)
    chosen = [b for b in BREAKS if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BREAKS}
    if unknown:
        print(f"break_claims: unknown break(s) {sorted(unknown)}; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        for b in chosen:
            print(f"{b.name}: {b.claim} ({b.path}) -> {', '.join(b.tests)}")
        return 0
    rows = []
    for i, b in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {b.name}: {b.claim}", file=sys.stderr, flush=True)
        outcome, seconds, first = run(b, args.timeout)
        print(f"    {outcome} in {seconds:.0f} s {first}", file=sys.stderr, flush=True)
        rows.append((b, outcome, seconds))
    print("| claim broken | edit in | backing test | with the break |\n|---|---|---|---|")
    for b, outcome, seconds in rows:
        tests = ", ".join(f"`{t.split('/')[-1]}`" for t in b.tests)
        print(f"| {b.claim} | `{b.path}` | {tests} | {outcome} ({seconds:.0f} s) |")
    return 0 if all(o.startswith("failed") for _, o, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
