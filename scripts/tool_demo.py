r"""Does GRPO with tools learn? A tiny model, sums, and a calculator it may call.

  python scripts/tool_demo.py [--steps 150] [--seed 0] [--workdir runs/tool_demo]

A random 2-layer transformer with the character tokenizer (configs/demo.py:tiny's model) sees
sums "a+b" (a, b in [0, 30]) with the calculator tool (grpo_jax/tools/calculator.py) listed in
its prompt. A supervised warm-up teaches half the questions to answer "#### <sum>" at once and
the other half to call the calculator (`<tool_call>{"name": "calculator", "arguments":
{"expression": "a+b"}}</tool_call>`); nothing teaches what to write after the tool's answer.
Then GRPO (rollout.multi_turn, at most 2 model turns, n = 8) with verl's strict GSM8K reward
on the text after the last tool response: "#### <sum>" scores 1.

Printed (and written to <workdir>/tool_demo.json): greedy validation accuracy on 64 held-out
sums and the share of validation answers that called the tool, before and after GRPO, and the
training rows' tool calls and scores over the steps. The model adds badly by itself, so the
run learns by calling the tool and copying its answer.
"""

import argparse
import json
import os
import time

import jax
import numpy as np

from grpo_jax import config, loading, sharding
from grpo_jax.data import demo_task
from grpo_jax.rewards import scorers
from grpo_jax.tools import calculator
from grpo_jax.trainer import loop, metrics


def rows(num: int, *, seed: int, max_operand: int = 30, plain: bool = False):
    """Sum questions with warm-up answers (extra_info.answer) of three kinds, a third each:
    "#### <sum>" at once; the calculator's call; and, for the question followed by that call
    and the tool's result, "#### <sum>" (a demonstration of using a tool's answer). `plain`:
    only plain questions (validation)."""
    rng = np.random.default_rng(seed)
    out = []
    for a, b in rng.integers(0, max_operand + 1, size=(num, 2)).tolist():
        question = [{"role": "user", "content": f"{a}+{b}"}]
        kind = 0 if plain else int(rng.integers(0, 3))
        call = {"type": "function", "function": {
            "name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
        prompt, answer = {
            0: (question, f"#### {a + b}"),
            1: (question, '<tool_call>{"name": "calculator", "arguments": {"expression": '
                          f'"{a}+{b}"}}}}</tool_call>'),
            2: (question + [{"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "content": str(a + b)}], f"#### {a + b}"),
        }[kind]  # fmt: skip
        out.append({
            "data_source": "tool_sum",
            "prompt": prompt,
            "reward_model": {"ground_truth": str(a + b)},
            "extra_info": {"answer": answer},
        })  # fmt: skip
    return out


def final_answer_reward(data_source, solution_str, ground_truth, extra_info=None):
    """verl's strict GSM8K score of the text after the last tool response."""
    return scorers.gsm8k_score(solution_str.rsplit("</tool_response>", 1)[-1], ground_truth)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--workdir", default="runs/tool_demo")
    args = p.parse_args()
    tok = demo_task.char_tokenizer()
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=16, val_batch_size=64, max_prompt_length=160,
                               max_response_length=160),
        actor=config.ActorConfig(ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=128,
                                 use_kl_loss=False,
                                 optim=config.OptimConfig(lr=1e-3, weight_decay=0.0)),
        rollout=config.RolloutConfig(
            n=8, log_prob_micro_batch_size_per_gpu=128,
            multi_turn=config.MultiTurnConfig(enable=True, max_assistant_turns=2)),
        reward=config.RewardConfig(num_workers=0),
        warmup=config.WarmupConfig(steps=args.warmup, batch_size=64, lr=3e-3),
        trainer=config.TrainerConfig(total_training_steps=args.steps, save_freq=-1,
                                     test_freq=max(args.steps // 3, 1), progress_bar=False,
                                     tensorboard=False, seed=args.seed,
                                     log_val_generations=4, default_local_dir=args.workdir,
                                     rollout_data_dir=os.path.join(args.workdir, "rollouts")),
    )  # fmt: skip
    spec = config.ModelSpec(source="random", tokenizer="char", path=None,
                            tiny=config.TinyModelConfig(hidden_size=128, intermediate_size=512,
                                                        head_dim=32, seed=args.seed))
    t0 = time.time()
    with sharding.use_mesh(mesh):
        model_config, params = loading.model(spec, tok, mesh, sharding.LOGICAL_RULES,
                                             max_positions=384)
        result = loop.train(run, model_config=model_config, params=params, tokenizer=tok,
                            train_data=rows(4000, seed=args.seed),
                            val_data=rows(64, seed=10_000 + args.seed, plain=True),
                            reward_fn=final_answer_reward, mesh=mesh,
                            tools=[calculator.CalculatorTool()])
    records = metrics.read(args.workdir)
    evals = [(r["step"], r["val-core/tool_sum/acc/mean@1"], r["val-aux/num_turns/mean"])
             for r in records if "val-core/tool_sum/acc/mean@1" in r]
    train = [(r["step"], r["multi_turn/tool_calls/mean"], r["critic/score/mean"])
             for r in records if "multi_turn/tool_calls/mean" in r]
    first, last = train[: max(len(train) // 10, 1)], train[-max(len(train) // 10, 1):]
    summary = {
        "validation": [
            # a call adds its tool turn and the next model turn: num_turns 2 -> 4
            {"step": s, "acc": acc, "called_tool": (turns - 2) / 2} for s, acc, turns in evals
        ],
        "train_first_10pct": {"tool_calls": float(np.mean([c for _, c, _ in first])),
                              "score": float(np.mean([s for _, _, s in first]))},
        "train_last_10pct": {"tool_calls": float(np.mean([c for _, c, _ in last])),
                             "score": float(np.mean([s for _, _, s in last]))},
        "wall_s": round(time.time() - t0, 1),
        "steps": len(result.history),
        "command": f"python scripts/tool_demo.py --steps {args.steps} --seed {args.seed}",
    }
    with open(os.path.join(args.workdir, "tool_demo.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
