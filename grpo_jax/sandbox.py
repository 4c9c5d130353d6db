"""Runs untrusted Python (model-written code) so that it can neither hang nor harm the trainer.

    result = sandbox.run_python("print(input()[::-1])", stdin="abc")  # Result(status="ok", ...)

Used by the code-interpreter tool and code-execution rewards (verl sends this code to its
remote sandbox_fusion service; grpo_jax runs it on the trainer's host, so the host must be
protected here). Each run is a fresh interpreter (`python -I -S`: isolated mode, no site
packages, no PYTHON* variables), started in a fresh temporary directory (cwd, HOME and TMPDIR)
with only PATH, LANG, HOME and TMPDIR in its environment, in its own session, under resource
limits (`Limits`), with stdout and stderr read concurrently and capped. The directory is removed
afterwards. Nothing the code does raises here: it comes back as a `Result` whose status says how
it ended.

How the run is launched (`isolation()` says which plan this host allows; tried once, strongest
first, each plan checked by running `pass` under it):
  * root with util-linux `unshare` (the strong plan): `unshare --net --pid --ipc --fork
    --mount-proc --kill-child` starts this file as a small init (pid 1 of the new namespaces).
    The init forks the code, which drops to a fresh unprivileged uid/gid, never used by any
    other run, with no supplementary groups and PR_SET_NO_NEW_PRIVS (setuid binaries cannot
    give root back), then execs the interpreter. What holds:
      - network: a new network namespace has only a loopback that is down; connect() to any
        address, the host's 127.0.0.1 included, fails.
      - processes: RLIMIT_NPROC is not enforced for uid 0, and for any other uid it counts all
        of that uid's processes; a uid of its own makes it count this run's processes alone, so
        a fork bomb stops at `max_processes`.
      - killing: when the init exits (the code ended, or the trainer killed it), the kernel
        kills every process in the PID namespace, daemons and setsid() escapees too. The
        trainer is outside the namespace (invisible, and of another uid), so the code can signal
        neither the trainer nor the init (os.getppid() is the root-owned init: EPERM).
      - files: the code's uid owns only its directory. The directories it could not reach
        (e.g. /root, mode 0700, holding the interpreter) are covered by a tmpfs in the private
        mount namespace, with only the interpreter's prefix and the run directory bound back, so
        it neither reads nor writes the trainer's HOME. /tmp, /var/tmp and /dev/shm (world
        writable) are covered by a private tmpfs of `file_size_bytes`, gone with the run. It
        still reads what any user may read (/etc, world-readable sources) and writes any other
        world-writable directory.
      - SysV IPC objects (shared memory outlives processes) die with the IPC namespace.
  * root without namespaces: the fresh uid (when others can reach the interpreter), so the
    process limit, file permissions and the no-signals-to-the-trainer hold; no network
    isolation; processes are killed by process group and then by uid.
  * not root: `unshare --user --map-root-user --net --pid --ipc --fork --mount-proc` where
    unprivileged user namespaces are allowed (network and PID isolation; RLIMIT_NPROC counts
    the processes of the new user namespace, so the process limit holds), else a plain
    subprocess: RLIMIT_NPROC then counts every process of the user, so it is set to the user's
    current thread count plus `max_processes` (a bound, shared with anything else the user
    starts); no network isolation; the code runs as the trainer's uid and can signal it
    (POSIX lets a process signal any process of its uid; only a PID namespace hides the
    trainer) and write wherever the trainer can; a process that calls setsid() escapes the
    process-group kill. The non-root plans are not exercised by tests/test_sandbox.py (run as
    root).

What no plan bounds: the number of files in the run directory (each is capped at
`file_size_bytes`; the directory is removed after the run); total CPU across the code's
processes (each has `cpu_seconds`; `wall_seconds` bounds them all); memory as a sum (RLIMIT_AS
is per process, so up to `max_processes` x `memory_bytes`). A trainer killed mid-run leaves its
temporary directory; its sandboxes kill themselves (the init's alarm) a few seconds after
`wall_seconds`.

The limits are set by the init after fork, not in a `preexec_fn`: Python documents preexec_fn
as unsafe in a threaded parent (the child can deadlock before exec), and the trainer runs JAX's
threads.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

_log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "killed", "output_limit")

# The fresh uids (and gids) runs take when the trainer is root: above the ranges distributions
# and container runtimes hand out (< 2^31). A collision would only share the process count.
_UID_LOW, _UID_HIGH = 3_000_000_000, 4_000_000_000
# Code longer than this goes to a file rather than `-c` (Linux caps one argument at 128 KiB).
_MAX_ARG_BYTES = 100_000
# How long the init lets the code outlive `wall_seconds` when nobody kills it (the trainer died).
_ORPHAN_GRACE_S = 5
# After the code's main process ends: how long to go on reading what its pipes still hold.
_DRAIN_S = 0.5
_PATH = "/usr/local/bin:/usr/bin:/bin"
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# <linux/mount.h>, <linux/prctl.h>
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 2, 4, 4096, 16384
_PR_SET_NO_NEW_PRIVS = 38
_PLAN_LOCK = threading.Lock()


class SandboxError(RuntimeError):
    """The sandbox itself could not run the code (never raised for what the code does)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on one run. The defaults suit short model-written snippets on a shared host.

    Attributes:
      cpu_seconds: RLIMIT_CPU of each process, in whole seconds (10): a busy loop dies (SIGXCPU)
        after this much CPU; the rlimit is integral.
      wall_seconds: the whole run, from start to the last process killed (15): catches sleeps,
        blocking reads and processes waiting on each other, which use no CPU. A bit above
        cpu_seconds, so a CPU-bound program reports the CPU limit; it includes the sandbox's
        start-up (two interpreter starts, ~0.1 s in all).
      memory_bytes: RLIMIT_AS, address space of each process (1 GiB): a Python allocation past
        it raises MemoryError. Address space, not resident memory, as RLIMIT_RSS is not
        enforced by Linux; 1 GiB leaves room for numeric work in pure Python and keeps 8
        parallel runs within a few GiB.
      file_size_bytes: RLIMIT_FSIZE, the largest file a process may write (16 MiB), also the
        size of each private /tmp, /var/tmp and /dev/shm.
      max_processes: RLIMIT_NPROC (64), processes and threads together, the code's main
        process included; ThreadPoolExecutor's default of min(32, cpus + 4) workers fits.
      max_output_bytes: stdout and stderr are each kept up to this many bytes (1 MiB); past it
        the run is killed ("output_limit") so a print loop cannot fill the trainer's memory.
    """

    cpu_seconds: int = 10
    wall_seconds: float = 15.0
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    max_processes: int = 64
    max_output_bytes: int = 1 << 20

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if not value > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {value}")
        if not isinstance(self.cpu_seconds, int):
            raise ValueError("Limits.cpu_seconds must be an int (RLIMIT_CPU is in whole seconds)")


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What the launch plan chosen for this host holds (module docstring for each plan).

    Attributes:
      network: the code runs in a network namespace of its own (no usable interface).
      pid_namespace: in a PID namespace of its own: it sees only its own processes, cannot
        signal the trainer, and all of them die with the run.
      own_uid: runs as a fresh unprivileged uid (the trainer is root).
      process_limit: `max_processes` counts this run's processes alone (else a shared bound).
      launcher: the command the init runs under ((), when none).
    """

    network: bool
    pid_namespace: bool
    own_uid: bool
    process_limit: bool
    launcher: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Result:
    """How one run ended.

    Attributes:
      status: one of STATUSES: "ok" (exit 0), "error" (non-zero exit, e.g. an uncaught
        exception), "timeout" (wall_seconds, or cpu_seconds: SIGXCPU), "memory" (non-zero exit
        whose last stderr line starts with "MemoryError", which the address-space limit
        raises), "killed" (ended by another signal),
        "output_limit" (stdout or stderr passed max_output_bytes and the run was killed).
      exit_code: the exit status, or None when a signal ended the run.
      stdout, stderr: decoded as UTF-8 (invalid bytes replaced); when cut at max_output_bytes
        they end with TRUNCATED_MARKER.
      wall_seconds: from launch until the last process was gone.
      signal: the signal that ended the main process (SIGKILL when the sandbox killed the run).
      cpu_seconds: user + system CPU of the code's main process and the children it reaped (None
        when the sandbox killed it).
      network_isolated: whether the code ran without network (`Isolation.network`).
    """

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    signal: int | None = None
    cpu_seconds: float | None = None
    network_isolated: bool = False


TRUNCATED_MARKER = "\n[output truncated]"


def isolation() -> Isolation:
    """The strongest launch plan that runs here; probed on first use, then cached."""
    with _PLAN_LOCK:  # parallel first runs probe once
        return _plan()


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: Limits = Limits(),
    files: dict[str, str] | None = None,
) -> Result:
    """Runs `code` as `python -c code` in a fresh sandbox; thread-safe, runs go in parallel.

    Args:
      code: Python source, run as the main module.
      stdin: the code's standard input (then end of file).
      limits: resource bounds.
      files: relative path -> text, written (UTF-8) into the working directory first.

    Returns:
      The Result; what the code does never raises.

    Raises:
      ValueError: a `files` path that is absolute or leaves the working directory.
      SandboxError: the sandbox could not start the code (the host, not the code).
    """
    return _run(code, stdin=stdin, limits=limits, files=files or {}, plan=isolation())


# --- the trainer's side ---------------------------------------------------------------------


@functools.cache
def _plan() -> Isolation:
    root = os.geteuid() == 0
    unshare = shutil.which("unshare", path=_PATH + ":/usr/sbin:/sbin")
    ns_flags = ("--net", "--pid", "--ipc", "--fork", "--mount-proc", "--kill-child")
    candidates = []
    if unshare and root:
        candidates.append(Isolation(True, True, True, True, (unshare, *ns_flags)))
    if unshare and not root:
        userns = (unshare, "--user", "--map-root-user", *ns_flags)
        candidates.append(Isolation(True, True, False, True, userns))
    if root and all(_others_can_reach(p) for p in _interpreter_paths()):
        candidates.append(Isolation(False, False, True, True))
    candidates.append(Isolation(False, False, False, False))
    for plan in candidates:
        probe = _run("pass", stdin="", limits=Limits(), files={}, plan=plan, probing=True)
        if probe.status == "ok":
            if plan is not candidates[0]:
                _log.warning("sandbox: the stronger plans failed here; running under %s", plan)
            return plan
        _log.info("sandbox: plan %s does not run here: %s", plan, probe.stderr.strip()[-500:])
    raise SandboxError(f"no sandbox plan runs on this host: {probe.stderr.strip()[-2000:]}")


def _run(code, *, stdin, limits, files, plan, probing=False) -> Result:
    start = time.monotonic()
    rundir = tempfile.mkdtemp(prefix="grpo_jax_sandbox_")
    uid = random.SystemRandom().randrange(_UID_LOW, _UID_HIGH) if plan.own_uid else None
    proc = status_r = None
    try:
        workdir = os.path.join(rundir, "work")
        os.mkdir(workdir, 0o700)
        _write_files(workdir, files)
        exe = os.path.realpath(sys.executable)
        if len(code.encode()) <= _MAX_ARG_BYTES:
            argv = [exe, "-I", "-S", "-c", code]
        else:
            argv = [exe, "-I", "-S", os.path.join(rundir, "main.py")]
            with open(argv[-1], "w", encoding="utf-8") as f:
                f.write(code)
            os.chmod(argv[-1], 0o644)
        if uid is not None:
            os.chmod(rundir, 0o711)  # the code's uid may pass through, not list
            for dirpath, _, filenames in os.walk(workdir):
                for name in [dirpath, *(os.path.join(dirpath, n) for n in filenames)]:
                    os.chown(name, uid, uid)
        env = {"PATH": _PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        status_r, status_w = os.pipe()
        config = {
            "argv": argv,
            "env": env,
            "uid": uid,
            "status_fd": status_w,
            "rlimits": _rlimits(limits, plan),
            "alarm_s": math.ceil(limits.wall_seconds) + _ORPHAN_GRACE_S,
            "pid_namespace": plan.pid_namespace,
            "mounts": _mounts(rundir, limits) if plan.own_uid and plan.pid_namespace else None,
        }
        config_path = os.path.join(rundir, "init.json")
        with open(os.open(config_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            json.dump(config, f)
        try:
            proc = subprocess.Popen(
                [*plan.launcher, exe, "-I", "-S", os.path.abspath(__file__), config_path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                pass_fds=(status_w,),
                start_new_session=True,
            )
        finally:
            os.close(status_w)
        out, err, report, killed_by = _communicate(proc, status_r, stdin.encode(), limits, start)
        if killed_by is None and report is None and proc.poll() is None:
            killed_by = "timeout"  # the pipes closed, yet it did not exit
    finally:
        if proc is not None:
            _kill(proc, uid)
            for f in (proc.stdin, proc.stdout, proc.stderr):
                f.close()
        if status_r is not None:
            os.close(status_r)
        shutil.rmtree(rundir, ignore_errors=True)
    if report is not None and "error" in report:
        if probing:
            return Result("error", None, "", report["error"], 0.0)
        raise SandboxError(f"the sandbox could not start the code: {report['error']}")
    if probing and report is None:
        return Result("error", None, "", err.decode(errors="replace"), 0.0)
    return _result(out, err, report, killed_by, proc.returncode, limits, plan, start)


def _result(out, err, report, killed_by, returncode, limits, plan, start) -> Result:
    exit_code = sig = cpu = None
    if killed_by is not None:
        status, sig = killed_by, signal.SIGKILL
    elif report is None:
        # The init ended without a word: killed from outside the sandbox (or, without a PID
        # namespace, by the code: same uid). unshare re-raises its child's signal.
        status, sig = "killed", (-returncode if returncode < 0 else None)
        exit_code = None if returncode < 0 else returncode
    else:
        wait_status, cpu = report["wait_status"], report["cpu_seconds"]
        if os.WIFSIGNALED(wait_status):
            sig = os.WTERMSIG(wait_status)
            over_cpu = sig == signal.SIGXCPU or (
                sig == signal.SIGKILL and cpu >= limits.cpu_seconds
            )
            status = "timeout" if over_cpu else "killed"
        else:
            exit_code = os.waitstatus_to_exitcode(wait_status)
            if exit_code == 0:
                status = "ok"
            elif _last_line(err).startswith(b"MemoryError"):
                status = "memory"
            else:
                status = "error"
    return Result(
        status=status,
        exit_code=exit_code,
        stdout=_decode(out, limits.max_output_bytes),
        stderr=_decode(err, limits.max_output_bytes),
        wall_seconds=time.monotonic() - start,
        signal=None if sig is None else int(sig),
        cpu_seconds=cpu,
        network_isolated=plan.network,
    )


def _communicate(proc, status_r, stdin_bytes, limits, start):
    """Feeds stdin and reads stdout, stderr and the init's report, all at once, under the caps.

    Returns (stdout bytes, stderr bytes, report dict or None, "timeout"/"output_limit"/None).
    """
    cap = limits.max_output_bytes
    deadline = start + limits.wall_seconds
    chunks = {proc.stdout.fileno(): [], proc.stderr.fileno(): [], status_r: []}
    sizes = dict.fromkeys(chunks, 0)
    killed_by = None
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    if stdin_bytes:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sent = 0
    try:
        while sel.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                if status_r in sel.get_map():  # still running, not just draining
                    killed_by = "timeout"
                break
            for key, _ in sel.select(timeout):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        sent += os.write(fd, stdin_bytes[sent : sent + 65536])
                    except (BlockingIOError, InterruptedError):
                        continue
                    except BrokenPipeError:  # the code stopped reading: its business
                        sent = len(stdin_bytes)
                    if sent >= len(stdin_bytes):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    if fd == status_r:  # the main process ended: drain briefly, then done
                        deadline = min(deadline, time.monotonic() + _DRAIN_S)
                    continue
                if fd != status_r:
                    data = data[: cap + 1 - sizes[fd]]
                chunks[fd].append(data)
                sizes[fd] += len(data)
                if fd != status_r and sizes[fd] > cap:
                    killed_by = "output_limit"
                    break
            if killed_by is not None:
                break
    finally:
        sel.close()
    report = None
    if chunks[status_r]:
        try:
            report = json.loads(b"".join(chunks[status_r]))
        except ValueError:
            report = None  # only the code itself could have garbled it (same uid): no word
    out, err = (b"".join(chunks[f.fileno()]) for f in (proc.stdout, proc.stderr))
    return out, err, report, killed_by


def _kill(proc, uid):
    """Kills the launcher's process group, then (when the run had its own uid) the uid's processes.

    With a PID namespace, killing the init (in the group) makes the kernel kill the rest.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    # SIGKILL is delivered, not yet acted on: the group's other members (a fork the code made,
    # reparented once the launcher went) may run for a moment more. Return once they are gone.
    for _ in range(200):
        if not _pids_in_group(proc.pid):
            break
        time.sleep(0.01)
    else:
        _log.warning("sandbox: processes of group %d still alive after the run", proc.pid)
    if uid is None:
        return
    for _ in range(200):
        pids = _pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    _log.warning("sandbox: processes of uid %d still alive after the run: %s", uid, pids)


def _live_pids(matches) -> list[int]:
    """Live (not zombie) processes for which `matches(pid)` holds, from /proc (`matches` reads
    what it needs; a process that went while it read is skipped)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if matches(name):
                pids.append(int(name))
        except (OSError, KeyError, ValueError):
            continue
    return pids


def _pids_of_uid(uid) -> list[int]:
    """Live processes whose real uid is `uid`."""

    def matches(pid):
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["Uid"].split()[0]) == uid and fields["State"].strip()[:1] != "Z"

    return _live_pids(matches)


def _pids_in_group(pgid) -> list[int]:
    """Live processes in process group `pgid`."""

    def matches(pid):
        with open(f"/proc/{pid}/stat") as f:
            state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        return int(pgrp) == pgid and state != "Z"

    return _live_pids(matches)


def _rlimits(limits: Limits, plan: Isolation) -> dict[str, list[int]]:
    # soft < hard for CPU: SIGXCPU at the soft limit (Python does not catch it, so the process
    # ends with it and the status says so), SIGKILL a second later if the code ignores it.
    rlimits = {
        "RLIMIT_CPU": [limits.cpu_seconds, limits.cpu_seconds + 1],
        "RLIMIT_AS": [limits.memory_bytes] * 2,
        "RLIMIT_FSIZE": [limits.file_size_bytes] * 2,
        "RLIMIT_CORE": [0, 0],
    }
    if plan.process_limit:
        # With a user namespace (not root) the init counts too, in the namespace's count.
        extra = 1 if plan.launcher and not plan.own_uid else 0
        rlimits["RLIMIT_NPROC"] = [limits.max_processes + extra] * 2
    elif os.geteuid() != 0:
        # Shared count: every thread of this user, this trainer's included.
        rlimits["RLIMIT_NPROC"] = [_threads_of_uid(os.getuid()) + limits.max_processes] * 2
    return rlimits


def _threads_of_uid(uid) -> int:
    total = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def _mounts(rundir, limits) -> dict[str, list]:
    """The mount namespace's plan: which directories to cover with a tmpfs, which to bind back.

    Covered: the scratch directories (private, size-capped) and the topmost directory on the
    way to the interpreter or the run directory that others cannot search (/root, 0700).
    Kept: the interpreter's prefixes and the run directory, bound back at their own paths.
    """
    keep = sorted({os.path.realpath(p) for p in [*_interpreter_paths(), rundir]})
    keep = [p for p in keep if not any(_inside(p, q) for q in keep)]
    covers = [[d, "mode=1777,size=%d" % limits.file_size_bytes] for d in _SCRATCH_DIRS]
    for path in keep:
        blocked = _first_blocked(path)
        if blocked is not None:
            covers.append([blocked, "mode=0755,size=1m"])
    covers = [c for c in covers if os.path.isdir(c[0]) and not os.path.islink(c[0])]
    # A cover inside another one would be hidden by it (or hide what is bound back into it).
    paths = [c[0] for c in covers]
    covers = [c for c in covers if not any(_inside(c[0], p) for p in paths if p != c[0])]
    covers = list({c[0]: c for c in covers}.values())
    return {"covers": covers, "keep": keep}


def _interpreter_paths() -> list[str]:
    exe = os.path.realpath(sys.executable)
    return [os.path.dirname(exe), sys.base_prefix, sys.base_exec_prefix]


def _first_blocked(path):
    """The topmost directory on `path` (itself included) that others may not search, or None."""
    current = "/"
    for part in os.path.realpath(path).strip("/").split("/"):
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def _others_can_reach(path) -> bool:
    return _first_blocked(path) is None


def _inside(path, parent) -> bool:
    return path.startswith(parent.rstrip("/") + "/")


def _write_files(workdir, files):
    for name, text in files.items():
        path = os.path.normpath(os.path.join(workdir, name))
        if os.path.isabs(name) or not _inside(path, workdir):
            raise ValueError(f"files: {name!r} must be a relative path inside the working dir")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _decode(data: bytes, cap: int) -> str:
    text = data[:cap].decode("utf-8", errors="replace")
    return text + TRUNCATED_MARKER if len(data) > cap else text


def _last_line(data: bytes) -> bytes:
    lines = data.rstrip().rsplit(b"\n", 1)
    return lines[-1] if lines else b""


# --- the init: this file run as a script, inside the sandbox ---------------------------------


def _init_main(config_path) -> int:
    """Sets up the sandbox (as pid 1 of its namespaces, or as a plain parent), runs the code,
    reaps, and reports how the code's main process ended on the status fd as JSON."""
    with open(config_path) as f:
        config = json.load(f)
    status_fd = config["status_fd"]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only the trainer (SIGKILL) or the alarm end it
    try:
        if config["mounts"] is not None:
            _init_mounts(**config["mounts"])
        pid = _init_spawn(config, status_fd)
    except OSError as e:
        os.write(status_fd, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return 125

    def orphaned(signum, frame):
        # Nobody killed us at wall_seconds: the trainer is gone. With a PID namespace, the
        # init's exit kills the rest; else the group goes, this process with it.
        if config["pid_namespace"]:
            os._exit(124)
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGALRM, orphaned)
    signal.alarm(config["alarm_s"])
    while True:  # as pid 1, orphans are ours to reap too
        reaped, wait_status, rusage = os.wait4(-1, 0)
        if reaped == pid:
            break
    cpu = rusage.ru_utime + rusage.ru_stime
    os.write(status_fd, json.dumps({"wait_status": wait_status, "cpu_seconds": cpu}).encode())
    return 0


def _init_spawn(config, status_fd) -> int:
    """Forks the code's process: limits, uid, no new privileges, exec. Returns its pid.

    Raises OSError when the child could not exec (it sends its error on a close-on-exec pipe).
    """
    import ctypes  # only the init needs these
    import resource

    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_r)
            os.close(status_fd)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            for name, (soft, hard) in config["rlimits"].items():
                resource.setrlimit(getattr(resource, name), (soft, hard))
            uid = config["uid"]
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            os.execve(config["argv"][0], config["argv"], config["env"])
        except BaseException as e:  # noqa: BLE001 - report anything, then never return
            os.write(err_w, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(127)
    os.close(err_w)
    with os.fdopen(err_r, "rb") as f:
        error = f.read()
    if error:
        os.waitpid(pid, 0)
        raise OSError(f"starting the code failed: {error.decode(errors='replace')}")
    return pid


def _init_mounts(covers, keep):
    """Covers directories with tmpfs and binds the kept paths back (mount namespace, as root)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, data):
        args = [None if a is None else a.encode() for a in (source, target, fstype)]
        if libc.mount(*args, flags, None if data is None else data.encode()) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")

    covered = [c for c, _ in covers]
    # O_PATH handles reach the kept trees after the covers hide their paths.
    handles = {p: os.open(p, os.O_PATH) for p in keep if any(_inside(p, c) for c in covered)}
    for target, options in covers:
        mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
    for path, fd in handles.items():
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC, None)
        os.close(fd)


if __name__ == "__main__":
    sys.exit(_init_main(sys.argv[1]))
