"""Shared config pieces: big_vision's `parse_arg` and the full GRPO config with verl's defaults.

Every knob of train.py is declared here once, with a comment; config files (gsm8k.py,
gsm8k_drgrpo.py, demo.py) start from `grpo_config()` and only override. Field names follow
verl 0.9.1 (`actor_rollout_ref.actor.X` -> `actor.X`, `actor_rollout_ref.rollout.X` ->
`rollout.X`, `data.X`, `algorithm.X`, `trainer.X`) so a verl run script ports line by line;
see README "verl override mapping".
"""

import ml_collections
from ml_collections import config_dict

VERL_GSM8K_INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def _autotype(value: str, default):
    """Converts a `:key=value` string to the type of its default (bool accepts True/False/1/0)."""
    if isinstance(default, bool):
        if value in ("True", "true", "1"):
            return True
        if value in ("False", "false", "0"):
            return False
        raise ValueError(f"expected a bool (True/False), got {value!r}")
    if default is None:
        return value
    return type(default)(value)


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
    """Parses a config-file argument `cfg.py:a=1,b,c=x` (big_vision semantics).

    A bare word is `word=True` when `word` is a spec key, else the value of the first spec key
    (so `:smoke` sets smoke and `:qwen2.5-0.5b` would set the first key). Unknown keys raise.

    Args:
      arg: the string after the colon, or None.
      **spec: key -> default; the default's type converts the string.

    Returns:
      A ConfigDict with every spec key.
    """
    arg = arg or ""
    if arg and "," not in arg and "=" not in arg:
        arg = f"{arg}=True" if arg in spec else f"{next(iter(spec))}={arg}"
    raw = {}
    for item in filter(None, arg.split(",")):
        key, _, value = item.partition("=")
        raw[key] = value if "=" in item else "True"
    unknown = sorted(set(raw) - set(spec))
    if unknown:
        raise ValueError(f"unknown config arg(s) {unknown}; allowed: {sorted(spec)}")
    out = {k: _autotype(raw[k], d) if k in raw else d for k, d in spec.items()}
    return ml_collections.ConfigDict(out)


def grpo_config() -> ml_collections.ConfigDict:
    """The full config tree with verl's defaults (verl-semantics.md section 7)."""
    c = ml_collections.ConfigDict()

    c.data = dict(
        source="jsonl",  # "tfds" (GSM8K via tensorflow-datasets) | "jsonl" | "arithmetic" (demo)
        path=config_dict.placeholder(str),  # train jsonl, raw OpenAI {"question","answer"}
        val_path=config_dict.placeholder(str),  # test jsonl; same format
        train_split="train",  # tfds split used for training
        val_split="test",  # tfds split used for evaluation
        prompt_suffix=VERL_GSM8K_INSTRUCTION,  # appended to each question (verl preprocessing)
        train_batch_size=1024,  # prompts per step (verl data.train_batch_size)
        val_batch_size=256,  # prompts per greedy eval chunk
        val_max_samples=-1,  # -1 = the whole test split (1,319 GSM8K questions)
        max_prompt_length=512,  # tokens, after the chat template; prompts are left-padded to this
        max_response_length=1024,  # generated tokens per completion
        prompt_length_bucket=64,  # update input's prompt width rounds up to this (fewer compiles)
        filter_overlong_prompts=True,  # drop prompts longer than max_prompt_length
        truncation="error",  # "error" | "left" | "right": what to do with overlong prompts
        shuffle=True,  # reshuffle the train set every epoch (seeded)
        seed=1,  # shuffle seed (verl data.seed)
        on_malformed="skip",  # "skip" (count + warn with line numbers) | "error"
        arithmetic=dict(  # synthetic task of configs/demo.py (data.source="arithmetic")
            num_train=2000,  # training questions
            num_val=200,  # held-out questions
            max_operand=99,  # operands are drawn from [0, max_operand]
            modulus=0,  # > 0: the answer is (a + b) mod modulus ("a+b%m")
            seed=0,  # generator seed (train and val are disjoint)
        ),
    )

    c.model = dict(
        path=config_dict.placeholder(str),  # HF checkpoint dir (or hub id) when source == "hf"
        source="hf",  # "hf" (load safetensors from path) | "random" (init tiny from model.tiny)
        tokenizer="hf",  # "hf" (AutoTokenizer from path) | "char" (built-in char tokenizer)
        dtype="float32",  # compute dtype: "float32" | "bfloat16"
        param_dtype="float32",  # parameter/optimizer dtype: "float32" | "bfloat16"
        enable_gradient_checkpointing=False,  # remat each layer in the update (verl name)
        tiny=dict(  # shape of the random model (source == "random")
            hidden_size=64,  # D
            intermediate_size=128,  # F
            num_layers=2,  # L
            num_heads=4,  # N
            num_kv_heads=2,  # K
            head_dim=16,  # H
            seed=0,  # init seed
        ),
    )

    c.actor = dict(
        ppo_mini_batch_size=256,  # prompts per optimizer step (x rollout.n sequences)
        ppo_micro_batch_size_per_gpu=8,  # sequences per device per gradient-accumulation step
        ppo_epochs=1,  # passes over the batch (mu)
        clip_ratio=0.2,  # epsilon, used where clip_ratio_low/high are None
        clip_ratio_low=config_dict.placeholder(float),  # epsilon_low; None = clip_ratio
        clip_ratio_high=config_dict.placeholder(float),  # epsilon_high (DAPO); None = clip_ratio
        clip_ratio_c=3.0,  # dual-clip c (> 1), negative advantages only
        loss_agg_mode="token-mean",  # token-mean | seq-mean-token-sum | seq-mean-token-mean |
        # seq-mean-token-sum-norm | token-sum
        loss_scale_factor=config_dict.placeholder(float),  # Dr.GRPO constant for the -norm mode
        entropy_coeff=0.0,  # entropy bonus weight (verl default 0)
        calculate_entropy=True,  # log actor/entropy even when entropy_coeff == 0
        use_kl_loss=False,  # add beta * KL(policy || ref) to the loss (GRPO paper)
        kl_loss_coef=0.001,  # beta
        kl_loss_type="low_var_kl",  # kl (k1) | abs | mse (k2) | low_var_kl (k3), "+" variants
        grad_clip=1.0,  # global grad-norm clip; non-finite norm skips the update
        policy_loss=dict(loss_mode="vanilla"),  # vanilla | gspo | cispo | gpg (loss.py)
        optim=dict(
            lr=1e-6,  # AdamW peak learning rate
            betas=(0.9, 0.999),  # AdamW (b1, b2)
            weight_decay=0.01,  # decoupled weight decay
            lr_warmup_steps=-1,  # linear warm-up steps; -1 = use lr_warmup_steps_ratio
            lr_warmup_steps_ratio=0.0,  # warm-up as a fraction of total training steps
            lr_scheduler_type="constant",  # "constant" | "cosine" (after warm-up)
            min_lr_ratio=0.0,  # cosine floor as a fraction of lr
        ),
    )

    c.rollout = dict(
        name="jax",  # "jax" (native sampler) | "vllm" (sidecar server)
        n=1,  # G, completions per prompt (verl default 1; GRPO recipes set 5)
        temperature=1.0,  # sampling temperature; log-probs are divided by it too (verl)
        top_p=1.0,  # nucleus sampling
        top_k=-1,  # -1 = off
        log_prob_micro_batch_size_per_gpu=16,  # sequences per device for old/ref log-probs
        val_kwargs=dict(
            temperature=0.0,  # 0 = greedy (pass@1)
            n=1,  # completions per validation prompt
        ),
        vllm=dict(  # rollout.name == "vllm": grpo_jax.vllm_sidecar.VLLMConfig, field by field
            python="",  # interpreter of the vLLM venv (starts a server); exclusive with url
            url="",  # attach to a running server instead (e.g. "http://10.0.0.5:8000")
            host="127.0.0.1",  # interface a started server listens on
            port=0,  # port of a started server; 0 = pick a free one
            gpu_memory_utilization=0.4,  # vLLM's GPU memory fraction (JAX shares the GPU)
            dtype="bfloat16",  # "auto" | "float32" | "bfloat16" | "float16"
            max_model_len=0,  # prompt + response limit; 0 = the model's max positions
            seed=0,  # server --seed
            extra_args="",  # more server flags, shell-split (CPU: "--enforce-eager")
            env="",  # "NAME=VALUE,..." for the server (CPU: "VLLM_CPU_KVCACHE_SPACE=1")
            startup_timeout_s=600.0,  # start/restart deadline until /health answers
            request_timeout_s=600.0,  # one generation request (one prompt, n samples)
            sync_timeout_s=300.0,  # one weight reload
            max_restarts=3,  # restarts of a dead server per call before failing
            restart_backoff_s=5.0,  # first back-off, doubled each restart
            stop_timeout_s=30.0,  # SIGTERM -> SIGKILL grace period
            max_concurrent_requests=64,  # prompts in flight at once
        ),
    )

    c.algorithm = dict(
        adv_estimator="grpo",  # "grpo" | "rloo"
        norm_adv_by_std_in_grpo=True,  # divide by the group std (False = Dr.GRPO)
        use_kl_in_reward=False,  # subtract kl_ctrl.kl_coef * KL(old || ref) from the reward
        kl_penalty="kl",  # estimator of the in-reward KL (same names as actor.kl_loss_type)
        kl_ctrl=dict(
            type="fixed",  # "fixed" only (the adaptive controller is not implemented)
            kl_coef=0.001,  # beta of the in-reward KL
        ),
    )

    c.reward = dict(
        fn="grpo_jax.rewards:gsm8k_score",  # comma-separated "module:function" list
        weights="",  # comma-separated weights, "" = all 1.0
        on_error="raise",  # "raise" (error naming fn + sample) | "zero" (score 0, counted)
    )

    c.warmup = dict(  # optional supervised warm-up on the reference answers before GRPO
        steps=0,  # 0 = none
        batch_size=64,  # prompts per SFT step
        lr=1e-3,  # constant AdamW lr of the warm-up
    )

    c.trainer = dict(
        default_local_dir="runs/grpo",  # workdir: metrics, checkpoints, plot, HF export
        total_epochs=15,  # passes over the train set
        total_training_steps=config_dict.placeholder(int),  # None = epochs x steps per epoch
        save_freq=20,  # checkpoint every N steps; -1 = only at the end
        test_freq=5,  # greedy eval every N steps (and at the end); -1 = only at the end
        val_before_train=True,  # eval before the first step
        resume_mode="auto",  # "auto" (latest checkpoint in the workdir) | "disable"
        seed=0,  # rollout rng seed
        max_consecutive_nonfinite=10,  # stop after this many skipped (non-finite) updates
        progress_bar=True,  # tqdm bar with ETA
        tensorboard=True,  # also log to workdir/tensorboard
    )

    c.checkpoint = dict(
        max_to_keep=3,  # orbax checkpoints kept
        export_hf=True,  # write workdir/hf (safetensors + tokenizer) at the end
    )

    c.mesh = dict(
        shape=(-1, 1, 1),  # (data, fsdp, tensor); -1 fills with the remaining devices
        # logical-axis rules ((name, mesh axes), ...); None = grpo_jax.sharding.LOGICAL_RULES
        rules=config_dict.placeholder(tuple),
        distributed="auto",  # jax.distributed start-up: "auto" (detect), "on" or "off"
    )
    return c


def use_builtin_task(c: ml_collections.ConfigDict) -> None:
    """Switches `c` to the shipped arithmetic task, char tokenizer and a random tiny model."""
    c.data.source = "arithmetic"
    c.data.prompt_suffix = ""
    c.model.source = "random"
    c.model.tokenizer = "char"
    c.model.path = None


def make_smoke(c: ml_collections.ConfigDict) -> None:
    """The `:smoke` variant: same code path, tiny random model, synthetic prompts, 2 steps."""
    use_builtin_task(c)
    c.data.arithmetic.num_train = 64
    c.data.arithmetic.num_val = 8
    c.data.train_batch_size = 4
    c.data.val_batch_size = 8
    c.data.max_prompt_length = 32
    c.data.max_response_length = 8
    c.actor.ppo_mini_batch_size = 2
    c.actor.ppo_micro_batch_size_per_gpu = 5  # rollout.n = 5 (recipe): 2 micro-batches
    c.rollout.log_prob_micro_batch_size_per_gpu = 10
    c.trainer.total_training_steps = 2
    c.trainer.test_freq = -1
    c.trainer.save_freq = 1
    c.trainer.default_local_dir = "runs/smoke"
