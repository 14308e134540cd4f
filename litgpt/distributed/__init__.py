"""Everything that knows about processes and devices: the runtime (ranks, printing once, barriers), Fabric and the
launcher checks, FSDP2, and the one function that applies checkpointing, compilation and sharding to a model."""
