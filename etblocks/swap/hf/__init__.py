"""Converters and glue for Hugging Face transformers models."""
