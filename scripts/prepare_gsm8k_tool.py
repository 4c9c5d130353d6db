r"""Raw GSM8K -> verl's multi-turn tool rows (verl's examples/data_preprocess/
gsm8k_multiturn_w_tool.py layout), for configs/gsm8k_tool.py.

  python scripts/prepare_gsm8k_tool.py ../shared/data/gsm8k/train.jsonl data/gsm8k_tool/train.jsonl
  python scripts/prepare_gsm8k_tool.py ../shared/data/gsm8k/test.jsonl data/gsm8k_tool/test.jsonl

Each row: verl's system prompt (solve step by step, call `calc_gsm8k_reward` before the final
answer, answer after "####"), the question plus verl's instruction as the user turn,
data_source "openai/gsm8k", reward_model.ground_truth the number after "####", and
extra_info.tools_kwargs giving the GSM8K tool its ground truth at create time
({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": ...}}}), as verl's script writes them.
"""

import json
import os
import sys

from grpo_jax.data import readers
from grpo_jax.rewards import scorers

SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool "
    "after step by step solving the question, before generate final answer at least once and "
    "refine your answer if necessary. Put your final answer in the format of `#### <answer>`."
)


def tool_row(question: str, answer: str, index: int, split: str) -> dict:
    """One verl multi-turn GSM8K row of a raw {"question", "answer"} pair."""
    truth = scorers.gsm8k_ground_truth(answer)
    return {
        "data_source": readers.GSM8K_SOURCE,
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question + readers.VERL_GSM8K_INSTRUCTION},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer,
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
        },
    }


def main(argv):
    if len(argv) != 3:
        sys.exit(__doc__)
    src, dst = argv[1], argv[2]
    split = "test" if "test" in os.path.basename(src) else "train"
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    with open(src) as f, open(dst, "w") as out:
        for i, line in enumerate(f):
            raw = json.loads(line)
            out.write(json.dumps(tool_row(raw["question"], raw["answer"], i, split)) + "\n")
    print(f"{i + 1} rows -> {dst}")


if __name__ == "__main__":
    main(sys.argv)
