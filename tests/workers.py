"""Multi-process tests: N real JAX processes on one machine, each answering through a file.

A worker's result travels as JSON in a file of its own (`sys.argv[1]`), never as a line of its
stdout: a library's log (Gloo's "Rank 0 is connected to 1 peer ranks", absl, XLA) can land in the
middle of a printed line when stdout and stderr share a pipe. Each worker's stdout and stderr go
to separate log files, shown only when the worker fails.

A worker script gets `argv = [script, result_path, process_id, port, *args]` and calls
`workers.answer(value)` (importable: the test directory is on its PYTHONPATH). Each worker has
`devices` CPU devices and the test process's other XLA flags (a CPU variant of
scripts/test_cpu_variants.sh reaches the workers too: all processes compile alike).

A run that outlives its timeout is a hang (processes waiting on each other's collectives): before
killing them, the harness asks every worker for the Python stack of each of its threads
(`faulthandler` on SIGUSR1, registered ahead of the script), and the failure shows them.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_REPO = _TESTS.parent
# Ahead of every worker script: SIGUSR1 writes each thread's stack to stderr (see the doc).
_PRELUDE = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def answer(value) -> None:
    """Writes the worker's result (JSON) to the file the test named; called once, at the end."""
    path = sys.argv[1]
    with open(path + ".tmp", "w") as f:
        # NumPy scalars (metrics) as Python numbers; anything else must already be JSON.
        json.dump(value, f, default=lambda x: x.item())
    os.replace(path + ".tmp", path)  # the test never reads half a file


def run(
    script: str,
    tmp_path: Path,
    *,
    num_processes: int = 2,
    devices: int = 2,
    args=(),
    timeout: float = 300,
):
    """Runs `script` as `num_processes` coordinated processes and returns their answers in
    process order. Raises AssertionError with each failed worker's logs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "worker.py"
    path.write_text(_PRELUDE + script)
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_REPO), str(_TESTS)]),
        "XLA_FLAGS": f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    port = str(free_port())
    procs, results = [], []
    for i in range(num_processes):
        result = tmp_path / f"result{i}.json"
        cmd = [sys.executable, str(path), str(result), str(i), port, *map(str, args)]
        # The child keeps its own descriptors of the two logs; the parent's close at once.
        with (
            open(tmp_path / f"stdout{i}.log", "w") as out,
            open(tmp_path / f"stderr{i}.log", "w") as err,
        ):
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env))
        results.append(result)
    failed, killed = [], False
    for i, p in enumerate(procs):
        try:
            code = p.wait(timeout=timeout)
            if killed and code == -signal.SIGKILL:
                code = "killed at another worker's timeout (its stacks at the end of stderr)"
        except subprocess.TimeoutExpired:
            killed = True
            for q in procs:  # where each one waits, then the kill
                if q.poll() is None:
                    q.send_signal(signal.SIGUSR1)
            time.sleep(3)
            for q in procs:
                q.kill()
            code = f"timeout after {timeout} s (stacks of every thread at the end of stderr)"
        if code != 0 or not results[i].exists():
            failed.append((i, code))
    if failed:
        report = []
        for i, code in failed:
            tails = [(tmp_path / f"{s}{i}.log").read_text()[-n:]
                     for s, n in (("stdout", 3000), ("stderr", 12000))]  # fmt: skip
            report.append(
                f"worker {i} ended with {code}:\n--- stdout\n{tails[0]}\n--- stderr\n{tails[1]}"
            )
        raise AssertionError("\n".join(report))
    return [json.loads(r.read_text()) for r in results]
