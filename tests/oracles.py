"""The jnp oracles the kernel tests compare against, compiled once per shape as the engine's
step compiles them. Run op by op, every property-test example's new shapes would cost about a
second of small per-op compiles on a CPU, the kernels' own compile aside."""
import jax

from blink_jax.kernels.blocked_attention import paged_attention_blocked
from blink_jax.model import attention, gemma

paged_attention = jax.jit(attention.paged_attention_reference,
                          static_argnames=("window", "softcap", "scale"))
add_rms_norm = jax.jit(gemma.add_rms_norm, static_argnames=("eps",))
prepare_qkv = jax.jit(gemma.prepare_qkv, static_argnames=("eps", "num_heads", "num_kv_heads"))
# The CPU kernel is no jitted function of its own (it runs inside the step's): the same here.
blocked_attention = jax.jit(paged_attention_blocked,
                            static_argnames=("window", "softcap", "scale", "key_block"))
