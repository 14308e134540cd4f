"""Training: a `Recipe` says what kind of training a run is, a `Job` adds the command's arguments, the `Trainer`
runs the one loop; checkpoints go through `litgpt.checkpoint.manager`."""
