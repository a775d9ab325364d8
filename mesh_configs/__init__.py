"""The strategy catalogue: one TOML file per strategy ([mesh] sizes, [options]). Installed as the
package `jaxpar.mesh_configs` so that `--mesh NAME` works from a wheel too (jaxpar/core/strategy.py)."""
