"""Speculative decoding's model-independent parts: draft proposals (n-gram prompt lookup) and
the rules that accept or reject drafted tokens against the target model's distributions."""
