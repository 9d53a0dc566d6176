"""The model: Gemma 2/3 configurations (`config`), the Flax NNX Gemma (`gemma`), the jnp
reference paged attention (`attention`) and on-device sampling (`sampling`). Every fast kernel
under `blink_jax.kernels` has its jnp oracle here, with the same signature."""
