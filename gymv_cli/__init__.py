"""The gymv command-line shell: a typer root app whose subcommands are discovered as plugins."""
