"""`specforge-csbp` command line. Each sub-module with a `register(subparsers)` function is a subcommand."""
