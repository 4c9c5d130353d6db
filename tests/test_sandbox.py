"""grpo_jax.sandbox: hostile code ends with a non-ok status (or harmlessly) within its limits,
while this process goes on and nothing outside the run's directory changes.

Limits are short (1-2 s) so the file runs in seconds; each time bound asserted leaves a wide
margin for a loaded 2-core machine. A test whose defence the host's plan lacks (no network
namespace, no process limit of the run's own) skips and says which `sandbox.isolation()` field
is missing. The fork bombs run only where `max_processes` counts the run's processes alone, and
are capped in their own code too, so they stay bounded on the shared machine whatever happens.
"""

import concurrent.futures
import os
import signal
import socket
import sys
import tempfile
import time
import uuid

import pytest

from grpo_jax import sandbox

SHORT = sandbox.Limits(cpu_seconds=1, wall_seconds=2.0, max_processes=16)


def _requires(field):
    plan = sandbox.isolation()
    if not getattr(plan, field):
        pytest.skip(f"this host's sandbox plan lacks Isolation.{field}: {plan}")


def _processes_with(marker) -> list[int]:
    """Pids of live processes whose command line contains `marker` (from /proc)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            pids.append(int(name))
    return pids


# --- normal code --------------------------------------------------------------------------------


def test_stdout_stdin_and_exit_code():
    r = sandbox.run_python("import sys; print(sys.stdin.read()[::-1], end='')", stdin="abc\n")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "\ncba", "")
    assert r.cpu_seconds is not None and r.wall_seconds < 5

    r = sandbox.run_python("import sys; print('out'); sys.exit(3)")
    assert (r.status, r.exit_code, r.stdout) == ("error", 3, "out\n")


def test_exception_goes_to_stderr():
    r = sandbox.run_python("x = 1\n1 / 0\n")
    assert (r.status, r.exit_code) == ("error", 1)
    assert 'File "<string>", line 2' in r.stderr and r.stderr.endswith(
        "ZeroDivisionError: division by zero\n"
    )


def test_files_and_working_directory():
    code = (
        "import os, sys\n"
        "print(open('data/in.txt').read())\n"
        "open('out.txt', 'w').write('x')\n"
        "print(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
        "print(sys.flags.isolated, sys.flags.no_site)\n"
        "print(sorted(os.environ))\n"
        "print(os.getcwd())\n"
    )
    r = sandbox.run_python(code, files={"data/in.txt": "héllo"})
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == ["héllo", "True", "1 1", "['HOME', 'LANG', 'PATH', 'TMPDIR']"]
    assert not os.path.exists(os.path.dirname(lines[4]))  # the run's directory is gone


def test_files_must_stay_inside():
    for name in ("../escape.txt", "/tmp/escape.txt", "a/../../escape.txt"):
        with pytest.raises(ValueError, match="inside the working dir"):
            sandbox.run_python("pass", files={name: "x"})


def test_long_code_runs_from_a_file():
    code = "x = 0\n" + "x += 1\n" * 30_000 + "print(x)\n"  # > 128 KiB, Linux's cap on one argument
    r = sandbox.run_python(code)
    assert (r.status, r.stdout) == ("ok", "30000\n"), r.stderr


def test_runs_go_in_parallel():
    # 8 sleeps of 0.5 s: one after another would take 4 s.
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = [f"import time; time.sleep(0.5); print({i})" for i in range(8)]
        results = list(pool.map(sandbox.run_python, codes))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
    assert time.monotonic() - start < 2.5


def test_weakest_plan_runs_code_and_enforces_time():
    # The plain-subprocess plan every host falls back to (no namespace, no uid of its own).
    plain = sandbox.Isolation(
        network=False, pid_namespace=False, own_uid=False, process_limit=False
    )

    def run(code, limits):
        return sandbox._run(code, stdin="x", limits=limits, files={}, plan=plain)

    r = run("print(input())", sandbox.Limits())
    assert (r.status, r.stdout, r.network_isolated) == ("ok", "x\n", False)
    start = time.monotonic()
    marker = uuid.uuid4().hex
    r = run(f"# {marker}\nimport os, time\nos.fork(); time.sleep(60)", SHORT)
    assert r.status == "timeout" and time.monotonic() - start < SHORT.wall_seconds + 3
    assert _processes_with(marker) == []  # the process group went


# --- time, memory, output -----------------------------------------------------------------------


def test_infinite_loop_hits_the_cpu_limit():
    limits = sandbox.Limits(cpu_seconds=1, wall_seconds=10.0)
    start = time.monotonic()
    r = sandbox.run_python("while True: pass", limits=limits)
    assert (r.status, r.signal) == ("timeout", signal.SIGXCPU)
    assert time.monotonic() - start < 5  # the CPU limit, not the 10 s wall limit


def test_sleeping_forever_hits_the_wall_limit():
    start = time.monotonic()
    r = sandbox.run_python(
        "import time; print('started', flush=True); time.sleep(1000)", limits=SHORT
    )
    assert (r.status, r.exit_code, r.stdout) == ("timeout", None, "started\n")
    assert time.monotonic() - start < SHORT.wall_seconds + 2


def test_memory_bomb():
    limits = sandbox.Limits(memory_bytes=256 << 20, wall_seconds=10.0)
    r = sandbox.run_python("x = bytearray(4 << 30)", limits=limits)
    assert r.status == "memory", r.stderr
    r = sandbox.run_python(
        "chunks = []\nwhile True: chunks.append(b'x' * (16 << 20))", limits=limits
    )
    assert r.status == "memory", r.stderr


def test_huge_output_is_cut():
    limits = sandbox.Limits(max_output_bytes=64 << 10, wall_seconds=10.0)
    for stream in ("sys.stdout", "sys.stderr"):
        start = time.monotonic()
        r = sandbox.run_python(
            f"import sys\nwhile True: {stream}.write('x' * 100_000)", limits=limits
        )
        text = r.stdout if stream == "sys.stdout" else r.stderr
        assert r.status == "output_limit"
        assert text == "x" * (64 << 10) + sandbox.TRUNCATED_MARKER
        assert time.monotonic() - start < 3


def test_writing_a_big_file_fails():
    limits = sandbox.Limits(file_size_bytes=1 << 20)
    r = sandbox.run_python("open('big', 'wb').write(b'x' * (2 << 20))", limits=limits)
    assert r.status == "error" and "File too large" in r.stderr


# --- processes ----------------------------------------------------------------------------------


def test_fork_bomb_is_bounded_and_leaves_nothing():
    _requires("process_limit")
    marker = uuid.uuid4().hex
    # Capped at 300 forks, so even an unbounded sandbox would not swamp the machine.
    code = f"""# {marker}
import os, time
forked = 0
for _ in range(300):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
print(forked, flush=True)
time.sleep(60)
"""
    start = time.monotonic()
    r = sandbox.run_python(code, limits=SHORT)
    assert r.status == "timeout"
    assert int(r.stdout) == SHORT.max_processes - 1  # the main process counts too
    assert time.monotonic() - start < SHORT.wall_seconds + 3
    assert _processes_with(marker) == []


def test_classic_fork_bomb():
    _requires("process_limit")
    marker = uuid.uuid4().hex
    # Every process forks forever; the process limit (16) is what bounds it.
    code = f"""# {marker}
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    start = time.monotonic()
    r = sandbox.run_python(code, limits=SHORT)
    assert r.status in ("timeout", "killed")
    assert time.monotonic() - start < SHORT.wall_seconds + 3
    assert _processes_with(marker) == []


def test_daemons_die_with_the_run():
    _requires("pid_namespace")
    marker = uuid.uuid4().hex
    # A double fork with setsid() leaves the process group: only the PID namespace catches it.
    code = f"""# {marker}
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print('parent done')
"""
    r = sandbox.run_python(code, limits=SHORT)
    assert (r.status, r.stdout) == ("ok", "parent done\n")
    assert r.wall_seconds < 1.5  # the daemon does not hold the run open
    assert _processes_with(marker) == []


def test_code_cannot_kill_its_parent_or_this_process():
    # Without a PID namespace a same-uid process can signal this one (POSIX permissions), so
    # only the namespace plan is asserted.
    _requires("pid_namespace")
    code = """
import os, signal
target = int(input())
for pid, sig in [(os.getppid(), signal.SIGKILL), (target, signal.SIGKILL), (-1, signal.SIGTERM)]:
    try:
        os.kill(pid, sig)
        print(pid, 'sent')
    except OSError as e:
        print(pid, type(e).__name__)
"""
    r = sandbox.run_python(code, stdin=f"{os.getpid()}\n", limits=SHORT)
    # os.getppid() is the sandbox's root-owned init; this pid does not exist in the namespace;
    # kill(-1) reaches only the code's own processes (here: none but itself, spared by Linux).
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].endswith("PermissionError")
    assert lines[1].endswith(("ProcessLookupError", "PermissionError"))
    r = sandbox.run_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert (r.status, r.signal, r.exit_code) == ("killed", signal.SIGKILL, None)
    # Still here.


# --- environment, files, network ----------------------------------------------------------------


def test_trainer_environment_is_invisible(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("GRPO_JAX_SANDBOX_SECRET", secret)
    code = """
import os
print(dict(os.environ))
for path in [f'/proc/{input()}/environ', '/proc/1/environ', '/proc/self/environ']:
    try:
        print(open(path, 'rb').read())
    except OSError as e:
        print(path, type(e).__name__)
"""
    r = sandbox.run_python(code, stdin=f"{os.getpid()}\n", limits=SHORT)
    assert r.status == "ok", r.stderr
    assert secret not in r.stdout and "GRPO_JAX_SANDBOX_SECRET" not in r.stdout


def test_home_and_scratch_directories_are_untouched():
    _requires("own_uid")
    home = os.path.expanduser("~")
    name = f"grpo_jax_sandbox_pwned_{uuid.uuid4().hex}"
    targets = [
        os.path.join(d, name) for d in (home, os.path.dirname(__file__), tempfile.gettempdir())
    ]
    code = f"""
import os
for path in {targets!r} + [os.path.join(os.path.expanduser('~'), 'mine')]:
    try:
        open(path, 'w').write('pwned')
        print(path, 'written')
    except OSError as e:
        print(path, type(e).__name__)
"""
    r = sandbox.run_python(code, limits=SHORT)
    assert r.status == "ok", r.stderr
    assert r.stdout.splitlines()[-1].endswith("mine written")  # its own HOME is writable
    for path in targets:
        assert not os.path.exists(path), path
    if sandbox.isolation().pid_namespace:
        # The real HOME is hidden, and the tmp directory written to is a private tmpfs.
        assert r.stdout.splitlines()[0].endswith(("PermissionError", "FileNotFoundError"))


def test_no_network():
    _requires("network")
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=1)
    print('connected')
except OSError as e:
    print(type(e).__name__)
"""
        r = sandbox.run_python(code, limits=SHORT)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody came
    assert r.status == "ok" and "connected" not in r.stdout, r.stdout
    assert r.network_isolated


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_seconds"):
        sandbox.Limits(wall_seconds=0)
    with pytest.raises(ValueError, match="whole seconds"):
        sandbox.Limits(cpu_seconds=1.5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
