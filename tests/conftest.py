"""Test setup: 8 fake CPU devices, float32, and strict rank promotion before JAX is imported.

Also the reference implementations (tests/reference.py): the session's verl worker, the
`reference(name)` marker, and the end-of-run summary of what ran against what.
"""

import collections
import gc
import os
import platform
import sys

# Added to any XLA_FLAGS the run sets (the CPU variants of scripts/test_cpu_variants.sh), unless
# it names a device count itself.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import file_seconds  # noqa: E402
import reference  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "float32")
# One persistent compilation cache per test session: many tests build the same programs (the
# loop on the tiny model), and a cache hit loads the executable XLA compiled before instead of
# compiling it again (the same executable, so no result can change).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _CACHE = tempfile.mkdtemp(prefix="grpo_jax_test_jit_")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)



@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drops JAX's compiled programs.

    Every XLA:CPU executable maps its machine code into the process, a few memory regions
    each, for as long as a jit cache holds it. The whole suite's programs would pass the
    kernel's limit of mappings (vm.max_map_count, 65,530 by default): tests/test_sampler.py
    alone adds 15,000, and the process then died in native code, with no traceback (SIGSEGV
    or SIGABRT), at its next compile. Clearing the caches unmaps them; the persistent
    compilation cache above turns a later module's recompile of the same program into a load.
    """
    yield
    _PEAK_MAPPINGS[0] = max(_PEAK_MAPPINGS[0], _mappings())
    jax.clear_caches()
    gc.collect()


_PEAK_MAPPINGS = [0]  # the most memory mappings a test module left (the summary prints it)


def _mappings() -> int:
    """The process's memory mappings (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# What each reference marker means in the summary line.
_REFERENCE_TITLES = {
    "verl": "verl parity",
    "hf": "HF transformers parity",
    "vllm": "vLLM",
    "tpu": "TPU compiler (ahead of time, no TPU)",
    "trackers": "experiment trackers",
}


@pytest.fixture(scope="session")
def verl():
    """The verl 0.9.1 worker (tests/reference.py), in the venv of scripts/build_verl_venv.sh."""
    python = os.environ.get("GRPO_JAX_VERL_PYTHON", "")
    if not (python and os.access(python, os.X_OK)):
        reference.require(
            "verl",
            f"no verl venv interpreter (GRPO_JAX_VERL_PYTHON={python!r}); scripts/test.sh sets it "
            "from scripts/build_verl_venv.sh, whose log is ~/.cache/grpo_jax/verl-venv-*.build.log",
        )
    try:
        worker = reference.Worker(
            python,
            imports=("verl", "verl.trainer.ppo.core_algos", "verl.utils.torch_functional"),
        )
    except reference.WorkerError as e:
        reference.require("verl", f"verl does not import in {python}:\n{e}")
    reference.VERSIONS["verl"] = f"verl {worker.versions['verl']}, torch {worker.versions['torch']}"
    yield worker
    worker.close()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "reference(name): the test checks grpo_jax against reference `name` (tests using the "
        "`verl` fixture are marked 'verl' automatically)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Carries what the end-of-run summary needs on each report: under pytest-xdist the tests run
    in worker processes and the summary is printed by the controller, which sees only reports."""
    outcome = yield
    report = outcome.get_result()
    name = dict(report.user_properties).get("reference")
    if name and name in reference.VERSIONS:
        report.user_properties.append(("reference_version", reference.VERSIONS[name]))
    if call.when == "teardown":  # after the module fixture has measured the mappings
        report.user_properties.append(("peak_mappings", _PEAK_MAPPINGS[0]))


def pytest_collection_modifyitems(items):
    # The files longest first (tests/file_seconds.py: how the two workers' run ends); a file's
    # tests keep their order.
    key = file_seconds.longest_first(file_seconds.load())
    items.sort(key=lambda item: key(item.path.name))
    for item in items:
        marker = item.get_closest_marker("reference")
        name = marker.args[0] if marker else "verl" if "verl" in item.fixturenames else None
        if name:
            item.user_properties.append(("reference", name))


# The instruction sets that change XLA:CPU's kernels and reduction orders (tests/numerics.py).
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
              "amx_tile")  # fmt: skip


def machine_line() -> str:
    """The CPU the suite ran on, its vector ISA and the XLA flags: tolerances must hold on any."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = " ".join(x for x in _ISA_FLAGS if x in flags) or "unknown"
    xla = os.environ.get("XLA_FLAGS", "")
    return f"CPU: {model}, {os.cpu_count()} cores, ISA: {isa}; XLA_FLAGS={xla!r}"


def pytest_terminal_summary(terminalreporter):
    """One line per reference: how many of its tests passed, failed or were skipped; then the
    machine the suite ran on."""
    terminalreporter.section("reference implementations and machine")
    _reference_lines(terminalreporter)
    terminalreporter.write_line(machine_line())
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = f.read().strip()
    except OSError:
        limit = "unknown"
    peak = max([_PEAK_MAPPINGS[0]] + [
        value for reports in terminalreporter.stats.values() for report in reports
        for key, value in getattr(report, "user_properties", ()) if key == "peak_mappings"
    ])  # fmt: skip
    terminalreporter.write_line(
        f"memory mappings at a module's end: at most {peak} "
        f"(vm.max_map_count {limit}; conftest._release_compiled_programs)"
    )


def _reference_lines(terminalreporter):
    outcomes = collections.defaultdict(collections.Counter)
    versions = dict(reference.VERSIONS)
    for kind in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(kind, []):
            properties = dict(getattr(report, "user_properties", ()))
            name = properties.get("reference")
            if "reference_version" in properties:
                versions.setdefault(name, properties["reference_version"])
            # One count per test: its call, or the phase that decided it (setup skip or error).
            if name and (report.when == "call" or kind in ("skipped", "error")):
                outcomes[name][kind] += 1
    for name in sorted(outcomes):
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(outcomes[name].items()))
        version = versions.get(name, "not run")
        terminalreporter.write_line(f"{_REFERENCE_TITLES.get(name, name)}: {counts} ({version})")
