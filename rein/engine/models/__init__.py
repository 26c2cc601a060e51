"""Native model implementations the engine runs (the Llama family)."""
