"""The supervised warm-up (warmup.steps) hands the loop a state where the run planned it."""

import jax
import pytest

from grpo_jax import config, model, sharding
from grpo_jax.data import demo_task, prompts
from grpo_jax.trainer import setup, warmup


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 CPU devices (tests/conftest.py)")
@pytest.mark.parametrize("devices", [1, 4])
def test_the_warmed_up_state_keeps_the_planned_shardings(devices):
    """jit picks its outputs' shardings: on one device the warm-up's state came back
    replicated (PartitionSpec()), so a fresh run's update programs were compiled for other
    shardings than a resumed run's, and missed the compilation cache. It comes back on exactly
    the planned shardings (the FSDP mesh's too)."""
    tok = demo_task.char_tokenizer()
    examples = [prompts.Example(f"{i}+1=", str(i + 1), answer=str(i + 1)) for i in range(8)]
    train_set = prompts.encode(tok, examples, max_prompt_length=8,
                               filter_overlong_prompts=False, truncation="error")  # fmt: skip
    run = config.RunConfig(
        data=config.DataConfig(train_batch_size=4, max_prompt_length=8, max_response_length=4),
        actor=config.ActorConfig(ppo_mini_batch_size=4),
        warmup=config.WarmupConfig(steps=2, batch_size=4),
    )
    model_config = model.ModelConfig.tiny()
    mesh = sharding.make_mesh((1, devices, 1), devices=jax.devices()[:devices])
    tx, _ = setup.make_optimizer(run, 2)
    layout = setup.state_layout(run, model_config, mesh, sharding.LOGICAL_RULES, tx)
    state, _ = setup.init_state(run, layout, model.init_params(model_config, jax.random.key(0)), tx)
    with sharding.use_mesh(mesh, sharding.LOGICAL_RULES):
        warmed, row = warmup.warm_up(run, state, tx, train_set, tok, mesh, eos_id=2, pad_id=0,
                                     micro_rows=4, model_config=model_config)  # fmt: skip
    assert row["warmup/steps"] == 2 and int(warmed.step) == 0
    got = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, warmed))
    want = jax.tree.leaves(layout.state_shardings)
    leaves = jax.tree.leaves(warmed)
    assert len(got) == len(want) == len(leaves)
    sharded = 0
    for x, g, w in zip(leaves, got, want, strict=True):
        assert g == w, (g, w)
        sharded += w.spec != jax.sharding.PartitionSpec()
    assert sharded > 0  # the weights and their moments have FSDP specs
