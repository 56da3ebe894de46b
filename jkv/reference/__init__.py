"""Pure-jnp twins of every op: the executable spec and the CPU fallback."""
