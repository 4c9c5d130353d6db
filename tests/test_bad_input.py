"""Bad input to train.py: invalid config values, malformed data rows, overlong prompts, failing
reward functions (issue 8).

* Config: a table of invalid values, one field each, on the demo config. `train.check_config`
  (the first thing `main` does, before any data, model or device work) must raise a ValueError
  that names the field and what is allowed. Subprocess checks show the CLI path: several bad
  values are all listed at once, a wrong type or an unknown field is rejected by the flag
  parser, and nothing is written to the workdir.
* Data: malformed rows are counted with their line numbers and skipped or rejected per
  `data.on_malformed`; overlong prompts are filtered or rejected/truncated per
  `data.filter_overlong_prompts` and `data.truncation`, through train.py's own loaders.
* Rewards: a reward function that raises (or returns a non-finite value) stops the run with an
  error naming the function and the sample (`reward.on_error="raise"`), or scores 0 and is
  counted in `reward/num_errors` (`"zero"`), end to end.
A vLLM sidecar that dies is restarted with back-off and then fails clearly: tests/test_vllm.py.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

import train
from configs import demo
from grpo_jax import advantage, config, errors, loading, loss
from grpo_jax.data import demo_task, prompts, readers
from grpo_jax.rewards import functions as reward_fns
from grpo_jax.trainer import actor, metrics, warmup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
TRIED = {"config values": 0, "data rows": 0, "prompts": 0, "reward failures": 0}


@pytest.fixture(scope="module", autouse=True)
def _print_counts():
    """Prints how many bad inputs this file tried (visible with `pytest -s`)."""
    yield
    print("\nbad inputs tried:", json.dumps(TRIED), "total", sum(TRIED.values()))


def _set(c, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        c = c[p]
    c[leaf] = value


# Enum-like fields and their allowed values (from the library's own tuples).
CHOICES = {
    "data.source": config.DATA_SOURCES,
    "data.truncation": prompts.TRUNCATION_MODES,
    "data.on_malformed": readers.ON_MALFORMED_MODES,
    "mesh.distributed": ("auto", "on", "off"),
    "model.source": ("hf", "random"),
    "model.tokenizer": ("hf", "char"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "actor.loss_agg_mode": loss.AGG_MODES,
    "actor.kl_loss_type": loss.KL_TYPES,
    "actor.policy_loss.loss_mode": loss.POLICY_LOSS_MODES,
    "actor.optim.lr_scheduler_type": actor.LR_SCHEDULES,
    "rollout.name": ("jax", "vllm"),
    "algorithm.adv_estimator": advantage.ADV_ESTIMATORS,
    "algorithm.kl_penalty": tuple(k for k in loss.KL_TYPES if not k.startswith("full")),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.rollout_correction.loss_type": ("ppo_clip", "reinforce"),
    "reward.on_error": reward_fns.ON_ERROR_MODES,
    "trainer.resume_mode": ("auto", "disable"),
}


def _choices(field):
    """(field, bad value, every allowed value must appear in the message)."""
    return field, "bogus", [f"{field}='bogus'", *(repr(a) for a in CHOICES[field])]


# (dotted field, invalid value, substrings the error must contain). The field name is always
# required; the rest is the allowed range or the fix.
INVALID = [
    *[_choices(f) for f in sorted(CHOICES)],
    ("rollout.n", 1, ["rollout.n=1", ">= 2"]),
    ("data.train_batch_size", 0, ["data.train_batch_size=0", ">= 1"]),
    ("data.val_batch_size", 0, ["data.val_batch_size=0", ">= 1"]),
    ("data.max_prompt_length", 0, ["data.max_prompt_length=0", ">= 1"]),
    ("data.max_response_length", -1, ["data.max_response_length=-1", ">= 1"]),
    ("actor.ppo_mini_batch_size", 0, ["actor.ppo_mini_batch_size=0", ">= 1"]),
    (
        "actor.ppo_mini_batch_size",
        3,
        ["actor.ppo_mini_batch_size=3", "must divide", "data.train_batch_size="],
    ),
    ("actor.ppo_micro_batch_size_per_gpu", 0, ["actor.ppo_micro_batch_size_per_gpu=0", ">= 1"]),
    ("actor.ppo_epochs", 0, ["actor.ppo_epochs=0", ">= 1"]),
    (
        "rollout.log_prob_micro_batch_size_per_gpu",
        0,
        ["rollout.log_prob_micro_batch_size_per_gpu=0", ">= 1"],
    ),
    ("rollout.val_kwargs.n", 0, ["rollout.val_kwargs.n=0", ">= 1"]),
    ("trainer.total_epochs", 0, ["trainer.total_epochs=0", ">= 1"]),
    ("checkpoint.max_to_keep", 0, ["checkpoint.max_to_keep=0", ">= 1"]),
    ("warmup.batch_size", 0, ["warmup.batch_size=0", ">= 1"]),
    ("warmup.steps", -1, ["warmup.steps=-1", ">= 0"]),
    ("warmup.lr", 0.0, ["warmup.lr=0.0", "> 0"]),
    ("trainer.max_consecutive_nonfinite", 0, ["trainer.max_consecutive_nonfinite=0", ">= 1"]),
    ("rollout.temperature", 0.0, ["rollout.temperature=0.0", "> 0"]),
    ("rollout.temperature", math.nan, ["rollout.temperature=nan", "> 0"]),
    ("rollout.val_kwargs.temperature", -0.5, ["rollout.val_kwargs.temperature=-0.5", ">= 0"]),
    ("rollout.val_kwargs.top_p", 0.0, ["rollout.val_kwargs.top_p=0.0", "(0, 1]"]),
    ("rollout.top_p", 0.0, ["rollout.top_p=0.0", "(0, 1]"]),
    ("rollout.top_p", 1.5, ["rollout.top_p=1.5", "(0, 1]"]),
    ("rollout.top_k", -2, ["rollout.top_k=-2", "-1 or 0 (off) or >= 1"]),
    ("actor.optim.lr", 0.0, ["actor.optim.lr=0.0", "> 0"]),
    ("actor.optim.lr", -1e-3, ["actor.optim.lr=-0.001", "> 0"]),
    ("actor.optim.lr", math.inf, ["actor.optim.lr=inf", "finite"]),
    ("actor.optim.lr", math.nan, ["actor.optim.lr=nan", "> 0"]),
    ("actor.optim.betas", (0.9,), ["actor.optim.betas=(0.9,)", "two values in [0, 1)"]),
    ("actor.optim.betas", (0.9, 1.0), ["actor.optim.betas=(0.9, 1.0)", "two values in [0, 1)"]),
    ("actor.optim.weight_decay", -0.1, ["actor.optim.weight_decay=-0.1", ">= 0"]),
    ("actor.optim.lr_warmup_steps_ratio", 1.5, ["actor.optim.lr_warmup_steps_ratio=1.5", "[0, 1]"]),
    ("actor.optim.min_lr_ratio", -0.5, ["actor.optim.min_lr_ratio=-0.5", "[0, 1]"]),
    ("actor.grad_clip", 0.0, ["actor.grad_clip=0.0", "> 0"]),
    ("actor.clip_ratio", 0.0, ["actor.clip_ratio=0.0", "> 0"]),
    ("actor.clip_ratio_low", -0.2, ["actor.clip_ratio_low=-0.2", "> 0"]),
    ("actor.clip_ratio_high", 0.0, ["actor.clip_ratio_high=0.0", "> 0"]),
    ("actor.clip_ratio_c", 1.0, ["actor.clip_ratio_c=1.0", "> 1"]),
    ("actor.kl_loss_coef", -0.1, ["actor.kl_loss_coef=-0.1", ">= 0"]),
    ("actor.kl_loss_type", "full", ["actor.kl_loss_type='full'", "kl, abs, mse or low_var_kl"]),
    ("actor.loss_scale_factor", 0.0, ["actor.loss_scale_factor=0.0", "> 0 or None"]),
    ("algorithm.kl_ctrl.kl_coef", -1.0, ["algorithm.kl_ctrl.kl_coef=-1.0", ">= 0"]),
    ("trainer.save_freq", 0, ["trainer.save_freq=0", "-1 (never) or >= 1"]),
    ("trainer.save_freq", -2, ["trainer.save_freq=-2", "-1 (never) or >= 1"]),
    ("trainer.test_freq", 0, ["trainer.test_freq=0", "-1 (never) or >= 1"]),
    ("trainer.total_training_steps", 0, ["trainer.total_training_steps=0", ">= 1 or None"]),
    ("data.val_max_samples", 0, ["data.val_max_samples=0", "-1 (all) or >= 1"]),
    ("data.seed", -1, ["data.seed=-1", ">= 0"]),
    ("data.arithmetic.num_train", 0, ["data.arithmetic.num_train=0", ">= 1"]),
    ("data.arithmetic.num_val", 0, ["data.arithmetic.num_val=0", ">= 1"]),
    ("data.arithmetic.max_operand", -1, ["data.arithmetic.max_operand=-1", ">= 0"]),
    ("data.arithmetic.seed", -3, ["data.arithmetic.seed=-3", ">= 0"]),
    ("model.tiny.num_layers", 0, ["model.tiny.num_layers=0", ">= 1"]),
    (
        "model.tiny.num_kv_heads",
        3,
        ["model.tiny.num_heads=4", "model.tiny.num_kv_heads=3", "multiple"],
    ),
    ("mesh.shape", (1, 1), ["mesh.shape=(1, 1)", "3 entries"]),
    (
        "data.source",
        "files",
        ["data.path=None is required with source='files'", "data.val_path=None is required"],
    ),
    ("data.source", "hf", ["data.path=None must name the dataset"]),
    ("model.source", "hf", ["model.path=None is required", "model.source='hf'"]),
    ("reward.fn", " , ", ["reward.fn=' , ' is empty", "'module:function'"]),
    ("reward.num_workers", -1, ["reward.num_workers=-1", ">= 0"]),
    ("reward.timeout_s", 0.0, ["reward.timeout_s=0.0", "> 0"]),
    ("reward.fn", "no_colon", ["reward.fn", "'module:function'"]),
    ("reward.fn", "no_such_module_xyz:f", ["reward.fn", "cannot import module"]),
    ("reward.fn", "grpo_jax.rewards.functions:no_such_fn", ["reward.fn", "has no 'no_such_fn'"]),
    ("reward.weights", "1.0,x", ["reward.weights", "comma-separated floats"]),
    ("reward.weights", "1.0,2.0", ["reward.weights", "has 2 weights for 1 functions"]),
]


@pytest.mark.parametrize(
    ("field", "value", "expected"), INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID]
)
def test_invalid_config_value_is_named(field, value, expected):
    c = demo.get_config("tiny")
    _set(c, field, value)
    with pytest.raises(ValueError) as err:
        train.check_config(c)
    msg = str(err.value)
    for part in expected:
        assert part in msg, f"{part!r} missing from: {msg}"
    # Only the injected problem is reported (the demo config itself is valid); a source without
    # its files misses two paths.
    assert msg.count("\n") == (2 if (field, value) == ("data.source", "files") else 1), msg
    TRIED["config values"] += 1


def test_demo_and_gsm8k_configs_are_valid():
    """The table above changes one field of a valid config (else every case would pass)."""
    from configs import gsm8k

    train.check_config(demo.get_config("tiny"))
    c = gsm8k.get_config("smoke")
    train.check_config(c)


@pytest.mark.parametrize(
    ("field", "value", "dp", "expected"),
    [
        ("data.train_batch_size", 4, 8, "data.train_batch_size=4 must be a multiple of the 8"),
        ("data.val_batch_size", 12, 8, "data.val_batch_size=12 must be a multiple of the 8"),
        ("actor.ppo_micro_batch_size_per_gpu", 3, 1, "actor.ppo_micro_batch_size_per_gpu=3"),
    ],
)
def test_invalid_for_mesh_is_named(field, value, dp, expected):
    c = demo.get_config("tiny")
    _set(c, field, value)
    c.actor.ppo_mini_batch_size = min(c.actor.ppo_mini_batch_size, c.data.train_batch_size)
    with pytest.raises(config.ConfigError) as err:
        train.check_config(c).check_mesh(dp)
    assert expected in str(err.value)
    TRIED["config values"] += 1


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A persistent compilation cache shared by this file's train.py runs (same programs)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _train(
    args: list[str], timeout: float = 300, jax_cache: str | None = None
) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([REPO, TESTS, os.environ.get("PYTHONPATH", "")]),
    )
    if jax_cache:
        env.update(
            JAX_COMPILATION_CACHE_DIR=jax_cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    return subprocess.run(
        [sys.executable, "train.py", "--config=configs/demo.py:tiny", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_lists_every_invalid_value_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    r = _train(
        [
            f"--config.trainer.default_local_dir={workdir}",
            "--config.rollout.n=1",
            "--config.actor.loss_agg_mode=mean",
            "--config.rollout.top_p=2.0",
        ]
    )
    assert r.returncode != 0
    for part in (
        "invalid config",
        "rollout.n=1",
        "actor.loss_agg_mode='mean' must be one of",
        "'seq-mean-token-mean'",
        "rollout.top_p=2.0",
    ):
        assert part in r.stderr, r.stderr[-3000:]
    assert not workdir.exists()  # raised before the workdir, data or model
    TRIED["config values"] += 3


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("--config.rollout.n=five", "rollout.n"),  # wrong type: ml_collections' flag parser
        ("--config.actor.kl_coef=0.1", "kl_coef"),  # unknown field (typo of kl_loss_coef)
    ],
)
def test_cli_rejects_wrong_type_and_unknown_field(tmp_path, arg, expected):
    r = _train([f"--config.trainer.default_local_dir={tmp_path / 'run'}", arg])
    assert r.returncode != 0
    assert expected in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    TRIED["config values"] += 1


def _last_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _cli_case(tmp_path, case):
    """(train.py args, the one line it must end with) for each input mistake a newcomer makes."""
    bad_parquet = tmp_path / "train.parquet"
    bad_parquet.write_text("question,answer\n1+1,2\n")  # a CSV named .parquet
    gguf = tmp_path / "model.gguf"
    return {
        "typo": (["--config.actor.clip_ration=0.3"],
                 "unknown config field actor.clip_ration (did you mean actor.clip_ratio?)"),
        "typo_section": (["--config.actr.clip_ratio=0.3"],
                         "unknown config field actr (did you mean actor?)"),
        "not_parquet": (
            ["--config.data.source=files", f"--config.data.path={bad_parquet}",
             f"--config.data.val_path={bad_parquet}"],
            f"error: data.path: data file '{bad_parquet}' is not a readable parquet file",
        ),
        "missing_data": (
            ["--config.data.source=files", f"--config.data.path={tmp_path / 'nope.parquet'}",
             f"--config.data.val_path={bad_parquet}"],
            f"error: data.path: data file '{tmp_path / 'nope.parquet'}' does not exist",
        ),
        "file_with_tfds": (
            ["--config.data.source=tfds", f"--config.data.path={bad_parquet}"],
            f"data.path='{bad_parquet}' is not read with source='tfds'",
        ),
        "missing_model_dir": (
            ["--config.model.source=hf", "--config.model.tokenizer=hf",
             "--config.model.path=/nonexistent"],
            "model.path='/nonexistent' does not exist: give an HF checkpoint directory or a "
            ".gguf file",
        ),
        "missing_gguf": (
            ["--config.model.source=hf", "--config.model.tokenizer=hf",
             f"--config.model.path={gguf}"],
            f"model.path='{gguf}' does not exist",
        ),
        "cudnn_on_cpu": (
            ["--config.model.attention_impl=cudnn"],
            "model.attention_impl='cudnn' cannot run here: cuDNN attention needs an NVIDIA GPU",
        ),
    }[case]  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["typo", "typo_section", "not_parquet", "missing_data", "file_with_tfds", "missing_model_dir",
     "missing_gguf", "cudnn_on_cpu"],
)  # fmt: skip
def test_cli_input_mistake_is_one_line_without_traceback(tmp_path, case):
    args, expected = _cli_case(tmp_path, case)
    r = _train([f"--config.trainer.default_local_dir={tmp_path / 'run'}", *args])
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert expected in _last_line(r), r.stderr[-3000:]
    assert "\\n" not in r.stderr and "\\'" not in r.stderr  # no escaped message text
    TRIED["config values"] += 1


def _parsed(args: list[str]) -> subprocess.CompletedProcess:
    """train.py's flag parsing alone (cli.parse_flags over train.py's --config flag), printing
    the parsed values of the fields the None tests read."""
    code = (
        "import sys, train\n"
        "from absl import flags\n"
        "from grpo_jax import cli\n"
        "cli.parse_flags(['train.py', *sys.argv[1:]])\n"
        "c = flags.FLAGS.config\n"
        "print(repr((c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.data.val_path, "
        "c.checkpoint.max_to_keep)))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-c", code, "--config=configs/demo.py:tiny", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_cli_sets_a_field_to_none_as_verls_null():
    # verl's `actor_rollout_ref.actor.clip_ratio_low=null` (read as clip_ratio): ml_collections
    # parses an override by the field's type and cannot give a float None; None and null are
    # taken for the fields declared Optional, the last override of a path wins.
    r = _parsed(["--config.actor.clip_ratio_low=null", "--config.actor.clip_ratio_high=None",
                 "--config.data.val_path=/x.parquet", "--config.data.val_path=None",
                 "--config.checkpoint.max_to_keep=5"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "(None, None, None, 5)"
    r = _parsed(["--config.actor.clip_ratio_low=None", "--config.actor.clip_ratio_low=0.1"])
    assert r.stdout.strip().splitlines()[-1] == "(0.1, 0.2, None, 1)", r.stderr[-3000:]
    TRIED["config values"] += 2


@pytest.mark.parametrize(
    "arg,expected",
    [
        ("--config.actor.clip_ratio=null",
         "error: --config.actor.clip_ratio cannot be None or null"),
        ("--config.actor.clip_ratoi_low=None",
         "unknown config field actor.clip_ratoi_low (did you mean actor.clip_ratio_low?)"),
    ],
)  # fmt: skip
def test_cli_none_for_a_field_that_cannot_be_none_is_one_line(arg, expected):
    r = _parsed([arg])
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert _last_line(r).startswith(expected)
    TRIED["config values"] += 1


def test_cli_crash_keeps_its_traceback():
    """Only input errors are shortened: any other exception is a crash and propagates."""
    from grpo_jax import cli, errors

    def crash(argv):
        raise RuntimeError("a bug, not an input")

    def bad_input(argv):
        raise errors.InputError("data.path='x' does not exist")

    with pytest.raises(RuntimeError, match="a bug"):
        cli.run(crash, argv=["train.py"])
    with pytest.raises(SystemExit) as e:
        cli.run(bad_input, argv=["train.py"])
    assert str(e.value.code) == "error: data.path='x' does not exist"


# ------------------------------------------------------------------------------------------
# DATA ROWS
# ------------------------------------------------------------------------------------------

GOOD = {"question": "2+3", "answer": "#### 5"}
# line -> (raw jsonl line, why it is malformed); None marks a valid row.
ROWS = [
    (json.dumps(GOOD), None),
    (json.dumps({"question": "1+1"}), "missing 'answer'"),
    (json.dumps({"question": "", "answer": "#### 1"}), "empty 'question'"),
    (json.dumps({"question": "   ", "answer": "#### 1"}), "empty 'question'"),
    (json.dumps({"answer": "#### 1"}), "missing or empty 'question'"),
    (json.dumps({"question": "7+1", "answer": "#### eight"}), "no '#### <number>'"),
    (json.dumps({"question": "7+1", "answer": "8"}), "no '#### <number>'"),
    (json.dumps({"question": "7+1", "answer": "#### ,"}), "non-numeric"),
    (json.dumps({"question": "7+1", "answer": "#### 1.2.3"}), "non-numeric"),
    (json.dumps({"question": "7+1", "answer": None}), "missing 'answer'"),
    (json.dumps({"question": 12, "answer": "#### 12"}), "missing or empty 'question'"),
    ('{"question": "3+4", "answer": "#### 7"', "invalid JSON"),
    ("", "empty line"),
    (json.dumps([GOOD]), "not a JSON object"),
    (json.dumps({"question": "10+2", "answer": "10+2=12\n#### 1,2"}), None),  # "12" (commas)
    (json.dumps({"question": "1-3", "answer": "#### -2"}), None),
    (json.dumps({"question": "1/2", "answer": "#### 0.5"}), None),
]


def _jsonl(tmp_path, lines, name="rows.jsonl") -> str:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def _jsonl_config(path: str, **overrides):
    c = demo.get_config("tiny")
    c.data.source = "jsonl"
    c.data.path = c.data.val_path = path
    for k, v in overrides.items():
        _set(c, k, v)
    return train.check_config(c)


def _encode(run):
    """The train prompts the way loop.train tokenises them."""
    tok = loading.tokenizer(run.model)
    examples = loading.examples(run.data, "train")
    return tok, prompts.encode(
        tok,
        examples,
        max_prompt_length=run.data.max_prompt_length,
        filter_overlong_prompts=run.data.filter_overlong_prompts,
        truncation=run.data.truncation,
    )


def test_malformed_rows_skipped_counted_with_line_numbers(tmp_path, caplog):
    path = _jsonl(tmp_path, [line for line, _ in ROWS])
    c = _jsonl_config(path, **{"data.on_malformed": "skip"})
    with caplog.at_level("WARNING"):
        examples = loading.examples(c.data, "train")
    good_lines = [i + 1 for i, (_, why) in enumerate(ROWS) if why is None]
    bad = [(i + 1, why) for i, (_, why) in enumerate(ROWS) if why is not None]
    assert [ex.line for ex in examples] == good_lines
    assert [ex.ground_truth for ex in examples] == ["5", "12", "-2", "0.5"]
    assert f"{path}: {len(bad)} malformed row(s)" in caplog.text
    for line, why in bad:
        assert f"line {line}: " in caplog.text
        assert why in caplog.text.split(f"line {line}: ")[1].split("; line ")[0], (line, why)
    TRIED["data rows"] += len(bad)


def test_malformed_rows_rejected_with_line_numbers(tmp_path):
    path = _jsonl(tmp_path, [line for line, _ in ROWS])
    c = _jsonl_config(path, **{"data.on_malformed": "error"})
    with pytest.raises(ValueError) as err:
        loading.examples(c.data, "train")
    msg = str(err.value)
    bad_lines = [i + 1 for i, (_, why) in enumerate(ROWS) if why is not None]
    assert f"{len(bad_lines)} malformed row(s)" in msg and "data.on_malformed='skip'" in msg
    assert [int(n) for n in re.findall(r"line (\d+): ", msg)] == bad_lines


def test_a_warm_up_batch_beyond_the_train_set_names_warmup_batch_size():
    """It once failed in the warm-up's first batch, naming data.train_batch_size."""
    tok = demo_task.char_tokenizer()
    examples = [prompts.Example(f"{i}+1=", str(i + 1), answer=str(i + 1)) for i in range(10)]
    train_set = prompts.encode(tok, examples, max_prompt_length=8,
                               filter_overlong_prompts=False, truncation="error")  # fmt: skip
    run = config.RunConfig(warmup=config.WarmupConfig(steps=1, batch_size=16))
    with pytest.raises(errors.InputError, match="warmup.batch_size=16 exceeds the 10 training"):
        warmup.warm_up(run, None, None, train_set, tok, None, eos_id=0, pad_id=0, micro_rows=16,
                       model_config=None)  # fmt: skip
    TRIED["config values"] += 1


def test_malformed_rows_rejected_by_train_py_before_the_model(tmp_path):
    path = _jsonl(tmp_path, [line for line, _ in ROWS[:3]])
    r = _train(
        [
            f"--config.trainer.default_local_dir={tmp_path / 'run'}",
            "--config.data.source=jsonl",
            f"--config.data.path={path}",
            f"--config.data.val_path={path}",
            "--config.data.on_malformed=error",
        ]
    )
    assert r.returncode != 0
    assert f"{path}: 2 malformed row(s): line 2: missing 'answer'; line 3:" in r.stderr, r.stderr[
        -3000:
    ]
    assert "model ModelConfig" not in r.stderr


# ------------------------------------------------------------------------------------------
# OVERLONG PROMPTS
# ------------------------------------------------------------------------------------------

# With the demo's char tokenizer and chat template a prompt is "<|user|>" + question +
# "<|assistant|>": 1 + len(question) + 1 tokens. max_prompt_length=6 fits 4-character questions.
QUESTIONS = ["1+1", "12+1", "123+4", "1+2345"]  # 5, 6, 7, 8 tokens


def _overlong_config(tmp_path, **overrides):
    rows = [json.dumps({"question": q, "answer": "#### 0"}) for q in QUESTIONS]
    return _jsonl_config(
        _jsonl(tmp_path, rows),
        **{"data.max_prompt_length": 6, "data.prompt_suffix": "", **overrides},
    )


def test_overlong_prompts_filtered_and_counted(tmp_path, caplog):
    c = _overlong_config(tmp_path, **{"data.filter_overlong_prompts": True})
    with caplog.at_level("WARNING"):
        _, ps = _encode(c)
    assert [ex.prompt[0]["content"] for ex in ps.examples] == ["1+1", "12+1"]
    assert ps.num_filtered == 2 and "filtered 2 prompt(s) longer than 6 tokens" in caplog.text
    TRIED["prompts"] += 2


def test_overlong_prompts_rejected_naming_line_and_fields(tmp_path):
    c = _overlong_config(
        tmp_path, **{"data.filter_overlong_prompts": False, "data.truncation": "error"}
    )
    with pytest.raises(ValueError) as err:
        _encode(c)
    msg = str(err.value)
    for part in (
        "line 3",
        "7 tokens",
        "data.max_prompt_length=6",
        "data.filter_overlong_prompts=True",
        "data.truncation",
    ):
        assert part in msg, msg
    TRIED["prompts"] += 1


@pytest.mark.parametrize("side", ["left", "right"])
def test_overlong_prompts_truncated(tmp_path, side):
    c = _overlong_config(
        tmp_path, **{"data.filter_overlong_prompts": False, "data.truncation": side}
    )
    tok, ps = _encode(c)
    assert len(ps) == 4 and ps.num_filtered == 0
    full = [
        tok(prompts.chat_prompt(tok, q, suffix=""), add_special_tokens=False)["input_ids"]
        for q in QUESTIONS
    ]
    assert [len(f) for f in full] == [5, 6, 7, 8]
    # "left" keeps the last 6 tokens (the generation prompt survives), "right" the first 6.
    want = [f[-6:] if side == "left" else f[:6] for f in full]
    assert [list(p) for p in ps.prompt_ids] == want
    assert tok.decode(ps.prompt_ids[3]) == (
        "+2345" + demo_task.ASSISTANT if side == "left" else demo_task.USER + "1+234"
    )
    TRIED["prompts"] += 2


def test_every_prompt_overlong_is_an_error(tmp_path):
    c = _overlong_config(
        tmp_path, **{"data.max_prompt_length": 4, "data.filter_overlong_prompts": True}
    )
    with pytest.raises(ValueError, match="every prompt is longer than data.max_prompt_length=4"):
        _encode(c)
    TRIED["prompts"] += 4


# ------------------------------------------------------------------------------------------
# REWARD FUNCTIONS THAT FAIL (end to end)
# ------------------------------------------------------------------------------------------


# fault_rewards.failing_reward raises on odd-length completions and returns NaN on even ones, so
# every call fails (it lives there because this module imports train.py, whose flags a
# subprocess train.py would then define twice).
REWARD_RUN = (
    "--config.trainer.total_training_steps=1",
    "--config.data.arithmetic.num_train=8",
    "--config.data.arithmetic.num_val=4",
    "--config.data.val_batch_size=4",
    "--config.data.train_batch_size=4",
    "--config.actor.ppo_mini_batch_size=4",
    "--config.rollout.n=2",
    "--config.warmup.steps=0",
    "--config.trainer.val_before_train=False",
    "--config.trainer.tensorboard=False",
    "--config.trainer.progress_bar=False",
    "--config.checkpoint.export_hf=False",
    "--config.model.tiny.hidden_size=32",
    "--config.model.tiny.intermediate_size=64",
    "--config.reward.fn=grpo_jax.rewards.functions:gsm8k_score,fault_rewards:failing_reward",
)


def test_failing_reward_raise_names_function_and_sample(tmp_path, jax_cache):
    r = _train(
        [
            f"--config.trainer.default_local_dir={tmp_path / 'run'}",
            *REWARD_RUN,
            "--config.reward.on_error=raise",
        ],
        jax_cache=jax_cache,
    )
    assert r.returncode != 0
    assert "reward function fault_rewards:failing_reward on sample 0" in r.stderr, r.stderr[-3000:]
    assert "ground truth" in r.stderr and "completion tail" in r.stderr and "failed:" in r.stderr
    assert not metrics.read(str(tmp_path / "run"))  # no step completed
    TRIED["reward failures"] += 1


def test_failing_reward_zero_is_counted(tmp_path, jax_cache):
    workdir = str(tmp_path / "run")
    r = _train(
        [
            f"--config.trainer.default_local_dir={workdir}",
            *REWARD_RUN,
            "--config.reward.on_error=zero",
        ],
        jax_cache=jax_cache,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = metrics.read(workdir)
    # 4 prompts x rollout.n 2 = 8 samples, each failing once (the gsm8k scorer never fails).
    assert row["reward/num_errors"] == 8
    assert row["reward/fault_rewards:failing_reward/mean"] == 0.0
    assert "reward function fault_rewards:failing_reward on sample 7" in r.stderr
    assert "; scored 0" in r.stderr
    TRIED["reward failures"] += 8
