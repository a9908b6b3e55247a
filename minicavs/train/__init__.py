"""The training product around the engine: optimizers, configs, the trainer, run directories, checkpoints,
MPI, the CLI."""
