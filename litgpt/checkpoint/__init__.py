"""Checkpoints: a model's folder (`model_files`), a run's step folders on disk (`store`), the interface a strategy
implements to read and write its shards (`interface`, FSDP2's in `fsdp_io`), and the one component that saves,
publishes, verifies, prunes, finds and restores a run's checkpoints (`manager`)."""
