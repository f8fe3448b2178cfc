"""slide-train: fine-tune every parameter of a Hugging Face LLM on one GPU."""

from .__about__ import __version__

__all__ = ["__version__"]
