"""Run directories: resolved config, metrics.jsonl, NeMo-Gym-format rollout logs, atomic checkpoints."""
