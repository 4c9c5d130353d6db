r"""The memory planner's command line: will this GRPO config fit, and if not, what to change?

    python plan.py --config=configs/gsm8k.py --model=qwen2.5-7b --device=h200 --devices=8 \
        --config.model.dtype=bfloat16 --config.model.enable_gradient_checkpointing=True
    python plan.py --config=configs/gsm8k_qwen3_8b.py --model=qwen3-8b --device=h200 --devices=8
    python plan.py --config=configs/gsm8k_qwen3_8b.py:jax --model=qwen3-8b --device=v5p --devices=8
    python plan.py --config=configs/gsm8k_qwen3_8b.py:jax --model=qwen3-8b --device=v5p \
        --tpu_topology=v5p:2x2x2     # the TPU compiler itself (needs libtpu), no TPU needed
    python train.py --config=... --plan          # the same report, from the trainer

--device=h200|v5p sets the memory per device, --hbm_gib=G any other; --devices=N simulates N CPU
devices (set before JAX starts); --tpu_topology=NAME compiles for that TPU slice's chips with
libtpu's compiler instead (pip install 'jax[tpu]', or scripts/build_tpu_venv.sh). What it
compiles and how it advises: grpo_jax/planner/.
"""

import os
import sys


def _fake_device_count(argv) -> int:
    for arg in argv:
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 0


if __name__ == "__main__" and any(a.startswith("--tpu_topology=") for a in sys.argv):
    # Compile for TPUs without looking for one: libtpu's compiler runs under the CPU platform.
    os.environ["JAX_PLATFORMS"] = "cpu"
elif __name__ == "__main__" and _fake_device_count(sys.argv):
    # Must happen before JAX initialises its backends (the reason for this module-level code).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={_fake_device_count(sys.argv)}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from grpo_jax import cli, planner  # noqa: E402
from grpo_jax import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "train.py config file.")
_MODEL = flags.DEFINE_string("model", "", f"model preset: {', '.join(planner.PRESETS)}")
_DEVICE = flags.DEFINE_enum(
    "device", None, sorted(planner.DEVICE_HBM), "accelerator: its memory per device (DEVICE_HBM)"
)
_HBM_GIB = flags.DEFINE_float("hbm_gib", 80.0, "GiB per device, without --device")
_USABLE = flags.DEFINE_float("usable_fraction", 0.9, "usable part of hbm_gib")
_DEVICES = flags.DEFINE_integer("devices", 0, "simulate N CPU devices (0: real ones)")
_TPU_TOPOLOGY = flags.DEFINE_string(
    "tpu_topology", "", "compile with the TPU compiler for this slice, e.g. v5p:2x2x2 (libtpu)"
)
_SEARCH = flags.DEFINE_bool("search", True, "search the largest batch sizes that fit")
_MAX_MICRO = flags.DEFINE_integer("max_micro", 64, "largest micro-batch/device to try")


def main(argv):
    del argv
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config=configs/gsm8k.py")
    if _DEVICES.value and len(jax.devices()) != _DEVICES.value:
        seen = len(jax.devices())
        raise app.UsageError(f"--devices={_DEVICES.value} but JAX sees {seen} devices")
    if _DEVICE.value and _HBM_GIB.present:
        raise app.UsageError("give --device or --hbm_gib, not both")
    devices, backend = None, planner.DEVICE_BACKEND.get(_DEVICE.value)
    if _TPU_TOPOLOGY.value:
        if _DEVICES.value:
            raise app.UsageError("give --devices or --tpu_topology, not both")
        if backend not in (None, "tpu"):
            raise app.UsageError(f"--tpu_topology plans TPUs, not --device={_DEVICE.value}")
        devices, backend = planner.tpu_topology(_TPU_TOPOLOGY.value), "tpu"
    run = config_lib.from_dict(config_lib.RunConfig, _CONFIG.value.to_dict())
    hbm_gib = planner.DEVICE_HBM[_DEVICE.value] / planner.GIB if _DEVICE.value else _HBM_GIB.value
    print(planner.report(run, model_name=_MODEL.value, hbm_gib=hbm_gib,
                         usable_fraction=_USABLE.value, search=_SEARCH.value,
                         max_micro=_MAX_MICRO.value, backend=backend,
                         devices=devices))  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
