"""verl 0.9.1's RLHFDataset (verl/utils/dataset/rl_dataset.py), run in the reference worker
(tests/reference.py): which rows data.train_max_samples / val_max_samples keep. This file runs
under verl's interpreter and imports only the standard library at the top.
"""

from __future__ import annotations


def kept_rows(path: str, max_samples: int, shuffle: bool, seed, cache_dir: str) -> list[int]:
    """The `extra_info.index` of the rows RLHFDataset keeps of the jsonl file `path`, in its
    order, with data.shuffle / data.seed as given (the overlong filter off: it needs no
    tokenizer)."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = OmegaConf.create(
        {"shuffle": shuffle, "seed": seed, "filter_overlong_prompts": False, "cache_dir": cache_dir}
    )
    ds = RLHFDataset(data_files=path, tokenizer=None, config=cfg, max_samples=max_samples)
    return [int(info["index"]) for info in ds.dataframe["extra_info"]]
