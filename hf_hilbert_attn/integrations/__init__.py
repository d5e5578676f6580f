"""Adapters to other libraries (Transformers, Accelerate). Nothing below ``ops``/``ring`` imports them."""
