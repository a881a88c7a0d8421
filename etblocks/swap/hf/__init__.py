"""Converters and glue for Hugging Face transformers models."""


def upstream_class(model_type: str, class_name: str) -> str:
    """The qualified name of a transformers family's class. Converters are registered by it, so nothing of the
    family is imported until a model of it is swapped."""
    return f"transformers.models.{model_type}.modeling_{model_type}.{class_name}"
