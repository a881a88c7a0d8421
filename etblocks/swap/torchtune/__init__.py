"""Converters and glue for torchtune models (`TransformerDecoder` from torchtune's builders)."""
