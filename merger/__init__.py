"""merger: turn distributed training checkpoints into standalone HuggingFace models, streaming."""

__version__ = "0.1.0"
