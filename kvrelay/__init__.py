"""kvrelay: an LLM serving engine with prefill-decode disaggregation."""
