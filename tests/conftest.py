"""Test session setup: XLA's command-buffer flags must precede JAX's GPU client."""
from blink_jax.xla_flags import configure_command_buffers

configure_command_buffers()
