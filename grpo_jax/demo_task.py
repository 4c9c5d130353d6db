"""The embedded demo task: synthetic addition questions and a character-level tokenizer.

Nothing is downloaded. `arithmetic_rows` writes questions in GSM8K's raw format
({"question": "12+7", "answer": "#### 19"}), so the demo goes through exactly the same
data pipeline, chat template, GSM8K scorer and training loop as a real GSM8K run.
`char_tokenizer` builds a Hugging Face fast tokenizer (one token per printable ASCII character,
plus pad/eos/unk and two chat-role markers) with a chat template, so train.py treats it like any
AutoTokenizer.
"""

import string

import numpy as np
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers

PAD, EOS, UNK, USER, ASSISTANT = "<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
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
    num_train: int, num_val: int, *, max_operand: int, modulus: int = 0, seed: int
) -> tuple[list[dict], list[dict]]:
    """Addition questions "a+b" with a, b uniform in [0, max_operand], as raw GSM8K rows.

    With `modulus` > 0 the question reads "a+b%m" and the answer is (a + b) mod m.

    Train and val are drawn from disjoint question sets when there are enough distinct
    questions; otherwise (tiny operand ranges) val may repeat train questions.

    Returns:
      (train_rows, val_rows), each a list of {"question", "answer"} dicts.
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
        # The answer is only the GSM8K final-answer line: the shortest response that verl's strict
        # scorer accepts, which keeps the demo's rollouts (and the run) short.
        if modulus:
            return {"question": f"{a}+{b}%{modulus}", "answer": f"#### {(a + b) % modulus}"}
        return {"question": f"{a}+{b}", "answer": f"#### {a + b}"}

    rows = [row(int(a), int(b)) for a, b in pairs_N2]
    return rows[:num_train], rows[num_train:]
