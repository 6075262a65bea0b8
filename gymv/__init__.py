"""gymv engine: RL post-training of vision-language models. Never imports the CLI."""

__version__ = "0.1.0"
