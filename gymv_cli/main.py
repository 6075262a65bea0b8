"""Root app: global flags, plugin mounting, and the one place errors become one-line messages."""

from __future__ import annotations

import os
import sys

import typer

try:  # newer typer vendors click under typer._click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer uses click itself
    from click.exceptions import ClickException

import gymv
from gymv.errors import GymvError
from gymv_cli.plugins import mount_plugins

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(f"gymv {gymv.__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="gymv",
        help=(
            "RL post-training of vision-language models on multimodal, multi-turn, tool-calling environments.\n\n"
            "Example: gymv prepare circle-count --n 256 --out data/train.jsonl"
        ),
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def root(
        version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
        debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors (allowed anywhere on the line)."),
    ) -> None:
        _state["debug"] = _state["debug"] or debug

    mount_plugins(app)
    return app


def split_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Take `--debug` out of argv wherever it stands (before or after the subcommand, never after `--`), so
    that `gymv prepare ... --debug` works as the error messages promise."""
    cut = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:cut] if a != "--debug"]
    return head + argv[cut:], len(head) < cut


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    argv, _state["debug"] = split_debug(list(argv))
    if _state["debug"]:
        os.environ["GYMV_DEBUG"] = "1"  # the engine then prints what it would summarise (a worker's traceback)
    app = build_app()
    command = typer.main.get_command(app)
    try:
        rc = command.main(args=argv, prog_name="gymv", standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except GymvError as e:
        if _state["debug"]:
            raise
        print(f"error: {e.one_line()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if _state["debug"]:
            raise
        print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
