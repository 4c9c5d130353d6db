"""The hardware a plan is for: the memory of the accelerators `--device` names, the backend
each runs, and TPU slices compiled for ahead of time by libtpu on a machine without TPUs."""

import os

import jax

from grpo_jax import errors

GIB = 2**30

# Memory per device (bytes) of the accelerators --device names.
#   h200: NVIDIA's H200 datasheet, 141 GB of HBM3e per GPU (decimal GB: 131.3 GiB).
#   v5p: Cloud TPU's v5p page (cloud.google.com/tpu/docs/v5p), 95 GB of HBM2e per chip, taken
#     as 95 GiB. JAX sees one device per chip (its two TensorCores run as one megacore), so a
#     v5p-16 slice (16 TensorCores) is 8 devices on 2 hosts, a v5p-8 is 4 on one.
DEVICE_HBM = {"h200": 141 * 10**9, "v5p": 95 * GIB}
# The backend a --device runs: model.attention_impl="auto" is resolved for it (the planner
# itself compiles on CPU devices).
DEVICE_BACKEND = {"h200": "gpu", "v5p": "tpu"}


def compiles_natively(mesh, backend: str | None) -> bool:
    """The mesh's devices are of the planned backend itself (a `tpu_topology`'s TPUs), not CPU
    devices standing in for it."""
    return backend is not None and mesh.devices.flat[0].platform == backend


def tpu_topology(name: str) -> list:
    """The devices of TPU slice `name` (e.g. "v5p:2x2x2", a v5p-16: 8 chips), for compiling
    ahead of time with the TPU compiler on a machine without TPUs (libtpu's own compiler; no
    TPU is touched). Run with JAX_PLATFORMS=cpu, as plan.py does, so that JAX does not look for
    TPU hardware.

    Raises:
      errors.InputError: libtpu is not installed, or it does not know `name`.
    """
    from jax.experimental import topologies

    # libtpu's lockfile guards a TPU against two processes; nothing here runs on one, so
    # plans may compile side by side (and next to a job that holds the lock).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # noqa: BLE001 - libtpu missing, or a name it rejects
        raise errors.InputError(
            f"--tpu_topology={name!r}: cannot build that TPU slice ({type(e).__name__}: {e}). "
            f"It needs libtpu, the TPU compiler (pip install 'jax[tpu]=={jax.__version__}', or "
            "bash scripts/build_tpu_venv.sh for a venv of its own), and a name such as "
            "v5p:2x2x1 (v5p-8, 4 chips) or v5p:2x2x2 (v5p-16, 8 chips)"
        ) from e
