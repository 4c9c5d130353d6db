"""The program that runs a completion's code on test inputs inside the sandbox (rewards/code.py).

grpo_jax/rewards/code.py passes this file's text to `sandbox.run_python`, with the job in the
working directory as job.json:

    {"mode": "stdin" | "call", "program": module text (code.py's prelude and the completion's
     code, rewritten for "stdin"), "fn_name": str | None, "solution_class": bool,
     "inputs": [str, ...], "timeout_s": int}

It rebuilds the environment verl 0.9.1's prime_code `testing_util.run_test` gives the code (its
reliability guard, the stdin stand-ins, stdout captured in memory, an alarm per step whose
default action ends the process), runs the tests in order in one module, and stops after the
first test that raises. It reports JSON lines on the stdout it started with (fd 1 itself then
points at /dev/null, as the stdout of verl's child process is):

    {"compile_error": {"error": repr, "traceback": str}}   the module did not build
    {"method_error": {"error": repr, "traceback": str}}    call mode: no such function
    {"test": i, "stdout": str}                             stdin mode: what test i printed
    {"test": i, "value": tagged, "json": str}              call mode: test i's return value
    {"test": i, "error": repr, "traceback": str}           test i raised
    {"done": true}

It never sees the expected outputs: code.py compares them, so the code under test cannot fake
a pass, only produce the output. A process killed mid-run (alarm, segfault, the sandbox's
limits) reports no "done", which code.py reads as verl's lost run. Only the standard library is
used: the sandbox's interpreter runs without site-packages.
"""

import builtins
import io
import json
import os
import signal
import sys
import traceback
import types
from unittest import mock  # before the guard below hides subprocess (asyncio imports it)

# verl's reliability_guard: what it sets to None before running the code (not a security
# boundary, the sandbox is; kept because it changes what a program does, e.g. exit() raises).
_GUARDED = {
    builtins: ("exit", "quit", "help"),
    os: (
        "kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork",
        "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod",
        "fchown", "chmod", "chown", "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir",
    ),
}  # fmt: skip
_GUARDED_SHUTIL = ("rmtree", "move", "chown")
_HIDDEN_MODULES = ("ipdb", "joblib", "resource", "psutil", "tkinter", "subprocess", "ctypes")


def _guard():
    import shutil
    import subprocess

    os.environ["OMP_NUM_THREADS"] = "1"
    for module, names in _GUARDED.items():
        for name in names:
            setattr(module, name, None)
    for name in _GUARDED_SHUTIL:
        setattr(shutil, name, None)
    subprocess.Popen = None
    for name in _HIDDEN_MODULES:
        sys.modules[name] = None


def _error(exc) -> dict:
    return {"error": repr(exc), "traceback": traceback.format_exc()}


def _tagged(value):
    """A JSON-able value with tuples, lists and dicts kept apart (code.py rebuilds it).

    Subclasses of the JSON types become their base type: equality is compared outside.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, tuple):
        return ["T", [_tagged(v) for v in tuple.__iter__(value)]]
    if isinstance(value, list):
        return ["L", [_tagged(v) for v in list.__iter__(value)]]
    if isinstance(value, dict):
        return ["D", [[_tagged(k), _tagged(v)] for k, v in dict.items(value)]]
    raise TypeError(f"cannot tag a {type(value).__name__}")  # json.dumps accepted it: a bug


def _run_with_stdin(function, text: str) -> str:
    """Calls `function` with the test input as stdin; returns what it printed.

    verl's stand-ins: sys.stdin becomes a StringIO of the input, while the stdin object the
    module saw first (bound to the names `stdin` of its prelude) answers read, readlines and
    readline (lines without their newline) from the input; open() is a mock_open of it; print
    goes to a StringIO; SystemExit ends the program normally.
    """
    lines = iter(text.split("\n"))
    first_stdin = sys.stdin
    captured = io.StringIO()
    saved_stdout, sys.stdout = sys.stdout, captured
    patches = [
        mock.patch.object(first_stdin, "read", lambda *a: text),
        mock.patch.object(first_stdin, "readlines", lambda *a: text.split("\n")),
        mock.patch.object(first_stdin, "readline", lambda *a: next(lines)),
        mock.patch("sys.stdin", io.StringIO(text)),
        mock.patch("builtins.open", mock.mock_open(read_data=text)),
    ]
    try:
        for patch in patches:
            patch.start()
        try:
            function()
        except SystemExit:
            pass
    finally:
        for patch in reversed(patches):
            patch.stop()
        sys.stdout = saved_stdout
    return captured.getvalue()


def _call_args(text: str) -> list:
    # One JSON value per line. A JSON object's keys become ints when they all are (verl keeps
    # only that first argument then).
    args = [json.loads(line) for line in text.split("\n")]
    if isinstance(args[0], dict):
        try:
            args = [{int(k): v for k, v in args[0].items()}]
        except ValueError:
            pass
    return args


def main() -> None:
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    report = os.fdopen(os.dup(1), "w", encoding="utf-8")
    sink = os.open(os.devnull, os.O_RDWR)
    for fd in (1, 2):
        os.dup2(sink, fd)
    sys.stdout = sys.stderr = open(os.devnull, "w")

    def emit(**event):
        report.write(json.dumps(event) + "\n")
        report.flush()

    _guard()
    timeout_s = job["timeout_s"]
    signal.alarm(timeout_s)
    try:
        module = types.ModuleType("tmp_sol")
        exec(compile(job["program"], "<string>", "exec"), module.__dict__)
        sys.modules["tmp_sol"] = module
    except Exception as e:  # noqa: BLE001 - the code's own error, reported as verl's -2
        signal.alarm(0)
        emit(compile_error=_error(e))
        emit(done=True)
        return
    signal.alarm(0)
    if job["mode"] == "stdin":
        function = module.code
    else:
        try:
            target = module.Solution() if job["solution_class"] else module
            function = getattr(target, job["fn_name"])
        except Exception as e:  # noqa: BLE001 - reported as verl's -2
            emit(method_error={"error": repr(sys.exc_info()), "traceback": _error(e)["traceback"]})
            emit(done=True)
            return
    for i, text in enumerate(job["inputs"]):
        args = _call_args(text) if job["mode"] == "call" else None
        signal.alarm(timeout_s)
        try:
            if args is None:
                event = {"stdout": _run_with_stdin(function, text)}
            else:
                value = function(*args)
                event = {"json": json.dumps(value), "value": _tagged(value)}
        except Exception as e:  # noqa: BLE001 - verl's -1: a runtime error ends the run
            signal.alarm(0)
            emit(test=i, **_error(e))
            break
        signal.alarm(0)
        emit(test=i, **event)
    emit(done=True)


if __name__ == "__main__":
    main()
