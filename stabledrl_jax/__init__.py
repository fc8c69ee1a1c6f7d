"""stabledrl_jax: stable RL post-training of diffusion language models in JAX."""
