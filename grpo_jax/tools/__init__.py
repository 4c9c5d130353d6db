"""Tools a model calls during a multi-turn rollout, with verl 0.9.1's interface: the tool class and
its schema (base), the tool YAML (loading), the "hermes" call format (hermes), running calls
off the rollout's thread with timeouts (executor), and verl's GSM8K answer tool (gsm8k)."""
