r"""GRPO training CLI: `python train.py --config=configs/gsm8k.py[:variant] [--config.X=v]`.

A thin layer over the library (grpo_jax/trainer/loop.py runs the loop):
flags, the ml_collections config turned into grpo_jax.config dataclasses and validated before
any model, data or device work, jax.distributed start-up, loading the tokenizer, model and data
named by the config, then `loop.train`, and at the end the HF export (workdir/hf; with LoRA the
merged model there and the PEFT adapter in workdir/hf_adapter) and plot.png.
A run restarts from the latest checkpoint in trainer.default_local_dir. Only process 0 writes
metrics, plots and the export.
"""

import json
import logging
import os

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from grpo_jax import cli, distributed, loading, planner, sharding
from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.models import hf
from grpo_jax.trainer import loop, metrics, perf, plot, setup, validation

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:arg]).", lock_config=True
)
_PLAN = flags.DEFINE_bool(
    "plan", False, "Print the per-device memory plan of this config and mesh (plan.py) and exit."
)
_PLAN_MODEL = flags.DEFINE_string(
    "plan_model", "", "With --plan: a plan.py preset (e.g. qwen2.5-7b); default config.model."
)
_PLAN_HBM = flags.DEFINE_float("plan_hbm_gib", 80.0, "With --plan: memory per device, GiB.")


def check_config(c: ml_collections.ConfigDict) -> config_lib.RunConfig:
    """The config as dataclasses, with everything loading will need checked up front.

    Raises:
      config.ConfigError (a ValueError) listing every problem with its dotted field.
    """
    run = config_lib.from_dict(config_lib.RunConfig, c.to_dict())
    problems = []
    for check in (run.data.check_source, run.model.check_source):
        try:
            check()
        except config_lib.ConfigError as e:
            problems += e.problems
    try:
        loading.reward_fn(run.reward, run.custom_reward_function)
    except ValueError as e:
        problems.append(f"reward.fn: {e}")
    if problems:
        raise config_lib.ConfigError(problems)
    return run


def check_workdir(workdir: str) -> None:
    """Creates trainer.default_local_dir and proves it writable, before any heavy work."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_probe.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"trainer.default_local_dir={workdir!r} is not writable ({e}); "
            "point it at a writable directory"
        ) from e


class _QuietLibraryInfo(logging.Filter):
    """Drops orbax's per-save INFO chatter from the terminal; warnings and errors still show."""

    def filter(self, record):
        return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
    del argv
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().addFilter(_QuietLibraryInfo())
    c = _CONFIG.value
    if c is None:
        raise app.UsageError("--config is required, e.g. --config=configs/demo.py")
    run = check_config(c)
    if _PLAN.value:
        print(planner.report(run, model_name=_PLAN_MODEL.value, hbm_gib=_PLAN_HBM.value))
        return
    distributed.maybe_initialize(mode=run.mesh.distributed)
    cache = perf.use_compilation_cache(run.trainer.compilation_cache_dir)
    logging.info("compilation cache: %s", cache or "off (trainer.compilation_cache_dir='')")
    workdir = run.trainer.default_local_dir
    check_workdir(workdir)
    is_main = distributed.is_main_process()
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(c.to_json_best_effort(indent=2))

    mesh = setup.train_mesh(run)  # without the sampler's own devices (rollout.num_devices)
    rules = sharding.rules_from_config(run.mesh.rules)
    # Every jitted function is traced inside the mesh and its logical-axis rules: model.py's
    # activation constraints act only there (without them FSDP leaves activations replicated).
    with sharding.use_mesh(mesh, rules):
        run.check_mesh(mesh.shape["data"] * mesh.shape["fsdp"])
        tokenizer = loading.tokenizer(run.model)
        train_examples = loading.examples(run.data, "train")
        val_examples = loading.examples(run.data, "val")
        max_positions = run.data.max_prompt_length + run.data.max_response_length + 64
        model_config, params = loading.model(
            run.model, tokenizer, mesh, rules, max_positions=max_positions
        )
        result = loop.train(
            run,
            model_config=model_config,
            params=params,
            tokenizer=tokenizer,
            train_data=train_examples,
            val_data=val_examples,
            mesh=mesh,
            rules=rules,
            donate_params=True,  # `params` is not used again: no second copy of the weights
        )

    # EXPORT: a collective under multi-process FSDP (every process gathers, process 0 writes).
    # With LoRA: the merged model in hf/, and the adapter alone in PEFT's format in hf_adapter/.
    if run.checkpoint.export_hf and not run.trainer.val_only:  # val_only trained nothing
        hf_dir = os.path.join(workdir, "hf")
        if result.base_params is not None:
            hf.save_adapter(
                result.model_config, result.state.params, os.path.join(workdir, "hf_adapter"),
                base_model_name_or_path=run.model.path or "",
            )  # fmt: skip
        model_lib.save_hf_checkpoint(result.model_config, result.policy_params(), hf_dir)
        if is_main:
            tokenizer.save_pretrained(hf_dir)
    if is_main:
        plot.plot(workdir)
        print(report(workdir))
        final = {k: v for k, v in metrics.read(workdir)[-1].items() if k.startswith("val")}
        logging.info("done: %s", json.dumps(final))
        print(json.dumps({"final": final, "workdir": workdir}))


def report(workdir: str, *, samples: int = 2) -> str:
    """The run in a few lines: the core validation metrics at the first and the last
    validation, and the logged completions (trainer.log_val_generations) of the same inputs at
    both: how many scored higher, lower and the same, with `samples` examples of each."""
    evals = [r for r in metrics.read(workdir) if any(k.startswith("val-core/") for k in r)]
    lines = []
    if evals:
        first, last = evals[0], evals[-1]
        for key in sorted(k for k in last if k.startswith("val-core/") and k in first):
            lines.append(f"{key}: {first[key]:.3f} at step {first['step']} -> "
                         f"{last[key]:.3f} at step {last['step']}")
    generations = validation.read_generations(workdir)
    if generations:
        lo, hi = min(generations), max(generations)
        changes = validation.compare_generations(generations[lo], generations[hi],
                                                 samples=samples) if hi > lo else []
        if changes:
            lines.append(f"validation samples, step {lo} -> step {hi}:")
            lines += changes
        else:
            for step in sorted({lo, hi}):
                lines.append(f"validation samples at step {step}:")
                for g in generations[step][:samples]:
                    lines.append(f"  {g['input']!r} -> {g['output']!r} (score {g['score']:.3g})")
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run(main)
