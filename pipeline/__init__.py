"""eaglepipe: target LLM -> aux hidden states -> EAGLE-3 draft -> serving-ready export."""

__version__ = "0.1.0"
