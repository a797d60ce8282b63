"""verinfer: make LLM inference checkable and reproducible."""

__version__ = "0.1.0"
