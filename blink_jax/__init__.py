"""blink-jax: a JAX-native LLM inference server for Gemma models."""
