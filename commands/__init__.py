"""Built-in gymv subcommands, installed as gymv_cli.commands; each is a built-in of `gymv_cli.plugins.COMMANDS`."""
