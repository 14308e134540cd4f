"""Kinds of training beyond the base `litgpt.train.recipe.Recipe` (pretraining and finetuning), one module each."""
