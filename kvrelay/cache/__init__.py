"""Paged KV cache: the page allocator and the KV pools."""
