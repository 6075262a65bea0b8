"""Training backends behind one small interface (base.TrainingBackend); torch_trainer is the plain-PyTorch one."""
