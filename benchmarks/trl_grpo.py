"""The TRL side of benchmarks/bench_e2e.py: TRL's GRPOTrainer on the same workload as train.py.

Runs in the venv of scripts/build_trl_venv.sh (TRL, transformers, CPU torch), never next to JAX.
It trains `--steps` optimizer steps of GRPO on the first prompts of the GSM8K jsonl, in order,
with the settings bench_e2e.py passes (the same as grpo_jax's), and prints one JSON line: the
time of every step and of its phases, the peak RSS and the token counts.

Phases are timed by wrapping GRPOTrainer's own methods: `_generate` (the rollout),
`_get_per_token_logps_and_entropies` called without gradients (the reference model's log-probs;
no old log-probs are computed with one optimizer step per generation), and the rest of the step
(the policy's forward and backward and the optimizer: the update). The reward is verl's GSM8K
scorer from grpo_jax/rewards/scorers.py (pure Python), called in TRL's batched signature.
"""

import argparse
import json
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_dir", required=True, help="HF checkpoint dir (with tokenizer)")
    p.add_argument("--data", required=True, help="raw GSM8K jsonl")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_prompt_length", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--micro", type=int, default=8, help="completions per forward/backward")
    p.add_argument("--gradient_checkpointing", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="bfloat16: TRL's bf16=True (float32 weights, bf16 autocast compute)")
    p.add_argument("--workdir", required=True)
    args = p.parse_args()

    import datasets
    import torch
    import transformers
    import trl

    sys.path.insert(0, REPO)
    from grpo_jax.rewards import scorers  # pure Python: no JAX in this venv

    rows = []
    with open(args.data) as f:
        for line in f:
            row = json.loads(line)
            rows.append({
                "prompt": [{"role": "user", "content": row["question"] + INSTRUCTION}],
                "ground_truth": scorers.gsm8k_ground_truth(row["answer"]),
            })  # fmt: skip
            if len(rows) == args.prompts * (args.steps + 1):
                break
    train = datasets.Dataset.from_list(rows)

    def gsm8k_reward(prompts, completions, ground_truth, **kwargs):
        return [scorers.gsm8k_score(c[0]["content"], g)
                for c, g in zip(completions, ground_truth, strict=True)]  # fmt: skip

    batch = args.prompts * args.n
    config = trl.GRPOConfig(
        output_dir=args.workdir,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.01,  # verl's AdamW decay (TRL's default is 0)
        max_grad_norm=1.0,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=args.beta,  # k3 KL to the reference, the same estimator as verl's low_var_kl
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",  # token-mean over the batch, as verl's token-mean
        scale_rewards="group",
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=batch // args.micro,
        generation_batch_size=batch,
        shuffle_dataset=False,
        max_steps=args.steps,
        gradient_checkpointing=bool(args.gradient_checkpointing),
        bf16=args.dtype == "bfloat16",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=gsm8k_reward, args=config, train_dataset=train,
        processing_class=tokenizer,
    )  # fmt: skip

    phases = {"gen": 0.0, "ref": 0.0}
    gen, logps = trainer._generate, trainer._get_per_token_logps_and_entropies

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = gen(*a, **kw)
        phases["gen"] += time.perf_counter() - t0
        return out

    def timed_logps(*a, **kw):
        t0 = time.perf_counter()
        out = logps(*a, **kw)
        if not torch.is_grad_enabled():
            phases["ref"] += time.perf_counter() - t0
        return out

    trainer._generate, trainer._get_per_token_logps_and_entropies = timed_generate, timed_logps
    steps, step_logs = [], []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **kw):
            phases.update(gen=0.0, ref=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            total = time.perf_counter() - self.t0
            steps.append({
                "step_s": total, "gen_s": phases["gen"], "ref_s": phases["ref"],
                "update_s": total - phases["gen"] - phases["ref"],
            })  # fmt: skip

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:  # the per-step training log
                step_logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer.add_callback(Timer())
    trainer.train()
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    for s, log in zip(steps, step_logs, strict=False):
        s["completion_length_mean"] = log.get("completions/mean_length")
        s["reward_mean"] = log.get("reward")
    print(json.dumps({
        "steps": steps, "peak_rss_gb": rss_gb, "versions": {
            "trl": trl.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__}, "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
