"""The dense Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3): model, step, graphs and its side
of the runner contract (runnable.py)."""
