#!/usr/bin/env python3
"""pinbox benchmarks: each hot path as the median of repeated runs, side by side with its
floor measured in the same run. Standard library only.

    python3 bench/run.py [--runs N] [--only NAME[,NAME]] [--json PATH]

Prints a table and writes the same figures as JSON (default bench/results/latest.json).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import pinbox  # noqa: E402

FLOOR = [sys.executable, "-I", "-S", "-c", "pass"]


def timed(command, cwd=None, env=None):
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    return (time.perf_counter() - started) * 1000


def summarize(samples):
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered), 2),
            "p90_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))], 2),
            "runs": len(ordered)}


def make_repo(path, env):
    os.makedirs(path)
    for args in (["init", "-q", "-b", "main"], ["config", "user.email", "bench@example.com"],
                 ["config", "user.name", "Bench"], ["commit", "-q", "--allow-empty", "-m", "initial"]):
        subprocess.run(["git"] + args, cwd=path, env=env, check=True, stdout=subprocess.DEVNULL)


def bench_commit(runs, workdir):
    """What the post-commit hook adds to `git commit`: the same commit in two identical
    repositories, one with pinbox's hook and one without, alternated pair by pair."""
    env = dict(os.environ, HOME=workdir, XDG_STATE_HOME=os.path.join(workdir, "state"), PINBOX_NO_SPAWN="1")
    for name in [n for n in env if n.startswith(("CLAUDE", "CODEX_", "HERMES_", "PINBOX_SESSION", "GIT_"))]:
        del env[name]
    plain, hooked = os.path.join(workdir, "plain"), os.path.join(workdir, "hooked")
    make_repo(plain, env)
    make_repo(hooked, env)
    subprocess.run([sys.executable, os.path.join(ROOT, "pinbox.py"), "init"], cwd=hooked, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    store = pinbox.Store(os.path.join(hooked, ".pinbox"))
    for i in range(1000):  # a store with some history, as in a project that has used pinbox for a while
        pinbox.create_pin(store, {"text": "history pin %d" % i})
    results = {"floor": [], "plain": [], "hooked": [], "plain_fixes": [], "hooked_fixes": []}
    for i in range(runs):
        results["floor"].append(timed(FLOOR))
        message = ["commit", "-q", "--allow-empty", "-m", "change %d" % i]
        results["plain"].append(timed(["git"] + message, plain, env))
        results["hooked"].append(timed(["git"] + message, hooked, env))
        pin = pinbox.create_pin(store, {"text": "to fix %d" % i})
        fixes = ["commit", "-q", "--allow-empty", "-m", "fix %d" % i, "-m", "Fixes: %s" % pin["id"]]
        results["plain_fixes"].append(timed(["git"] + fixes, plain, env))
        results["hooked_fixes"].append(timed(["git"] + fixes, hooked, env))
    resolved = store.conn.execute("SELECT COUNT(*) FROM pins WHERE status = 'resolved'").fetchone()[0]
    store.close()
    if resolved != runs:
        raise SystemExit("bench: the hook resolved %d pins, expected %d" % (resolved, runs))
    added = [h - p for h, p in zip(results["hooked"], results["plain"])]
    added_fixes = [h - p for h, p in zip(results["hooked_fixes"], results["plain_fixes"])]
    floor = summarize(results["floor"])
    return [
        dict(name="floor: python3 -I -S -c pass", **floor),
        dict(name="git commit, no hook", **summarize(results["plain"])),
        dict(name="git commit + pinbox hook (no trailer)", **summarize(results["hooked"])),
        dict(name="  added by the hook (paired)", **summarize(added), target_ms=40),
        dict(name="git commit + pinbox hook (Fixes: pin_…)", **summarize(results["hooked_fixes"])),
        dict(name="  added by the hook (paired)", **summarize(added_fixes), target_ms=40),
    ]


BENCHMARKS = {"commit": bench_commit}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="repetitions per measurement (default 30)")
    parser.add_argument("--only", help="comma-separated benchmark names: " + ", ".join(BENCHMARKS))
    parser.add_argument("--json", default=os.path.join(HERE, "results", "latest.json"), help="where to write JSON")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    rows = []
    for name in names:
        workdir = tempfile.mkdtemp(prefix="pinbox-bench-")
        try:
            for row in BENCHMARKS[name](args.runs, workdir):
                rows.append(dict(row, group=name))
        finally:
            shutil.rmtree(workdir, True)
    print("%-44s %10s %10s %6s %10s" % ("measurement", "median ms", "p90 ms", "runs", "target"))
    for row in rows:
        target = "< %s ms" % row["target_ms"] if "target_ms" in row else ""
        verdict = ""
        if target:
            verdict = " met" if row["median_ms"] < row["target_ms"] else " MISSED"
        print("%-44s %10.1f %10.1f %6d %10s%s" % (row["name"], row["median_ms"], row["p90_ms"], row["runs"],
                                                   target, verdict))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"python": sys.version.split()[0], "pinbox": pinbox.VERSION, "cores": os.cpu_count(),
                   "rows": rows}, handle, indent=2)
    print("written: %s" % os.path.relpath(args.json))


if __name__ == "__main__":
    main()
