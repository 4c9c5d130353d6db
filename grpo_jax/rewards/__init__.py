"""Rewards: reward functions and their weighted sums (functions), verl's rule-based scorers
(scorers), and the worker pool that runs them with a timeout (pool)."""
