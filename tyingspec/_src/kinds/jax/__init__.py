"""The jax kind."""
