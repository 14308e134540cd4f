"""litgpt: pretrain, finetune and serve large language models with Lightning Fabric and PyTorch."""

# Kept import-free so that `litgpt --help` starts fast; import litgpt.model / litgpt.config directly.
__version__ = "0.1.0"
