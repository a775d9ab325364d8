"""The `jaxpar` command line: the parser, what each command does, argument resolution, local launches."""
