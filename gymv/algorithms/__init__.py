"""Algorithm math: advantages, per-token losses, importance sampling, health metrics, and the loss
functions the trainer calls (GRPO policy loss, SFT, MOPD distillation). Pure torch, every reduction masked."""
