"""Where the suite's time goes, at the end of every run: the seconds of each test group (by marker) and the 30 slowest
tests, setup and teardown included (a session fixture that writes a checkpoint counts for the first test that asks
for it), and what the run's checkpoint writers cost (tests/helpers/written_cache.py times each). CI's budget is fixed (docs/development.md, "Time"), so a drift must show in the run that caused it.

A pytest plugin (tests/conftest.py loads it); each run also keeps its figures in .test-cache/times/<venv>.json, and

    python3 tests/helpers/timing_report.py .test-cache/times/*.json

prints them together, as .ci/run does after both interpreters' runs. Standard library only, like .ci/run's python3.
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

# A test's group is the first of these markers it has; "other" is the rest (real files, in-process, quick).
GROUPS = ("unit", "infra", "slow")
SLOWEST = 30
COSTLIEST_WRITERS = 10


def group_of(markers) -> str:
    return next((group for group in GROUPS if group in markers), "other")


def report_lines(runs: dict[str, dict]) -> list[str]:
    """The lines that say, for each run (its name: its figures), the time per group and then the slowest tests."""
    lines = []
    for name, run in runs.items():
        per_group: dict[str, list[float]] = defaultdict(list)
        for test in run["tests"].values():
            per_group[group_of(test["markers"])].append(test["seconds"])
            if "interpreter" in test["markers"]:
                per_group["(interpreter)"].append(test["seconds"])
        lines.append(f"time per group, {name} ({run['wall_s']:.0f} s wall on {run['workers']} worker(s); each test's "
                     "own seconds, added up):")
        for group in (*GROUPS, "other", "(interpreter)"):
            seconds = per_group.get(group, [])
            lines.append(f"  {group:<14} {len(seconds):>4} tests {sum(seconds):>8.1f} s")
        writers = run.get("writers", [])
        if writers:
            lines.append(f"  checkpoint writers run: {len(writers)}, {sum(w['wall_s'] for w in writers):.0f} s wall "
                         f"(in the groups above), {sum(w['cpu_s'] for w in writers):.0f} s of CPU; the costliest:")
            for w in sorted(writers, key=lambda w: w["cpu_s"], reverse=True)[:COSTLIEST_WRITERS]:
                lines.append(f"    {w['cpu_s']:7.1f} s CPU {w['wall_s']:6.1f} s wall  {w['writer']} on {w['nproc']}")
    slowest = sorted(((test["seconds"], name, nodeid) for name, run in runs.items()
                      for nodeid, test in run["tests"].items()), reverse=True)[:SLOWEST]
    lines.append(f"the {len(slowest)} slowest tests (setup, call and teardown):")
    lines += [f"  {seconds:7.1f} s  {name}  {nodeid}" for seconds, name, nodeid in slowest]
    return lines


class TimingReport:
    """Adds up each test's phases as their reports arrive (from xdist's workers too) and reports at the end."""

    def __init__(self, config):
        self.config = config
        self.started, self.started_at = time.monotonic(), time.time()
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        test = self.tests.setdefault(report.nodeid, {"seconds": 0.0, "markers": sorted(
            k for k in report.keywords if k in (*GROUPS, "interpreter"))})  # every phase's report has the item's
        test["seconds"] += report.duration

    def pytest_terminal_summary(self, terminalreporter):
        if not self.tests:
            return
        name = Path(sys.prefix).name  # the venv: .venv, .venv-debian
        workers = getattr(self.config.option, "numprocesses", None) or 1
        times = Path(self.config.rootpath) / ".test-cache" / "times"
        writers = [json.loads(path.read_text()) for path in (times / "writers").glob("*.json")]  # written_cache's
        run = {"wall_s": time.monotonic() - self.started, "workers": workers, "tests": self.tests,
               "writers": [w for w in writers if w["ended"] >= self.started_at]}
        terminalreporter.write_sep("=", "time per group and slowest tests")
        for line in report_lines({name: run}):
            terminalreporter.write_line(line)
        out = times / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(run))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # xdist's workers send their reports to the controller, which reports
        config.pluginmanager.register(TimingReport(config), "timing_report")


if __name__ == "__main__":
    print("\n".join(report_lines({Path(path).stem: json.loads(Path(path).read_text()) for path in sys.argv[1:]})))
