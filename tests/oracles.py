"""The jnp oracles the kernel tests compare against, compiled once per shape as the engine's
step compiles them. Run op by op, every property-test example's new shapes would cost about a
second of small per-op compiles on a CPU, the kernels' own compile aside."""
import jax

from blink_jax.model import attention, gemma

paged_attention = jax.jit(attention.paged_attention_reference,
                          static_argnames=("window", "softcap", "scale"))
add_rms_norm = jax.jit(gemma.add_rms_norm, static_argnames=("eps",))
prepare_qkv = jax.jit(gemma.prepare_qkv, static_argnames=("eps", "num_heads", "num_kv_heads"))
