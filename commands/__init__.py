"""Built-in gymv subcommands, installed as gymv_cli.commands; each registers through `gymv.commands`."""
