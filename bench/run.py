#!/usr/bin/env python3
"""pinbox benchmarks: each hot path as the median of repeated runs, side by side with its
floor measured in the same run. Standard library only.

    python3 bench/run.py [--runs N] [--only NAME[,NAME]] [--json PATH] [--baseline OLD/pinbox.py]

Prints a table and writes the same figures as JSON (default bench/results/latest.json).
"""

import argparse
import json
import os
import shlex
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
    repositories, one with pinbox's hook and one without, alternated pair by pair; and
    how soon it gives up when another writer holds the store (HOOK_TIMEOUT_S)."""
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
    if resolved != runs:
        raise SystemExit("bench: the hook resolved %d pins, expected %d" % (resolved, runs))
    # Another writer holds the store's write lock through the commit: the hook gives up
    # after HOOK_TIMEOUT_S and the commit goes on (the pin stays open).
    for i in range(min(runs, 10)):
        pin = pinbox.create_pin(store, {"text": "locked out %d" % i})
        fixes = ["commit", "-q", "--allow-empty", "-m", "locked %d" % i, "-m", "Fixes: %s" % pin["id"]]
        results.setdefault("plain_locked", []).append(timed(["git"] + fixes, plain, env))
        store.conn.execute("BEGIN IMMEDIATE")
        try:
            results.setdefault("hooked_locked", []).append(timed(["git"] + fixes, hooked, env))
        finally:
            store.conn.execute("ROLLBACK")
        if pinbox.find_pin(store.conn, pin["id"])["status"] != "open":
            raise SystemExit("bench: the hook wrote through another writer's lock")
    store.close()
    added = [h - p for h, p in zip(results["hooked"], results["plain"])]
    added_fixes = [h - p for h, p in zip(results["hooked_fixes"], results["plain_fixes"])]
    floor = summarize(results["floor"])
    return [
        dict(name="floor: python3 -I -S -c pass", **floor),
        dict(name="git commit, no hook", **summarize(results["plain"])),
        dict(name="git commit + pinbox hook (no trailer)", **summarize(results["hooked"])),
        dict(name="  added by the hook (paired)", **summarize(added), target_ms=35),
        dict(name="git commit + pinbox hook (Fixes: pin_…)", **summarize(results["hooked_fixes"])),
        dict(name="  added by the hook (paired)", **summarize(added_fixes), target_ms=35),
        dict(name="git commit + hook (Fixes:), store locked by a writer", **summarize(results["hooked_locked"])),
        dict(name="  added by the hook (paired)", target_ms=int(pinbox.HOOK_TIMEOUT_S * 1000) + 100, **summarize(
            [h - p for h, p in zip(results["hooked_locked"], results["plain_locked"])])),
    ]


def project(workdir, name, env):
    """A git repo set up with `pinbox init --agent claude` (so the hook commands are the
    ones init writes)."""
    path = os.path.join(workdir, name)
    make_repo(path, env)
    subprocess.run([sys.executable, os.path.join(ROOT, "pinbox.py"), "init", "--agent", "claude"], cwd=path, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def bench_env(workdir):
    """A fresh HOME with this pinbox installed on PATH (`pinbox install`), as a person
    has it: the hooks `init` writes for a team run the `pinbox` on PATH."""
    env = dict(os.environ, HOME=workdir, XDG_STATE_HOME=os.path.join(workdir, "state"), PINBOX_NO_SPAWN="1")
    for name in [n for n in env if n.startswith(("CLAUDE", "CODEX_", "HERMES_", "PINBOX_SESSION", "GIT_"))]:
        del env[name]
    folder = os.path.join(workdir, "bin")
    subprocess.run([sys.executable, os.path.join(ROOT, "pinbox.py"), "install", "--dir", folder], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env["PATH"] = folder + os.pathsep + env.get("PATH", os.defpath)
    return env


def fill(store, resolved, open_count, module=pinbox, bulk=False):
    """History: `resolved` resolved pins, then `open_count` open ones (written by
    `module`, a pinbox); `bulk` writes them all in one transaction (tens of thousands)."""
    if bulk:
        store.conn.execute("BEGIN IMMEDIATE")
        store.write = lambda: module._NoTransaction(store)
        try:
            fill(store, resolved, open_count, module)
        finally:
            del store.write
            store.conn.execute("COMMIT")
        return
    for i in range(resolved):
        pin = module.create_pin(store, {"text": "old pin %d, long since fixed" % i,
                                        "target": {"url": "http://localhost:3000/", "selector": "#el%d" % i}})
        module.resolve_pin(store, pin["id"], "agent", commit="0" * 40)
    for i in range(open_count):
        module.create_pin(store, {"text": "open pin %d: the button is clipped" % i,
                                  "target": {"url": "http://localhost:3000/", "selector": "#open%d" % i}})


def timed_rss(command, cwd, env, stdin=b""):
    """(milliseconds, peak RSS in KiB) of one run."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    proc.stdin.write(stdin)
    proc.stdin.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status
    return (time.perf_counter() - started) * 1000, usage.ru_maxrss


# An older pinbox.py to measure beside this one (--baseline): the hooks then alternate,
# run by run, between a project set up by each.
BASELINE = None


def load_pinbox(path):
    """A pinbox.py as a module of its own, to fill its stores with its own code."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pinbox_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hook_project(workdir, name, env, script, module, open_count):
    """A project set up by `script` (a pinbox.py) and filled by its module: the hook
    commands init wrote, by event."""
    path = os.path.join(workdir, name)
    make_repo(path, env)
    subprocess.run([sys.executable, script, "init", "--agent", "claude"], cwd=path, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = module.Store(os.path.join(path, ".pinbox"))
    fill(store, 10000, open_count, module)
    store.close()
    with open(os.path.join(path, ".claude", "settings.json")) as handle:
        hooks = json.load(handle)["hooks"]
    return path, {event: groups[0]["hooks"][0]["command"] for event, groups in hooks.items()}


def hook_row(name, samples, floor_ms):
    median = statistics.median(s[0] for s in samples)
    return dict(name=name, **summarize([s[0] for s in samples]), rss_kib=max(s[1] for s in samples),
                over_floor_ms=round(median - floor_ms, 2), target_over_floor_ms=15)


def bench_hooks(runs, workdir):
    """The agent hooks, run exactly as `init` writes them (through sh, like the agents),
    with 0, 10 and 100 open pins over 10,000 resolved ones, beside the floor (and beside
    the same hooks of --baseline, run for run)."""
    env = bench_env(workdir)
    floor = [timed_rss(["sh", "-c", " ".join(FLOOR[:3]) + " 'pass'"], workdir, env) for _ in range(runs)]
    rows = [dict(name="floor: sh -c 'python3 -I -S -c pass'", **summarize([f[0] for f in floor]),
                 rss_kib=max(f[1] for f in floor))]
    floor_ms = rows[0]["median_ms"]
    versions = [("", os.path.join(ROOT, "pinbox.py"), pinbox)]
    if BASELINE:
        versions.append((" [baseline]", BASELINE, load_pinbox(BASELINE)))
    for open_count in (0, 10, 100):
        projects = [hook_project(workdir, "hooks-%d%s" % (open_count, "-base" * n), env, script, module, open_count)
                    for n, (_, script, module) in enumerate(versions)]
        events = ("SessionStart", "UserPromptSubmit", "Stop") if open_count == 10 else ("UserPromptSubmit",)
        if open_count == 10:
            events = ("first",) + events
        for event in events:
            samples = [[] for _ in versions]
            for i in range(runs if event != "first" else max(3, runs // 5)):  # a slow baseline takes seconds
                for n, (repo, command) in enumerate(projects):
                    samples[n].append(first_prompt(repo, env, command["UserPromptSubmit"], i) if event == "first"
                                      else timed_rss(["sh", "-c", command[event]], repo, env, hook_payload(repo)))
            for n, (label, _, _) in enumerate(versions):
                name = ("UserPromptSubmit hook, first prompt ever" if event == "first" else "%s hook" % event)
                rows.append(hook_row("%s, %d open / 10,000 resolved%s" % (name, open_count, label), samples[n],
                                     floor_ms))
    return rows


def bench_flood(runs, workdir):
    """The prompt hook (a session's first prompt, and the next) and the Stop hook with
    10, 1,000, 5,000 and 20,000 open pins that no session has yet, over 50,000 resolved
    ones, beside the floor (and --baseline): flat, whatever waits."""
    env = bench_env(workdir)
    floor = [timed_rss(["sh", "-c", " ".join(FLOOR[:3]) + " 'pass'"], workdir, env) for _ in range(runs)]
    rows = [dict(name="floor: sh -c 'python3 -I -S -c pass'", **summarize([f[0] for f in floor]),
                 rss_kib=max(f[1] for f in floor))]
    versions = [("", os.path.join(ROOT, "pinbox.py"), pinbox)]
    if BASELINE:
        versions.append((" [baseline]", BASELINE, load_pinbox(BASELINE)))
    for waiting in (10, 1000, 5000, 20000):
        projects = []
        for n, (_, script, module) in enumerate(versions):
            path = os.path.join(workdir, "flood-%d-%d" % (waiting, n))
            make_repo(path, env)
            subprocess.run([sys.executable, script, "init", "--agent", "claude"], cwd=path, env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            store = module.Store(os.path.join(path, ".pinbox"))
            fill(store, 50000, waiting, module, bulk=True)
            store.close()
            with open(os.path.join(path, ".claude", "settings.json")) as handle:
                hooks = json.load(handle)["hooks"]
            projects.append((path, {event: groups[0]["hooks"][0]["command"] for event, groups in hooks.items()}))
        for event in ("first", "UserPromptSubmit", "Stop"):
            samples = [[] for _ in versions]
            for i in range(runs if event != "first" else max(3, runs // 3)):  # a slow baseline takes seconds
                for n, (repo, command) in enumerate(projects):
                    samples[n].append(first_prompt(repo, env, command["UserPromptSubmit"], i) if event == "first"
                                      else timed_rss(["sh", "-c", command[event]], repo, env, hook_payload(repo)))
            name = {"first": "prompt hook, a session's first", "UserPromptSubmit": "prompt hook, the next",
                    "Stop": "Stop hook"}[event]
            for n, (label, _, _) in enumerate(versions):
                rows.append(hook_row("%s, %d waiting / 50,000 resolved%s" % (name, waiting, label), samples[n],
                                     rows[0]["median_ms"]))
    return rows


def hook_payload(repo, key="bench"):
    return json.dumps({"session_id": key, "cwd": repo, "hook_event_name": "UserPromptSubmit"}).encode()


def first_prompt(repo, env, command, i):
    """(ms, RSS) of the first prompt of the first session in a project whose pins gathered
    before any session existed: the store is put back as it was first, untimed."""
    db = os.path.join(repo, ".pinbox", "pinbox.db")
    template = db + ".bench-template"
    if not os.path.exists(template):
        shutil.copyfile(db, template)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    shutil.copyfile(template, db)
    return timed_rss(["sh", "-c", command], repo, env, hook_payload(repo, "first-%d" % i))


def bench_cli(runs, workdir):
    env = bench_env(workdir)
    repo = project(workdir, "cli", env)
    store = pinbox.Store(os.path.join(repo, ".pinbox"))
    fill(store, 9990, 10)
    some = pinbox.list_pins(store, "open")[0]["id"]
    store.close()
    script = os.path.join(ROOT, "pinbox.py")
    imported = [sys.executable, "-I", "-S", "-c", "import sys;sys.path.append(%r);__import__('pinbox').main()" % ROOT]
    rows = [dict(name="floor: python3 -I -S -c pass", **summarize([timed(FLOOR) for _ in range(runs)]))]
    for label, args in (("pin", ["pin", "bench pin", "--url", "http://localhost:3000/"]), ("list --status open",
                        ["list", "--status", "open"]), ("list (all 10,000)", ["list"]), ("show", ["show", some])):
        rows.append(dict(name="pinbox %s, 10,000 pins" % label,
                         **summarize([timed(imported + args, repo, env) for _ in range(runs)])))
    # `pinbox install`'s launcher beside the script run directly, run for run.
    subprocess.run([sys.executable, script, "install", "--dir", os.path.join(workdir, "bin")], cwd=repo, env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    launcher, direct = [], []
    for _ in range(runs):
        launcher.append(timed([os.path.join(workdir, "bin", "pinbox"), "list", "--status", "open"], repo, env))
        direct.append(timed([sys.executable, script, "list", "--status", "open"], repo, env))
    rows.append(dict(name="python3 pinbox.py list --status open (script, compiled each run)", **summarize(direct)))
    rows.append(dict(name="pinbox list --status open (the installed launcher)", **summarize(launcher),
                     speedup=round(statistics.median(direct) / statistics.median(launcher), 2)))
    return rows


def bench_forms(runs, workdir):
    """Every way of running pinbox, for `list --json` (10 pins: what start-up costs shows)
    and for the prompt hook (100 open and 2,000 resolved pins), all taken in turn run by
    run beside the floor:
    the file dropped into PATH (its sh head), `python3 pinbox.py` (compiled each run),
    the installed launcher, a copy vendored in the repository, a zipapp; the hooks as
    init writes them (this machine's form, the team's form finding the launcher or the
    dropped-in file on PATH, the team's form finding a vendored copy)."""
    env = bench_env(workdir)
    dropped = os.path.join(workdir, "dropped")
    os.makedirs(dropped)
    shutil.copy(os.path.join(ROOT, "pinbox.py"), os.path.join(dropped, "pinbox"))
    os.chmod(os.path.join(dropped, "pinbox"), 0o755)
    zipped, bare_zip = os.path.join(workdir, "pinbox.pyz"), os.path.join(workdir, "bare.pyz")
    for target, compiled in ((zipped, True), (bare_zip, False)):  # README's way (its bytecode inside), and without
        build = tempfile.mkdtemp(dir=workdir)
        shutil.copy(os.path.join(ROOT, "pinbox.py"), build)
        if compiled:
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-b", build], check=True)
        subprocess.run([sys.executable, "-m", "zipapp", build, "-m", "pinbox:main", "-o", target], check=True)
    repos = {}
    for name in ("installed", "vendored", "small"):
        path = os.path.join(workdir, name)
        make_repo(path, env)
        script = os.path.join(ROOT, "pinbox.py")
        if name == "vendored":
            script = os.path.join(path, "tools", "pinbox.py")
            os.makedirs(os.path.dirname(script))
            shutil.copy(os.path.join(ROOT, "pinbox.py"), script)
        subprocess.run([sys.executable, script, "init", "--agent", "claude"], cwd=path, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        store = pinbox.Store(os.path.join(path, ".pinbox"))
        fill(store, *((0, 10) if name == "small" else (2000, 100)))
        store.close()
        with open(os.path.join(path, ".claude", "settings.json")) as handle:
            repos[name] = (path, json.load(handle)["hooks"]["UserPromptSubmit"][0]["hooks"][0]["command"])
    repo, team = repos["installed"]
    small = repos["small"][0]

    def own_copy(name):
        """A copy of the filled project for one hook form: a machine runs one form, and
        the prompt context a form keeps names the pinbox file that made it."""
        copy = os.path.join(workdir, name)
        shutil.copytree(repo, copy, symlinks=True)
        return copy
    launcher_repo, dropped_repo, zip_repo = own_copy("launcher-form"), own_copy("dropped-form"), own_copy("zip-form")
    on_path_dropped = dict(env, PATH=dropped + os.pathsep + env["PATH"].split(os.pathsep, 1)[1])
    floor = (["sh", "-c", shlex.join(FLOOR)], repo, env, b"")
    lists = [("floor: python3 -I -S -c pass", floor),
             ("floor through PATH's python3 (here: %s)" % (shutil.which("python3") or "none"),
              (["sh", "-c", "python3 -I -S -c pass"], repo, env, b"")),
             ("list: the file dropped into PATH", ([os.path.join(dropped, "pinbox"), "list", "--json"], small, env,
                                                   b"")),
             ("list: the installed launcher", ([os.path.join(workdir, "bin", "pinbox"), "list", "--json"], small, env,
                                               b"")),
             ("list: python3 pinbox.py (compiled each run)",
              ([sys.executable, os.path.join(ROOT, "pinbox.py"), "list", "--json"], small, env, b"")),
             ("list: a copy vendored in the repository",
              (["sh", os.path.join(repos["vendored"][0], "tools", "pinbox.py"), "list", "--json"], small, env, b"")),
             ("list: a zipapp, built as README says", ([sys.executable, zipped, "list", "--json"], small, env, b"")),
             ("list: a zipapp of the bare file (compiled each run)",
              ([sys.executable, bare_zip, "list", "--json"], small, env, b""))]
    inject = ["session", "inject", "--hook", "--agent", "claude"]
    hooks = [("prompt hook: this machine's form (settings.local.json)",
              (["sh", "-c", pinbox.agent_hook_command("claude", "inject")], repo, env, hook_payload(repo))),
             ("prompt hook: the team's form, the launcher on PATH",
              (["sh", "-c", team], launcher_repo, env, hook_payload(launcher_repo))),
             ("prompt hook: the team's form, the file dropped into PATH",
              (["sh", "-c", team], dropped_repo, on_path_dropped, hook_payload(dropped_repo))),
             ("prompt hook: the team's form, a vendored copy",
              (["sh", "-c", repos["vendored"][1]], repos["vendored"][0], env, hook_payload(repos["vendored"][0]))),
             ("prompt hook: a zipapp, built as README says",
              ([sys.executable, "-I", "-S", zipped] + inject, zip_repo, env, hook_payload(zip_repo)))]
    forms = lists + hooks
    for name, (command, cwd, form_env, stdin) in forms:  # warm: bytecode written, the interpreter recorded
        done = subprocess.run(command, cwd=cwd, env=form_env, input=stdin, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        expected = b"" if name.startswith("floor") else b"100 open pin(s)" if "hook" in name else b'"ok": true'
        if done.returncode != 0 or expected not in done.stdout:
            raise SystemExit("bench: %s answered %r %r" % (name, done.stdout[:200], done.stderr[:200]))
    samples = {name: [] for name, _ in forms}
    for _ in range(runs):
        for name, (command, cwd, form_env, stdin) in forms:
            samples[name].append(timed_rss(command, cwd, form_env, stdin)[0])
    floor_runs = samples[forms[0][0]]
    rows = []
    for name, _ in forms:
        row = dict(name=name, **summarize(samples[name]))
        if not name.startswith("floor"):
            row["over_floor_ms"] = round(statistics.median([a - f for a, f in zip(samples[name], floor_runs)]), 2)
        rows.append(row)
    launcher = samples["list: the installed launcher"]
    rows.append(dict(name="  the dropped-in file / the launcher (paired)", ratio=round(statistics.median(
        [a / b for a, b in zip(samples["list: the file dropped into PATH"], launcher)]), 2), target_ratio=1.3))
    return rows


def start_hub(repo, env):
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pinbox.py"), "serve"], cwd=repo, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        data = pinbox.running_hub(repo) if os.path.isdir(repo) else None
        if data and data["pid"] == proc.pid:
            return proc, data
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("bench: the hub did not start")


def call_hub(port, token, method, path, body=None):
    from http.client import HTTPConnection
    conn = HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    return answer.status, data


def bench_hub(runs, workdir):
    import threading
    env = bench_env(workdir)
    repo = project(workdir, "hub", env)
    old = dict(os.environ)
    os.environ.update(XDG_STATE_HOME=env["XDG_STATE_HOME"])
    store = pinbox.Store(os.path.join(repo, ".pinbox"))
    fill(store, 9990, 10)
    store.close()
    proc, hub = start_hub(repo, env)
    rows = []
    try:
        port, token = hub["port"], hub["token"]
        for clients in (1, 8, 32):
            per = max(20, 400 // clients)
            errors = []

            def client():
                # A lean keep-alive client on a raw socket: http.client's own parsing
                # would be the bottleneck, and this measures the hub.
                import socket
                body = json.dumps({"text": "load", "author": {"userId": "b"}}).encode()
                request = (b"POST /pins HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token.encode()
                           + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reader = sock.makefile("rb")
                for i in range(per):
                    sock.sendall(request)
                    status = int(reader.readline().split()[1])
                    length = 0
                    for line in iter(reader.readline, b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    reader.read(length)
                    if status != 201:
                        errors.append(status)
                sock.close()

            threads = [threading.Thread(target=client) for _ in range(clients)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - started
            rows.append({"name": "POST /pins, %d client(s)" % clients, "per_second": round(clients * per / seconds),
                         "errors": len(errors), "target_per_second": 1000 if clients == 8 else None})
        samples = [time_call(lambda: call_hub(port, token, "GET", "/pins?status=open")) for _ in range(runs)]
        rows.append(dict(name="GET /pins?status=open, ~10,000 pins", **summarize(samples)))
        rows.append(dict(name="POST /pins -> event on an open /stream", **summarize(stream_latency(port, token, runs)),
                         target_ms=20))
    finally:
        proc.terminate()
        proc.wait()
        os.environ.clear()
        os.environ.update(old)
    return rows


def time_call(fn):
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def stream_latency(port, token, runs):
    from http.client import HTTPConnection
    last = json.loads(call_hub(port, token, "GET", "/summary")[1])["data"]["lastEventSeq"]
    conn = HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/stream?token=%s&after=%d" % (token, last))
    answer = conn.getresponse()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call_hub(port, token, "POST", "/pins", {"text": "stream", "author": {"userId": "b"}})
        line = answer.fp.readline()
        while not line.startswith(b"data:"):
            line = answer.fp.readline()
        samples.append((time.perf_counter() - started) * 1000)
    conn.close()
    return samples


def bench_delivery(runs, workdir):
    """Webhook pushes: throughput, pin-to-receipt latency, and what one pass of the
    queue costs with a short and a long delivered history (it must not grow)."""
    import http.server
    import threading
    env = bench_env(workdir)
    received = {}
    lock = threading.Lock()

    class Receiver(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                received.setdefault(body["event"]["payload"]["id"], time.perf_counter())
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env.update(PINBOX_WEBHOOK_URL="http://127.0.0.1:%d/" % server.server_address[1], PINBOX_WEBHOOK_SECRET="bench")
    repo = project(workdir, "delivery", env)
    store = pinbox.Store(os.path.join(repo, ".pinbox"))
    with store.write() as conn:
        session, _ = pinbox.upsert_session(conn, "claude", "gone", repo)
        pinbox.end_session(conn, session)
    ref = {"agent": "claude", "key": "gone"}
    rows = []
    old = dict(os.environ)
    os.environ.update(XDG_STATE_HOME=env["XDG_STATE_HOME"])
    proc, hub = start_hub(repo, env)
    try:
        # Throughput: a burst of 500 pins, all for an ended session with no agent binary.
        for i in range(500):
            pinbox.create_pin(store, {"text": "burst %d" % i, "agentSession": ref})
        started = time.perf_counter()
        while len(received) < 500 and time.perf_counter() - started < 120:
            time.sleep(0.01)
        rows.append({"name": "webhook deliveries, burst of 500", "errors": 500 - len(received),
                     "per_second": round(len(received) / (time.perf_counter() - started)), "target_per_second": 300})
        # Latency: one pin at a time, from its commit to the receiver.
        samples = []
        for i in range(max(runs, 50)):
            made = time.perf_counter()
            pin = pinbox.create_pin(store, {"text": "latency %d" % i, "agentSession": ref})
            while pin["id"] not in received and time.perf_counter() - made < 10:
                time.sleep(0.001)
            samples.append((received.get(pin["id"], time.perf_counter()) - made) * 1000)
        row = dict(name="pin created -> webhook received", **summarize(samples), target_ms=100)
        row["p99_ms"] = round(sorted(samples)[int(len(samples) * 0.99) - 1], 2)
        rows.append(row)
    finally:
        proc.terminate()
        proc.wait()
        os.environ.clear()
        os.environ.update(old)
        server.shutdown()
    for history in (1000, 100000):
        conn = store.conn
        with store.write():
            have = conn.execute("SELECT COUNT(*) FROM deliveries").fetchone()[0]
            conn.executemany("INSERT INTO deliveries(event_seq, session_id, adapter, status, attempts, updated_at, "
                             "delivered_at) VALUES (1, ?, 'webhook', 'delivered', 1, ?, ?)",
                             [(session["id"], pinbox.iso_time(), pinbox.iso_time())] * max(0, history - have))
        samples = [time_call(lambda: pinbox.claim_due(store, "bench")) for _ in range(runs * 3)]
        rows.append(dict(name="one queue pass, %d delivered rows in the ledger" % history, **summarize(samples)))
    store.close()
    return rows


def bench_inbox(runs, workdir):
    """How fast a parked `agent inbox --wait` wakes when another process posts, with 1
    and with 200 readers parked."""
    env = dict(bench_env(workdir), PINBOX_MAX_SESSIONS="1000")
    os.environ["PINBOX_MAX_SESSIONS"] = "1000"
    repo = project(workdir, "inbox", env)
    store = pinbox.Store(os.path.join(repo, ".pinbox"))
    with store.write() as conn:
        sessions = [pinbox.upsert_session(conn, "claude", "s%d" % i, repo)[0]["id"] for i in range(201)]
    store.close()
    boot = "import sys;sys.path.append(%r);__import__('pinbox').main()" % ROOT
    rows = []
    for parked in (1, 200):
        others = [subprocess.Popen([sys.executable, "-I", "-S", "-c", boot, "agent", "inbox", "--wait", "--timeout",
                                    "120000"], cwd=repo, env=dict(env, PINBOX_SESSION=s), stdout=subprocess.DEVNULL)
                  for s in sessions[1:parked]]
        wait_parked(repo, parked - 1)
        samples = []
        for i in range(max(runs, 30)):
            waiter = subprocess.Popen([sys.executable, "-I", "-S", "-c", boot, "agent", "inbox", "--wait", "--timeout",
                                       "60000"], cwd=repo, env=dict(env, PINBOX_SESSION=sessions[0]),
                                      stdout=subprocess.PIPE)
            wait_parked(repo, parked)
            with_store = pinbox.Store(os.path.join(repo, ".pinbox"))
            posted = time.perf_counter()
            pinbox.post_message(with_store, sessions[0], "ping %d" % i)
            waiter.stdout.read()
            waiter.wait()
            samples.append((time.perf_counter() - posted) * 1000)
            with with_store.write() as conn:
                conn.execute("DELETE FROM inbox")
            with_store.close()
        for proc in others:
            proc.terminate()
            proc.wait()
        row = dict(name="inbox --wait woken by a post, %d parked (incl. process exit)" % parked, **summarize(samples),
                   target_ms=20)
        row["p99_ms"] = round(sorted(samples)[int(len(samples) * 0.99) - 1], 2)
        rows.append(row)
    return rows


def wait_parked(repo, count):
    folder = os.path.join(repo, ".pinbox", "inbox-wait")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if count == 0 or (os.path.isdir(folder) and len(os.listdir(folder)) >= count):
            return
        time.sleep(0.005)
    raise SystemExit("bench: readers did not park")


KEEP_ALIVE_SERVER = """import http.server
class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as Node's servers do: no 40 ms delayed-ACK stall per answer
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def end_bench(saved_env, *procs):
    """Puts the environment back and stops what a bench started (its hub, its app)."""
    os.environ.clear()
    os.environ.update(saved_env)
    for proc in procs:
        proc.terminate()
        proc.wait()


def bench_proxy(runs, workdir):
    """The page proxy of `pinbox open` beside the app alone, run for run: one static asset
    on a new connection, and the assets 8 clients that keep their connections open (as a
    browser does) get through in 3 s."""
    import threading
    env = bench_env(workdir)
    site = os.path.join(workdir, "site")
    os.makedirs(site)
    with open(os.path.join(site, "app.js"), "wb") as handle:
        handle.write(os.urandom(20000))
    # The app: a static server that keeps connections open, as dev servers do.
    app = subprocess.Popen([sys.executable, "-c", KEEP_ALIVE_SERVER], cwd=site, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
    upstream_port = int(app.stdout.readline())  # it listens once it says where
    repo = project(workdir, "proxy", env)
    old = dict(os.environ)
    os.environ.update(XDG_STATE_HOME=env["XDG_STATE_HOME"])  # where start_hub looks for the hub
    proc, hub = start_hub(repo, env)
    try:
        status, data = call_hub(hub["port"], hub["token"], "POST", "/proxies",
                                {"upstream": "http://127.0.0.1:%d" % upstream_port})
        proxy_port = json.loads(data)["data"]["port"]
        targets = {"direct": upstream_port, "proxy": proxy_port}

        def get(port, conn=None):
            """One asset, on `conn` (kept open, as a browser keeps it) or a connection of its own."""
            from http.client import HTTPConnection
            own = conn is None
            conn = conn or HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/app.js", headers={"Host": "127.0.0.1:%d" % port})
            answer = conn.getresponse()
            body = answer.read()
            if own:
                conn.close()
            if answer.status != 200 or len(body) != 20000:
                raise SystemExit("bench: %d gave %d (%d bytes)" % (port, answer.status, len(body)))

        samples = {"direct": [], "proxy": []}
        for _ in range(max(runs, 50)):
            for name, port in targets.items():
                started = time.perf_counter()
                get(port)
                samples[name].append((time.perf_counter() - started) * 1000)
        added = [p - d for p, d in zip(samples["proxy"], samples["direct"])]
        rows = [dict(name="GET a 20 KB asset from the app alone", **summarize(samples["direct"])),
                dict(name="GET a 20 KB asset through the page proxy", **summarize(samples["proxy"])),
                dict(name="  added by the proxy (paired)", **summarize(added), target_ms=2)]
        rates = {}
        for name, port in targets.items():
            done, stop = [0], time.perf_counter() + 3

            def client():
                from http.client import HTTPConnection
                conn = HTTPConnection("127.0.0.1", port, timeout=30)
                while time.perf_counter() < stop:
                    get(port, conn)
                    done[0] += 1
                conn.close()

            threads = [threading.Thread(target=client) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rates[name] = done[0] / 3.0
        rows.append({"name": "20 KB assets, 8 kept-alive clients, the app alone", "per_second": round(rates["direct"]),
                     "errors": 0})
        rows.append({"name": "20 KB assets, 8 kept-alive clients, through the proxy", "per_second": round(rates["proxy"]),
                     "errors": 0, "target_per_second": round(0.8 * rates["direct"])})
        return rows
    finally:
        end_bench(old, proc, app)


class McpPipe:
    """`pinbox mcp` as a child, one JSON-RPC line at a time."""

    def __init__(self, repo, env):
        self.proc = subprocess.Popen(pinbox.mcp_argv(repo), cwd=repo, env=env,  # the command `init` writes
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.next_id = 0

    def send(self, message):
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self):
        return json.loads(self.proc.stdout.readline())

    def call(self, method, params=None):
        self.next_id += 1
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params or {}})
        while True:
            message = self.read()
            if message.get("id") == self.next_id:
                return message

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()
        self.proc.stdout.close()


def bench_mcp(runs, workdir):
    """pinbox mcp as a client sees it: from spawning the server to its tools listed
    (initialize, initialized, tools/list), one tools/call, and from `pinbox pin` in
    another process to notifications/resources/updated on a subscribed client."""
    env = bench_env(workdir)
    repo = project(workdir, "mcp", env)
    store = pinbox.Store(os.path.join(repo, ".pinbox"))
    fill(store, 1000, 20)
    store.close()
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}
    samples = {"floor": [], "listed": [], "call": [], "notified": []}
    for _ in range(runs):
        samples["floor"].append(timed(FLOOR))
        started = time.perf_counter()
        pipe = McpPipe(repo, env)
        pipe.call("initialize", hello)
        pipe.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        tools = pipe.call("tools/list")["result"]["tools"]
        samples["listed"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        answer = pipe.call("tools/call", {"name": "list_pins", "arguments": {"limit": 20}})
        samples["call"].append((time.perf_counter() - started) * 1000)
        if len(tools) != 8 or len(answer["result"]["structuredContent"]["pins"]) != 20:
            raise SystemExit("bench: pinbox mcp answered %r" % str(answer)[:300])
        pipe.call("resources/subscribe", {"uri": "pinbox://pins/open"})
        started = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, "pinbox.py"), "pin", "bench"], cwd=repo, env=env,
                       stdout=subprocess.DEVNULL, check=True)
        while pipe.read().get("method") != "notifications/resources/updated":
            pass
        samples["notified"].append((time.perf_counter() - started) * 1000)
        pipe.close()
    floor = summarize(samples["floor"])
    return [dict(name="floor: python3 -I -S -c pass", **floor),
            dict(name="spawn pinbox mcp to its tools listed", **summarize(samples["listed"]), target_ms=100),
            dict(name="one tools/call (list_pins, 20 open / 1,000 resolved)", **summarize(samples["call"]),
                 target_ms=20),
            dict(name="pinbox pin in another process -> resources/updated", **summarize(samples["notified"]),
                 target_ms=1000)]


def chromium_binary():
    """Headless Chromium for the page timings: the one the browser tests use (PINBOX_TEST_CHROMIUM)."""
    path = os.environ.get("PINBOX_TEST_CHROMIUM")
    return path if path and os.access(path, os.X_OK) else None


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe, for the few moves the
    bench makes: open a page, run a script, click an element, press a key, type.
    Chromium reads commands from its fd 3 and answers on fd 4."""

    CTRL = 2  # the DevTools modifier bit

    def __init__(self, binary, workdir):
        self.profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)
        their_in, self.out = os.pipe()
        self.inp, their_out = os.pipe()
        launch = "import os,sys;os.dup2(%d,3);os.dup2(%d,4);os.execv(sys.argv[1],sys.argv[1:])" % (their_in, their_out)
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio",
                 "--disable-background-networking", "--disable-extensions", "--window-size=1280,800",
                 "--remote-debugging-pipe", "--user-data-dir=" + os.path.join(self.profile, "profile")]
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", launch, binary] + flags + ["about:blank"],
                                     pass_fds=(their_in, their_out), env=dict(os.environ, HOME=self.profile),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(their_in)
        os.close(their_out)
        self.pending, self.seen, self.asked, self.page = b"", [], 0, None

    def send(self, method, params=None, to_page=True, timeout=60):
        """The answer to one command (a hang guard of `timeout` s); events met meanwhile are kept."""
        self.asked += 1
        command = dict({"id": self.asked, "method": method, "params": params or {}},
                       **({"sessionId": self.page} if to_page else {}))
        os.write(self.out, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(deadline, method)
            if message.get("id") != self.asked:
                self.seen.append(message.get("method"))
            elif "error" in message:
                raise SystemExit("bench: %s: %s" % (method, message["error"]))
            else:
                return message.get("result", {})

    def receive(self, deadline, awaited):
        import select
        while b"\0" not in self.pending:
            if not select.select([self.inp], [], [], max(0, deadline - time.monotonic()))[0]:
                raise SystemExit("bench: chromium gave no %s" % awaited)
            chunk = os.read(self.inp, 1 << 16)
            if not chunk:
                raise SystemExit("bench: chromium exited")
            self.pending += chunk
        raw, self.pending = self.pending.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url):
        """Loads `url` in the bench's one tab, and returns once its load event fired."""
        if self.page is None:
            tab = self.send("Target.createTarget", {"url": "about:blank"}, to_page=False)["targetId"]
            self.page = self.send("Target.attachToTarget", {"targetId": tab, "flatten": True}, to_page=False)["sessionId"]
            self.send("Page.enable")
        self.seen = []
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + 30
        while "Page.loadEventFired" not in self.seen:
            self.seen.append(self.receive(deadline, "load event").get("method"))

    def evaluate(self, expression):
        answer = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True})
        if "exceptionDetails" in answer:
            raise SystemExit("bench: the page threw: %s" % answer["exceptionDetails"].get("text"))
        return answer["result"].get("value")

    def wait_for(self, expression, timeout=5.0):
        """Returns once `expression` is true in the page, looked at on each frame."""
        return self.evaluate("new Promise((yes, no) => { const end = performance.now() + %d; (function look() {"
                             " let v; try { v = (%s) } catch (e) {} if (v) yes(v); else if (performance.now() > end)"
                             " no(new Error('timed out')); else requestAnimationFrame(look) })() })"
                             % (timeout * 1000, expression))

    def click_at(self, element):
        x, y = self.evaluate("(() => { const r = (%s).getBoundingClientRect(); return [r.left + r.width / 2,"
                             " r.top + r.height / 2] })()" % element)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})

    def key(self, name, modifiers=0):
        """One key down and up: a letter, or Enter; with Ctrl it types nothing."""
        event = {"key": name, "code": "Enter" if name == "Enter" else "Key" + name.upper(), "modifiers": modifiers,
                 "windowsVirtualKeyCode": 13 if name == "Enter" else ord(name.upper())}
        typed = None if modifiers else "\r" if name == "Enter" else name
        self.send("Input.dispatchKeyEvent", dict(event, type="keyDown", text=typed) if typed else
                  dict(event, type="rawKeyDown"))
        self.send("Input.dispatchKeyEvent", dict(event, type="keyUp"))

    def type_text(self, text):
        self.send("Input.insertText", {"text": text})

    def close(self):
        try:
            self.send("Browser.close", to_page=False, timeout=5)
            self.proc.wait(timeout=5)
        except (SystemExit, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        self.proc.wait()
        os.close(self.inp)
        os.close(self.out)


def toolbar_element(selector):
    return "document.getElementById('pinbox-toolbar-host').shadowRoot.querySelector(%s)" % json.dumps(selector)


def product_png(width, height):
    """The shop's product picture: a brown PNG, written with zlib."""
    import struct
    import zlib
    parts = [(b"IHDR", struct.pack("!2I5B", width, height, 8, 2, 0, 0, 0)),
             (b"IDAT", zlib.compress((b"\0" + b"\xb4\x78\x3c" * width) * height)), (b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(struct.pack("!I", len(data)) + kind + data + struct.pack(
        "!I", zlib.crc32(kind + data)) for kind, data in parts)


def typical_page(site, hub):
    """A shop page of about 400 elements: a stylesheet, a nav, 24 cards with a picture
    and a button each; the hub's toolbar tag; and the bench's own stopwatch (a keydown
    and a click listener that run before the toolbar's, and a fetch that notes when
    POST /pins answers)."""
    with open(os.path.join(site, "shoe.png"), "wb") as handle:
        handle.write(product_png(160, 100))
    rules = "".join(".c%d{margin:%dpx;color:#%03x}" % (i, i % 7, i * 37 % 4096) for i in range(200))
    cards = "".join("<article class='card c%d'><img src=/shoe.png width=160 height=100 alt=shoe><h3>Shoe %d</h3>"
                    "<p>Leather, size %d. <em>In stock</em></p><button class=buy id=buy%d>Buy</button></article>"
                    % (i, i, 36 + i % 10, i) for i in range(24))
    page = ("<!doctype html><meta charset=utf-8><title>Shop</title><style>body{font:15px sans-serif;margin:0}"
            "nav{display:flex;gap:12px;padding:12px;background:#222}nav a{color:#eee}main{display:grid;"
            "grid-template-columns:repeat(4,1fr);gap:16px;padding:16px}.card{border:1px solid #ddd;padding:10px;"
            "border-radius:8px}.buy{background:#d33;color:#fff;border:0;padding:8px 16px}" + rules + "</style>"
            "<script>window.__bench={};addEventListener('keydown',e=>{if(e.key==='Enter'&&e.ctrlKey)__bench.sent="
            "performance.now()},true);addEventListener('click',()=>{__bench.picked=performance.now()},true);"
            "const f=window.fetch;window.fetch=function(u,o){const p=f.apply(this,arguments);if(o&&o.method==='POST'&&"
            "String(u).endsWith('/pins'))p.then(()=>{__bench.stored=performance.now();__bench.done&&__bench.done()});"
            "return p}</script><nav>" + "".join("<a href=#%d>Section %d</a>" % (i, i) for i in range(8)) +
            "</nav><main>" + cards + "</main><script src='http://127.0.0.1:%d/toolbar.js' data-token='%s'></script>"
            % (hub["port"], hub["token"]))
    with open(os.path.join(site, "index.html"), "w") as handle:
        handle.write(page)


def bench_toolbar(runs, workdir):
    """The page toolbar in headless Chromium: its size, the time from the pick to the
    picture drawn, and from Ctrl+Enter to the pin stored with its two PNGs, beside the
    same pin without a picture (capture turned off), run for run."""
    import gzip
    rows = [{"name": "toolbar.js as served", "bytes": len(pinbox.TOOLBAR_JS.encode()),
             "gzip_bytes": len(gzip.compress(pinbox.TOOLBAR_JS.encode()))}]
    binary = chromium_binary()
    if binary is None:
        print("bench: toolbar timings skipped: chromium not installed")
        return rows
    env = bench_env(workdir)
    site = os.path.join(workdir, "site")
    os.makedirs(site)
    app = subprocess.Popen([sys.executable, "-c", KEEP_ALIVE_SERVER], cwd=site, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
    port = int(app.stdout.readline())
    repo = project(workdir, "toolbar", env)
    old = dict(os.environ)
    os.environ.update(XDG_STATE_HOME=env["XDG_STATE_HOME"])
    proc, hub = start_hub(repo, env)
    browser = Browser(binary, workdir)
    try:
        typical_page(site, hub)
        samples = {"drawn": [], "capture": [], "plain": []}
        thumb_ready = ("new Promise(r => { const t = %s; const done = () => r(performance.now() - __bench.picked);"
                       " if (t.classList.contains('ready')) return done(); new MutationObserver(done).observe(t, "
                       "{attributes: true}); })" % toolbar_element(".thumb"))
        browser.open("http://127.0.0.1:%d/index.html" % port)
        browser.wait_for("!!document.getElementById('pinbox-toolbar-host')", 10)
        for i in range(runs):
            for mode in ("capture", "plain"):
                browser.key("p")
                browser.click_at("document.getElementById('buy%d')" % (i % 24))
                browser.wait_for("!!(%s)" % toolbar_element('[data-pinbox="comment"]'))
                drawn = browser.evaluate(thumb_ready)
                if mode == "capture":
                    samples["drawn"].append(drawn)
                else:
                    browser.click_at(toolbar_element('[data-pinbox="capture"]'))
                browser.click_at(toolbar_element('[data-pinbox="comment"]'))
                browser.type_text("bench pin %d" % i)
                browser.evaluate("(__bench.wait = new Promise(r => { __bench.done = r; }), 1)")
                browser.key("Enter", modifiers=browser.CTRL)
                browser.evaluate("__bench.wait")
                samples[mode].append(browser.evaluate("__bench.stored - __bench.sent"))
                browser.wait_for("!%s" % toolbar_element('[data-pinbox="composer"]'))
        status, data = call_hub(hub["port"], hub["token"], "GET", "/pins")
        pins = json.loads(data)["data"]
        with_pictures = sum(1 for p in pins if len(p.get("attachments") or []) == 2)
        if with_pictures != runs or len(pins) != 2 * runs:
            raise SystemExit("bench: %d pins, %d with pictures (expected %d, %d)" % (len(pins), with_pictures,
                                                                                     2 * runs, runs))
        rows += [dict(name="pick to the picture drawn (page copy, 2 PNGs)", **summarize(samples["drawn"])),
                 dict(name="Ctrl+Enter to the pin stored with its 2 PNGs", **summarize(samples["capture"]),
                      target_ms=300),
                 dict(name="Ctrl+Enter to the pin stored, capture off", **summarize(samples["plain"]))]
        return rows
    finally:
        browser.close()
        end_bench(old, proc, app)


def bench_sync(runs, workdir):
    """`pinbox sync` through a bare git remote on this machine: the first sync of an
    empty clone that gets 10,000 pins and 1,000 screenshots, and an incremental sync
    of one new pin, each beside `git fetch` of the same refs alone, plus what the refs
    add to the remote."""
    env = bench_env(workdir)
    script = os.path.join(ROOT, "pinbox.py")
    remote = os.path.join(workdir, "team.git")
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", remote], check=True)
    source = os.path.join(workdir, "a")
    make_repo(source, env)
    subprocess.run(["git", "remote", "add", "origin", remote], cwd=source, check=True)
    subprocess.run(["git", "push", "-q", "origin", "main"], cwd=source, env=env, check=True)
    store = pinbox.Store(os.path.join(source, ".pinbox"))
    media = os.path.join(source, ".pinbox", "media")
    os.makedirs(media)
    for i in range(10000):
        attachments = None
        if i % 10 == 0:  # 1,000 screenshots of 40 KiB (random bytes: git cannot compress them away)
            name = "att_%010d.png" % i
            with open(os.path.join(media, name), "wb") as handle:
                handle.write(os.urandom(40 * 1024))
            attachments = [{"id": name[:-4], "kind": "screenshot", "url": "/media/" + name, "contentType": "image/png"}]
        pinbox.create_pin(store, dict({"text": "pin %d: the button is clipped on narrow screens" % i,
                                       "target": {"url": "http://localhost:3000/p%d" % (i % 40), "selector": "#b%d" % i}},
                                      **({"attachments": attachments} if attachments else {})))
    store.close()
    started = time.perf_counter()
    subprocess.run([sys.executable, script, "sync"], cwd=source, env=env, check=True, stdout=subprocess.DEVNULL)
    export_ms = (time.perf_counter() - started) * 1000
    size = subprocess.run(["git", "rev-list", "--objects", "--disk-usage", "--glob=refs/pinbox/*"], cwd=remote,
                          stdout=subprocess.PIPE, check=True).stdout.decode().strip()
    samples = {"fetch": [], "full": [], "fetch1": [], "one": []}
    for i in range(min(runs, 3)):
        clone = os.path.join(workdir, "b%d" % i)
        # file:// copies objects as a remote would send them (a path would hard-link them all)
        subprocess.run(["git", "clone", "-q", "file://" + remote, clone], env=env, check=True)
        plain = os.path.join(workdir, "plain%d" % i)
        subprocess.run(["git", "clone", "-q", "file://" + remote, plain], env=env, check=True)
        samples["fetch"].append(timed(["git", "fetch", "-q", "origin", "+refs/pinbox/devices/*:refs/pinbox/x/*"],
                                      cwd=plain, env=env))
        samples["full"].append(timed([sys.executable, script, "sync"], cwd=clone, env=env))
        shutil.rmtree(plain)
    state = json.loads(subprocess.run([sys.executable, script, "list", "--json"], cwd=clone, env=env,
                                      stdout=subprocess.PIPE, check=True).stdout)["data"]
    shots = sum(1 for p in state if p.get("attachments") and os.path.isfile(p["attachments"][0].get("path", "")))
    if len(state) != 10000 or shots != 1000:
        raise SystemExit("bench: the clone got %d pins and %d screenshots" % (len(state), shots))
    for i in range(runs):
        subprocess.run([sys.executable, script, "pin", "one more %d" % i], cwd=source, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, script, "sync"], cwd=source, env=env, check=True, stdout=subprocess.DEVNULL)
        samples["fetch1"].append(timed(["git", "fetch", "-q", "origin", "+refs/pinbox/devices/*:refs/pinbox/y/*"],
                                       cwd=clone, env=env))
        samples["one"].append(timed([sys.executable, script, "sync"], cwd=clone, env=env))
    return [dict(name="first sync on the source (10,000 pins staged and pushed)", **summarize([export_ms])),
            {"name": "what the refs add to the remote (10,000 pins, 1,000 x 40 KiB)", "bytes": int(size)},
            dict(name="git fetch of those refs alone, into an empty clone", **summarize(samples["fetch"])),
            dict(name="pinbox sync of an empty clone: 10,000 pins, 1,000 shots", **summarize(samples["full"]),
                 target_ms=30000),
            dict(name="git fetch alone, after one new pin", **summarize(samples["fetch1"])),
            dict(name="pinbox sync of one new pin", **summarize(samples["one"]), target_ms=1000)]


def synthetic_map(size):
    """A version 3 source map of about `size` bytes: rows of segments as a bundler writes
    them (a module of many short lines, each with a few mapped columns)."""
    import random
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def vlq(value):
        value = (-value << 1) | 1 if value < 0 else value << 1
        out = ""
        while True:
            digit, value = value & 31, value >> 5
            out += digits[digit | (32 if value else 0)]
            if not value:
                return out
    rng = random.Random(1)
    rows, total = [], 0
    while total < size:
        row = ",".join(vlq(rng.randrange(1, 30)) + vlq(0) + vlq(rng.randrange(0, 4)) +
                       vlq(rng.randrange(-20, 20)) for _ in range(rng.randrange(1, 8)))
        rows.append(row)
        total += len(row) + 1
    return json.dumps({"version": 3, "sources": ["src/m%d.tsx" % i for i in range(40)], "names": [],
                       "mappings": ";".join(rows)}).encode(), len(rows)


def time_map(raw, base, line, runs):
    """{"parse": its JSON parsed alone, "resolve": one position at `line` resolved} in ms."""
    samples = {"parse": [], "resolve": []}
    for _ in range(max(runs, 20)):
        started = time.perf_counter()
        json.loads(raw)
        samples["parse"].append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        found = pinbox.SourceMap(raw, base).original(line, 40)
        samples["resolve"].append((time.perf_counter() - started) * 1000)
        if not found:
            raise SystemExit("bench: the position did not resolve in %s" % base)
    return samples


def bench_index_map(runs):
    """An index map as Turbopack serves a chunk (200 modules, 2 MB in all): a position in
    its last module resolved, beside only parsing its JSON."""
    sections, line = [], 0
    for _ in range(200):
        raw, lines = synthetic_map(10 * 1024)
        sections.append({"offset": {"line": line, "column": 0}, "map": json.loads(raw)})
        line += lines + 3
    raw = json.dumps({"version": 3, "sources": [], "sections": sections}).encode()
    samples = time_map(raw, "http://127.0.0.1:3000/_next/static/chunks/app.js", line - 4, runs)
    return [dict(name="%d KB index map, 200 sections: its JSON parsed (floor)" % (len(raw) // 1024),
                 **summarize(samples["parse"])),
            dict(name="  a position in its last section resolved", **summarize(samples["resolve"]))]


def bench_place_element(runs, workdir):
    """Checking a line against the checkout, in a component file of 3,000 lines (400
    tags): at the line given, and when the line is wrong and the file is searched;
    beside only reading the file."""
    root = os.path.join(workdir, "place")
    make_repo(root, dict(os.environ))
    lines = ["export function Big() {", "  return (", "    <main>"]
    for n in range(400):
        lines += ['      <section className="card c%d">' % n, "        <h3>Card %d</h3>" % n,
                  '        <button id="b%d" className="primary">Buy %d</button>' % (n, n), "        {/* note */}",
                  "        <p>{t('price')}</p>", "        <span>{n}</span>", "      </section>"]
    lines += ["    </main>", "  )", "}"]
    os.makedirs(os.path.join(root, "src"))
    with open(os.path.join(root, "src", "Big.jsx"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    at = lines.index('        <button id="b300" className="primary">Buy 300</button>') + 1
    target = {"tag": "button", "selector": "#b300", "name": "Buy 300", "context": {"classes": ["primary"]}}
    samples = {"read": [], "given": [], "searched": []}
    for _ in range(max(runs, 20)):
        for name, line in (("read", None), ("given", at), ("searched", 5)):
            started = time.perf_counter()
            if name == "read":
                pinbox.file_lines(root, "src/Big.jsx")
            else:
                found = pinbox.locate_source(root, dict(target, source={"framework": "react", "file": "src/Big.jsx",
                                                                          "line": line}), lambda *a: None)
                if (found.get("line"), found.get("confidence")) != (at, "exact"):
                    raise SystemExit("bench: the line was not placed: %r" % found)
            samples[name].append((time.perf_counter() - started) * 1000)
    return [dict(name="3,000-line component: the file read (floor)", **summarize(samples["read"])),
            dict(name="  its line checked where given (and the file named)", **summarize(samples["given"])),
            dict(name="  a wrong line: the file searched, the one fit found", **summarize(samples["searched"]))]


# The shop's cart on React 19 and Vite, for the source timings: a pin names its title.
REACT_SHOP = {
    "vite.config.js": "import react from '@vitejs/plugin-react'\nexport default { plugins: [react()], "
                      "cacheDir: '.vite-cache', logLevel: 'warn', server: { hmr: false } }\n",
    "index.html": '<!doctype html><html><head><meta charset="utf-8"><title>Shop</title></head><body>'
                  '<div id="app"></div><script type="module" src="/src/main.jsx"></script></body></html>\n',
    "src/main.jsx": "import { createRoot } from 'react-dom/client'\nimport Cart from './components/Cart.jsx'\n"
                    "createRoot(document.getElementById('app')).render(<Cart />)\n",
    "src/components/Cart.jsx": "export default function Cart() {\n  return (\n    <section className=\"cart\">\n"
                               "      <h2 id=\"cart-title\">Cart</h2>\n      <button id=\"buy\">Buy now</button>\n"
                               "    </section>\n  )\n}\n"}


def bench_sources(runs, workdir):
    """How long a pin waits for its source on a warm dev server: the React 19 app of the
    tests on a real Vite (PINBOX_TEST_FRAMEWORKS, as .ci/run installs it), behind
    `pinbox open`; a pin whose element names a position in the served module (fetched,
    its inline map decoded, the line checked against the checkout), beside the same pin
    naming its file and line already. Each pin maps afresh: nothing is kept between."""
    import socket
    from urllib.request import urlopen
    modules = os.path.join(os.environ.get("PINBOX_TEST_FRAMEWORKS") or "", "fw-react19", "node_modules")
    if not os.path.exists(os.path.join(modules, ".bin", "vite")):
        print("bench: sources skipped: React 19 with Vite not installed (PINBOX_TEST_FRAMEWORKS)")
        return []
    env = bench_env(workdir)
    repo = project(workdir, "sources", env)
    for path, text in REACT_SHOP.items():
        os.makedirs(os.path.dirname(os.path.join(repo, path)), exist_ok=True)
        with open(os.path.join(repo, path), "w") as handle:
            handle.write(text)
    os.symlink(modules, os.path.join(repo, "node_modules"))
    with open(os.path.join(repo, ".gitignore"), "a") as handle:
        handle.write("node_modules\n.vite-cache/\n")
    for args in (["add", "-A"], ["commit", "-qm", "the app"]):
        subprocess.run(["git"] + args, cwd=repo, env=env, check=True)
    with socket.socket() as free:  # a port no one listens on, for Vite to take
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    vite = subprocess.Popen([os.path.join(modules, ".bin", "vite"), "--host", "127.0.0.1", "--port", str(port),
                             "--strictPort"], cwd=repo, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    old = dict(os.environ)
    os.environ.update(XDG_STATE_HOME=env["XDG_STATE_HOME"])
    proc, hub = start_hub(repo, env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urlopen("http://127.0.0.1:%d/" % port, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("bench: vite did not start")
                time.sleep(0.1)
        opened = subprocess.run([sys.executable, os.path.join(ROOT, "pinbox.py"), "open", "http://127.0.0.1:%d" % port,
                                 "--no-browser", "--json"], cwd=repo, env=env, check=True, stdout=subprocess.PIPE)
        proxy = json.loads(opened.stdout)["data"]["url"].rstrip("/")
        module = proxy + "/src/components/Cart.jsx"
        code = urlopen(module, timeout=10).read().decode()  # (the dev server warm: this module transformed)
        line = next(n for n, text in enumerate(code.split("\n"), 1) if '"cart-title"' in text)
        target = {"url": proxy + "/", "tag": "h2", "selector": "#cart-title", "name": "Cart"}
        framed = {"via": "framework", "framework": "react", "frame": {"url": module, "line": line, "column": 1}}
        title = next(n for n, text in enumerate(REACT_SHOP["src/components/Cart.jsx"].split("\n"), 1) if "cart-title" in text)
        given = {"via": "framework", "framework": "react", "file": "src/components/Cart.jsx", "line": title}
        samples = {"framed": [], "given": []}
        for i in range(max(runs, 20)):
            for name in sorted(samples, reverse=i % 2 == 1):
                body = {"text": "bench", "author": {"userId": "b"},
                        "target": dict(target, source=framed if name == "framed" else given)}
                started = time.perf_counter()
                status, data = call_hub(hub["port"], hub["token"], "POST", "/pins", body)
                samples[name].append((time.perf_counter() - started) * 1000)
                source = json.loads(data)["data"]["target"]["source"]
                if status != 201 or (source.get("line"), source.get("confidence")) != (title, "exact"):
                    raise SystemExit("bench: the pin's source was not found: %s %r" % (status, source))
        return [dict(name="pin naming its file and line (React 18's way)", **summarize(samples["given"])),
                dict(name="pin naming a position in the served module (React 19)", **summarize(samples["framed"]),
                     target_ms=1000)]
    finally:
        proc.terminate()
        proc.wait()
        os.killpg(vite.pid, 9)
        vite.wait()
        os.environ.clear()
        os.environ.update(old)


def bench_evidence(runs, workdir):
    """What evidence costs. A source map of 2 MB: one position near its end resolved
    (the map parsed and decoded up to that line), beside only parsing its JSON. And a
    shop page's load in headless Chromium with the early hook inline at the top of its
    <head>, beside the same page without it, load for load on one server."""
    raw, lines = synthetic_map(2 * 1024 * 1024)
    samples = time_map(raw, "http://127.0.0.1:5173/assets/app.js", lines - 1, runs)
    rows = [dict(name="2 MB source map: its JSON parsed (floor)", **summarize(samples["parse"])),
            dict(name="2 MB source map: a position near its end resolved", **summarize(samples["resolve"]))]
    rows += bench_index_map(runs) + bench_place_element(runs, workdir)
    binary = chromium_binary()
    if binary is None:
        print("bench: page load timings skipped: chromium not installed")
        return rows
    site = os.path.join(workdir, "site")
    os.makedirs(site)
    typical_page(site, {"port": 9, "token": "t"})  # (its toolbar tag points nowhere: only the hook is timed)
    with open(os.path.join(site, "index.html"), "rb") as handle:
        page = handle.read().replace(b"<script src='http://127.0.0.1:9/toolbar.js' data-token='t'></script>", b"")
    hooked = pinbox.early_hook(page, "http://127.0.0.1:9", None, False, "load_benchbench0")
    if hooked == page or b"pinbox early hook" not in hooked:
        raise SystemExit("bench: the early hook was not put in the page")
    for name, body in (("with.html", hooked), ("without.html", page)):
        with open(os.path.join(site, name), "wb") as handle:
            handle.write(body)
    app = subprocess.Popen([sys.executable, "-c", KEEP_ALIVE_SERVER], cwd=site, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
    port = int(app.stdout.readline())
    browser = Browser(binary, workdir)
    loaded = ("new Promise(r => { const done = () => setTimeout(() => { const t = performance.getEntriesByType("
              "'navigation')[0]; r(t.loadEventStart - t.startTime); }); if (document.readyState === 'complete') "
              "done(); else addEventListener('load', done); })")
    try:
        times = {"with.html": [], "without.html": []}
        for i in range(max(runs, 30)):
            for name in sorted(times, reverse=i % 2 == 1):  # each first in half the pairs
                browser.open("http://127.0.0.1:%d/%s" % (port, name))
                times[name].append(browser.evaluate(loaded))
        browser.open("http://127.0.0.1:%d/with.html" % port)
        if not browser.evaluate("!!window.__pinboxEvidence"):
            raise SystemExit("bench: the early hook did not run")
        added = [a - b for a, b in zip(times["with.html"], times["without.html"])]
        rows += [dict(name="shop page load, no early hook", **summarize(times["without.html"])),
                 dict(name="shop page load, early hook inline in <head>", **summarize(times["with.html"])),
                 dict(name="  added by the early hook (paired)", **summarize(added), target_ms=2)]
        return rows
    finally:
        browser.close()
        app.terminate()
        app.wait()


BENCHMARKS = {"forms": bench_forms, "hooks": bench_hooks, "flood": bench_flood, "commit": bench_commit, "cli": bench_cli, "hub": bench_hub,
              "delivery": bench_delivery, "inbox": bench_inbox, "proxy": bench_proxy, "toolbar": bench_toolbar,
              "mcp": bench_mcp, "sync": bench_sync, "evidence": bench_evidence, "sources": bench_sources}


def format_row(row):
    if "ratio" in row:
        return "%-58s %10.2f %21s  < %.1f %s" % (row["name"], row["ratio"], "", row["target_ratio"],
                                                 "met" if row["ratio"] < row["target_ratio"] else "MISSED")
    if "bytes" in row:
        return "%-58s %21s" % (row["name"], "%d bytes" % row["bytes"] + (", %d gzipped" % row["gzip_bytes"]
                                                                          if "gzip_bytes" in row else ""))
    if "per_second" in row:
        target = ""
        if row.get("target_per_second"):
            target = ">= %d/s %s" % (row["target_per_second"], "met" if row["per_second"] >= row["target_per_second"]
                                     else "MISSED")
        return "%-58s %21s %9s  %s" % (row["name"], "%d/s, %d errors" % (row["per_second"], row["errors"]), "", target)
    target = ""
    if "target_ms" in row:
        target = "< %s ms %s" % (row["target_ms"], "met" if row["median_ms"] < row["target_ms"] else "MISSED")
    if "target_over_floor_ms" in row:
        target = "floor + %.1f ms (target < %d) %s" % (row["over_floor_ms"], row["target_over_floor_ms"],
                                                       "met" if row["over_floor_ms"] < row["target_over_floor_ms"]
                                                       else "MISSED")
    if "over_floor_ms" in row and not target:
        target = "floor + %.1f ms" % row["over_floor_ms"]
    rss = "%d MiB" % (row["rss_kib"] // 1024) if "rss_kib" in row else ""
    return "%-58s %10.2f %10.2f %9s  %s" % (row["name"], row["median_ms"], row["p90_ms"], rss, target)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="repetitions per measurement (default 30)")
    parser.add_argument("--only", help="comma-separated benchmark names: " + ", ".join(BENCHMARKS))
    parser.add_argument("--json", default=os.path.join(HERE, "results", "latest.json"), help="where to write JSON")
    parser.add_argument("--baseline", metavar="pinbox.py", help="an older pinbox.py whose hooks run beside these")
    args = parser.parse_args()
    global BASELINE
    BASELINE = args.baseline and os.path.abspath(args.baseline)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    rows = []
    print("%-58s %10s %10s %9s  %s" % ("measurement", "median ms", "p90 ms", "peak RSS", "target"), flush=True)
    for name in names:
        workdir = tempfile.mkdtemp(prefix="pinbox-bench-")
        try:
            for row in BENCHMARKS[name](args.runs, workdir):
                rows.append(dict(row, group=name))
                print(format_row(row), flush=True)
        finally:
            shutil.rmtree(workdir, True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"python": sys.version.split()[0], "pinbox": pinbox.VERSION, "cores": os.cpu_count(),
                   "rows": rows}, handle, indent=2)
    print("written: %s" % os.path.relpath(args.json))


if __name__ == "__main__":
    main()
