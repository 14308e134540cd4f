"""Training: a `Recipe` says what kind of training a run is (its models and its `Objective`), a `Job` adds the
command's arguments, the `Trainer` runs the one loop on the objective; checkpoints go through
`litgpt.checkpoint.manager`."""
