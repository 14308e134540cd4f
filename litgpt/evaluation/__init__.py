"""`litgpt evaluate`'s parts: the lm-evaluation-harness model over our GPT."""
