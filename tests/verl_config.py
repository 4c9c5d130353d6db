"""verl 0.9.1's trainer defaults, read in the reference worker (tests/reference.py): the resolved
YAML that `main_ppo` starts from (verl/trainer/config/_generated_ppo_trainer.yaml). This file runs
under verl's interpreter and imports only the standard library at the top.
"""

from __future__ import annotations


def trainer_defaults() -> dict:
    """Every leaf of the generated trainer YAML as {"dotted.path": value}, `_target_`s left out."""
    import verl
    import yaml

    with open(f"{verl.__path__[0]}/trainer/config/_generated_ppo_trainer.yaml") as f:
        tree = yaml.safe_load(f)
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif key != "_target_":
                flat[prefix + key] = value

    walk(tree, "")
    return flat


def router_replay_modes() -> dict:
    """verl's engine RouterReplayConfig (actor.megatron / actor.veomni .router_replay): its
    default mode and which of a few candidate modes it accepts."""
    from verl.workers.config import EngineRouterReplayConfig

    accepted = []
    for mode in ("disabled", "R2", "R3", "R1", "record", "replay", "r3"):
        try:
            EngineRouterReplayConfig(mode=mode)
        except ValueError:
            continue
        accepted.append(mode)
    return {"default": EngineRouterReplayConfig().mode, "accepted": accepted}
