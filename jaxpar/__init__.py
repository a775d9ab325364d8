"""jaxpar: hybrid parallelism for LLMs in JAX, as named meshes plus logical-axis rules."""

__version__ = "0.1.0"
