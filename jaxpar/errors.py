"""The one exception type for bad user input: caught by the CLI and printed without a traceback."""


class ConfigError(ValueError):
    """Bad configuration or input; the message names the constraint and the offending values."""
