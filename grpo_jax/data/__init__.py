"""Prompt data: the Example row and its batches (prompts), readers of files, HF datasets and tfds
(readers), and the built-in arithmetic task (demo_task)."""
