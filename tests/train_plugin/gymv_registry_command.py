"""A `gymv` subcommand installed the way a third-party plugin is (an entry point of `gymv.commands`); it imports
nothing, so a `gymv` started with the test plugins on its path starts as fast as without them."""


def hello(name: str = "world") -> None:
    """Say hello (a plugin's command)."""
    print(f"hello {name}")
