"""Static bash, zsh and fish completion scripts generated from the live command tree.

The scripts hold the whole tree (subcommands, options, which options take a value, choices, path
arguments), the built-in environment names and model architectures, and every recipe key (for
`gymv train RECIPE key=value`) as data, so pressing TAB never starts Python: no interpreter start-up, no
plugin imports, no warnings printed into the prompt. The one dynamic value, suite names, is listed by the shell itself from
`<recipes dir>/suites/*.txt` (the `--recipes-dir` given on the line, else `recipes`). The price is that the
scripts go stale when commands change; `gymv completion --check completions` (and a test) says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymv_cli.plugins import COMMANDS

PROG = "gymv"
SHELLS = ("bash", "zsh", "fish")
FILENAMES = {"bash": "gymv.bash", "zsh": "_gymv", "fish": "gymv.fish"}
REFRESH = "gymv completion --write completions"
_SAFE_WORD = re.compile(r"[A-Za-z0-9_.:/+@%,=-]+")


@dataclass
class Option:
    names: list[str]
    takes_value: bool
    kind: str  # how to complete its value: files, dirs, suites, none (numbers), choice:<words>
    help: str


@dataclass
class Command:
    path: tuple[str, ...]
    help: str
    options: list[Option] = field(default_factory=list)
    args: list[tuple[str, bool]] = field(default_factory=list)  # (kind, variadic) per positional argument
    subcommands: list[Command] = field(default_factory=list)

    @property
    def key(self) -> str:
        return " ".join(self.path)

    def walk(self):
        yield self
        for sub in self.subcommands:
            yield from sub.walk()


def _short(text: str | None, limit: int = 72) -> str:
    text = " ".join((text or "").split())
    m = re.search(r"(?<=[.!?])\s", text)
    if m:
        text = text[:m.start()]
    text = text.rstrip(".")
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def env_names() -> list[str]:
    """Built-in environments and their NeMo Gym aliases (plugins are not installed where scripts are generated)."""
    from gymv.envs.registry import ALIASES, BUILTINS

    return sorted({*BUILTINS, *ALIASES})


def model_archs() -> list[str]:
    from gymv.models.tiny import ARCHES

    return sorted(ARCHES)


def override_keys() -> list[str]:
    """Every recipe key as `dotted.key=`, across all algorithms (what `gymv train RECIPE` accepts after it)."""
    from pydantic import BaseModel

    from gymv.config.schema import MODELS

    keys: set[str] = set()

    def walk(model: type, prefix: str) -> None:
        for name, f in model.model_fields.items():
            key = prefix + (f.alias or name)
            sub = f.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                walk(sub, key + ".")
            else:
                keys.add(key + "=")

    for model in MODELS.values():
        walk(model, "")
    return sorted(keys)


def _kind(param: Any) -> str:
    """How to complete a parameter's value, across typer's own descriptors and plain click types."""
    metavar = (getattr(param, "metavar", None) or "").upper()
    if "SUITE" in metavar:
        return "suites"
    if metavar == "ENV":
        return "choice:" + " ".join(env_names())
    if metavar == "ARCH":
        return "choice:" + " ".join(model_archs())
    if "KEY=VALUE" in metavar:
        return "keys"
    td = getattr(param, "type_descriptor", None)
    if td is not None:
        choices = td.choices
        if choices:
            words = [str(getattr(c, "value", c)) for c in choices]
            if all(_SAFE_WORD.fullmatch(w) for w in words):
                return "choice:" + " ".join(words)
        if td.annotation in (int, float):
            return "none"
        info = td.parameter_info
        if td.is_path and getattr(info, "dir_okay", True) and not getattr(info, "file_okay", True):
            return "dirs"
        return "files"
    ptype = getattr(param, "type", None)
    choices = getattr(ptype, "choices", None)
    if choices and all(_SAFE_WORD.fullmatch(str(c)) for c in choices):
        return "choice:" + " ".join(map(str, choices))
    if getattr(ptype, "name", None) in ("integer", "float", "integer range", "float range"):
        return "none"
    if getattr(ptype, "dir_okay", False) and not getattr(ptype, "file_okay", True):
        return "dirs"
    return "files"


def _context(command: Any, name: str, parent: Any | None):
    ctx_class = getattr(command, "context_class", None)
    if ctx_class is None:  # pragma: no cover - plain click
        import click

        ctx_class = click.Context
    return ctx_class(command, info_name=name, parent=parent, **(getattr(command, "context_settings", None) or {}))


def command_tree(root: Any, *, only: set[str] | None = None) -> Command:
    """The completion-relevant shape of a click/typer command; `only` restricts the top-level subcommands."""

    def visit(cmd: Any, path: tuple[str, ...], parent_ctx: Any) -> Command:
        ctx = _context(cmd, path[-1] if path else PROG, parent_ctx)
        node = Command(path, _short(getattr(cmd, "short_help", None) or getattr(cmd, "help", None)))
        for p in cmd.get_params(ctx):
            if getattr(p, "hidden", False):
                continue
            opts = list(getattr(p, "opts", [])) + list(getattr(p, "secondary_opts", []))
            opts.sort(key=lambda o: not o.startswith("--"))  # stable: click may hold help names in a set
            if type(p).__name__.endswith("Argument") or not any(o.startswith("-") for o in opts):
                node.args.append((_kind(p), getattr(p, "nargs", 1) == -1))
                continue
            takes_value = not (getattr(p, "is_flag", False) or getattr(p, "count", False))
            node.options.append(Option(opts, takes_value, _kind(p) if takes_value else "", _short(getattr(p, "help", ""))))
        subs = getattr(cmd, "commands", None) or {}
        for name in subs:
            if path == () and only is not None and name not in only:
                continue
            sub = subs[name]
            if getattr(sub, "hidden", False):
                continue
            node.subcommands.append(visit(sub, path + (name,), ctx))
        return node

    return visit(root, (), None)


def builtin_command_names() -> list[str]:
    """Commands this distribution itself declares (the command registry's built-ins)."""
    return list(COMMANDS.builtins)


def live_root(root: Any | None = None, *, builtin_only: bool) -> tuple[Command, list[str]]:
    """The tree of `root` (default: the app built as `gymv` builds it), plus built-in commands that failed to load."""
    if root is None:
        import typer

        from gymv_cli.main import build_app

        root = typer.main.get_command(build_app())
    builtins = builtin_command_names()
    loaded = set(getattr(root, "commands", {}) or {})
    missing = [n for n in builtins if n not in loaded]
    return command_tree(root, only=set(builtins) if builtin_only else None), missing


# -- renderers ----------------------------------------------------------------------------------------

_HEADER = """\
{comment} {shell} completion for gymv. Generated by `gymv completion {shell}` from the command tree; do not edit.
{comment} Refresh after changing commands: {refresh}
"""


def _sq(text: str) -> str:
    """POSIX single-quoted string."""
    return "'" + text.replace("'", "'\\''") + "'"


def _arg_cases(node: Command) -> list[tuple[str, str]]:
    """(case pattern suffix, kind) for positional arguments: fixed positions first, then the variadic one."""
    out = []
    for i, (kind, variadic) in enumerate(node.args):
        out.append(("*" if variadic else str(i), kind))
        if variadic:
            break
    return out


def render_bash(tree: Command) -> str:
    nodes = list(tree.walk())
    lines = [_HEADER.format(comment="#", shell="bash", refresh=REFRESH)]
    lines.append("# Install: source this file from ~/.bashrc, or copy it to ~/.local/share/bash-completion/completions/gymv\n")
    lines.append("_gymv_subcommands() {\n    case \"$1\" in")
    for n in nodes:
        if n.subcommands:
            lines.append(f"        {_sq(n.key)}) echo {_sq(' '.join(s.path[-1] for s in n.subcommands))} ;;")
    lines.append("    esac\n}\n")
    lines.append("_gymv_options() {\n    case \"$1\" in")
    for n in nodes:
        names = [name for o in n.options for name in o.names]
        if names:
            lines.append(f"        {_sq(n.key)}) echo {_sq(' '.join(names))} ;;")
    lines.append("    esac\n}\n")
    lines.append("# How to complete an option's value; empty output means the option is a flag.")
    lines.append("_gymv_value_kind() {\n    case \"$1|$2\" in")
    for n in nodes:
        for o in n.options:
            if o.takes_value:
                pattern = "|".join(_sq(f"{n.key}|{name}") for name in o.names)
                lines.append(f"        {pattern}) echo {_sq(o.kind)} ;;")
    lines.append("    esac\n}\n")
    lines.append("# How to complete the Nth (0-based) positional argument of a command.")
    lines.append("_gymv_arg_kind() {\n    case \"$1|$2\" in")
    for n in nodes:
        for suffix, kind in _arg_cases(n):
            pattern = _sq(f"{n.key}|") + ("*" if suffix == "*" else _sq(suffix))
            lines.append(f"        {pattern}) echo {_sq(kind)} ;;")
    lines.append("    esac\n}\n")
    lines.append("# Recipe keys, offered as `key=` for overrides.")
    lines.append(f"_gymv_keys() {{\n    echo {_sq(' '.join(override_keys()))}\n}}\n")
    lines.append(_BASH_MAIN)
    return "\n".join(lines)


_BASH_MAIN = r'''_gymv_complete_kind() {
    local kind="$1" cur="$2" recipes_dir="$3" names="" s
    case "$kind" in
        choice:*) COMPREPLY=( $(compgen -W "${kind#choice:}" -- "$cur") ) ;;
        dirs) compopt -o filenames 2>/dev/null; COMPREPLY=( $(compgen -d -- "$cur") ) ;;
        suites)
            for s in "$recipes_dir"/suites/*.txt; do
                [ -e "$s" ] || continue
                s="${s##*/}"
                names="$names ${s%.txt}"
            done
            compopt -o filenames 2>/dev/null
            COMPREPLY=( $(compgen -W "$names" -- "$cur") $(compgen -f -- "$cur") ) ;;
        keys)
            # bash splits KEY=VALUE at '=': after it comes a value, which has no completion
            [ "${COMP_WORDS[COMP_CWORD-1]}" = "=" ] && { COMPREPLY=(); return; }
            compopt -o nospace 2>/dev/null
            COMPREPLY=( $(compgen -W "$(_gymv_keys)" -- "$cur") ) ;;
        none) COMPREPLY=() ;;
        *) compopt -o filenames 2>/dev/null; COMPREPLY=( $(compgen -f -- "$cur") ) ;;
    esac
}

_gymv() {
    local cur="${COMP_WORDS[COMP_CWORD]}" cmdpath="" word expect="" recipes_dir="recipes" npos=0 i=1
    while [ "$i" -lt "$COMP_CWORD" ]; do
        word="${COMP_WORDS[i]}"
        i=$((i + 1))
        if [ -n "$expect" ]; then
            [ "$word" = "=" ] && continue
            [ "$expect" = "--recipes-dir" ] && recipes_dir="$word"
            expect=""
        elif [[ "$word" == -* ]]; then
            if [[ "$word" == --recipes-dir=* ]]; then
                recipes_dir="${word#*=}"
            elif [[ "$word" != *=* ]] && [ -n "$(_gymv_value_kind "$cmdpath" "$word")" ]; then
                expect="$word"
            fi
        elif [[ " $(_gymv_subcommands "$cmdpath") " == *" $word "* ]]; then
            cmdpath="${cmdpath:+$cmdpath }$word"
            npos=0
        else
            npos=$((npos + 1))
        fi
    done
    [ "$cur" = "=" ] && cur=""
    local opt=""
    if [ -n "$expect" ]; then
        opt="$expect"
    elif [[ "$cur" == --*=* ]]; then
        opt="${cur%%=*}"
        cur="${cur#*=}"
    fi
    if [ -n "$opt" ]; then
        _gymv_complete_kind "$(_gymv_value_kind "$cmdpath" "$opt")" "$cur" "$recipes_dir"
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=( $(compgen -W "$(_gymv_options "$cmdpath")" -- "$cur") )
    elif [ -n "$(_gymv_subcommands "$cmdpath")" ]; then
        COMPREPLY=( $(compgen -W "$(_gymv_subcommands "$cmdpath")" -- "$cur") )
    else
        local kind
        kind="$(_gymv_arg_kind "$cmdpath" "$npos")"
        [ -n "$kind" ] && _gymv_complete_kind "$kind" "$cur" "$recipes_dir"
    fi
    return 0
}

complete -F _gymv gymv
'''


def _zsh_item(name: str, help_text: str) -> str:
    return _sq(name.replace(":", r"\:") + (":" + help_text if help_text else ""))


def render_zsh(tree: Command) -> str:
    nodes = list(tree.walk())
    lines = ["#compdef gymv", _HEADER.format(comment="#", shell="zsh", refresh=REFRESH)]
    lines.append("# Install: put this file, named _gymv, in a directory on $fpath before compinit runs, or source it\n")
    lines.append("_gymv_subcommands() {\n    reply=()\n    case \"$1\" in")
    for n in nodes:
        if n.subcommands:
            items = " ".join(_zsh_item(s.path[-1], s.help) for s in n.subcommands)
            lines.append(f"        {_sq(n.key)}) reply=({items}) ;;")
    lines.append("    esac\n}\n")
    lines.append("_gymv_options() {\n    reply=()\n    case \"$1\" in")
    for n in nodes:
        items = " ".join(_zsh_item(name, o.help) for o in n.options for name in o.names)
        if items:
            lines.append(f"        {_sq(n.key)}) reply=({items}) ;;")
    lines.append("    esac\n}\n")
    lines.append("_gymv_value_kind() {\n    REPLY=''\n    case \"$1|$2\" in")
    for n in nodes:
        for o in n.options:
            if o.takes_value:
                pattern = "|".join(_sq(f"{n.key}|{name}") for name in o.names)
                lines.append(f"        {pattern}) REPLY={_sq(o.kind)} ;;")
    lines.append("    esac\n}\n")
    lines.append("_gymv_arg_kind() {\n    REPLY=''\n    case \"$1|$2\" in")
    for n in nodes:
        for suffix, kind in _arg_cases(n):
            pattern = _sq(f"{n.key}|") + ("*" if suffix == "*" else _sq(suffix))
            lines.append(f"        {pattern}) REPLY={_sq(kind)} ;;")
    lines.append("    esac\n}\n")
    lines.append(f"_gymv_keys=({' '.join(_sq(k) for k in override_keys())})\n")
    lines.append(_ZSH_MAIN)
    return "\n".join(lines)


_ZSH_MAIN = r'''_gymv_complete_kind() {
    local kind="$1" recipes_dir="$2"
    local -a suites
    case "$kind" in
        choice:*) compadd -- ${=kind#choice:} ;;
        dirs) _files -/ ;;
        suites)
            suites=( "$recipes_dir"/suites/*.txt(N:t:r) )
            (( ${#suites} )) && compadd -- $suites
            _files ;;
        keys) [[ "${words[CURRENT]}" == *=* ]] || compadd -S '' -- $_gymv_keys ;;
        none) _message 'a number' ;;
        *) _files ;;
    esac
}

_gymv() {
    local cmdpath="" word expect="" recipes_dir="recipes" npos=0 i REPLY
    local -a reply
    for (( i = 2; i < CURRENT; i++ )); do
        word="${words[i]}"
        if [[ -n "$expect" ]]; then
            [[ "$expect" == --recipes-dir ]] && recipes_dir="$word"
            expect=""
        elif [[ "$word" == -* ]]; then
            if [[ "$word" == --recipes-dir=* ]]; then
                recipes_dir="${word#*=}"
            elif [[ "$word" != *=* ]]; then
                _gymv_value_kind "$cmdpath" "$word"
                [[ -n "$REPLY" ]] && expect="$word"
            fi
        else
            _gymv_subcommands "$cmdpath"
            if (( ${reply[(I)${word}(|:*)]} )); then
                cmdpath="${cmdpath:+$cmdpath }$word"
                npos=0
            else
                npos=$(( npos + 1 ))
            fi
        fi
    done
    local cur="${words[CURRENT]}" opt=""
    if [[ -n "$expect" ]]; then
        opt="$expect"
    elif [[ "$cur" == --*=* ]]; then
        opt="${cur%%=*}"
        compset -P '*='
    fi
    if [[ -n "$opt" ]]; then
        _gymv_value_kind "$cmdpath" "$opt"
        _gymv_complete_kind "$REPLY" "$recipes_dir"
    elif [[ "$cur" == -* ]]; then
        _gymv_options "$cmdpath"
        _describe -t options 'gymv option' reply
    else
        _gymv_subcommands "$cmdpath"
        if (( ${#reply} )); then
            _describe -t commands 'gymv command' reply
        else
            _gymv_arg_kind "$cmdpath" "$npos"
            [[ -n "$REPLY" ]] && _gymv_complete_kind "$REPLY" "$recipes_dir"
        fi
    fi
}

if [[ "${funcstack[1]}" == _gymv ]]; then
    _gymv "$@"
else
    compdef _gymv gymv
fi
'''


def _fish_sq(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render_fish(tree: Command) -> str:
    nodes = list(tree.walk())
    out = [_HEADER.format(comment="#", shell="fish", refresh=REFRESH)]
    out.append("# Install: copy this file to ~/.config/fish/completions/gymv.fish\n")
    subs = [f"{n.key}|{s.path[-1]}" for n in nodes for s in n.subcommands]
    valued = [f"{n.key}|{name}" for n in nodes for o in n.options if o.takes_value for name in o.names]
    out.append("set -g __gymv_subcommands " + " ".join(_fish_sq(s) for s in subs))
    out.append("set -g __gymv_value_options " + " ".join(_fish_sq(s) for s in valued))
    out.append("set -g __gymv_keys " + " ".join(_fish_sq(k) for k in override_keys()) + "\n")
    out.append(_FISH_FUNCTIONS)
    out.append("complete -c gymv -f")
    for n in nodes:
        at = f"__gymv_at {_fish_sq(n.key)}"
        for s in n.subcommands:
            desc = f" -d {_fish_sq(s.help)}" if s.help else ""
            out.append(f"complete -c gymv -n {_fish_sq(at)} -a {_fish_sq(s.path[-1])}{desc}")
        for o in n.options:
            flags = " ".join(_fish_flag(name) for name in o.names)
            value = ""
            if o.takes_value:
                value = " -r" + _fish_value(o.kind)
            desc = f" -d {_fish_sq(o.help)}" if o.help else ""
            out.append(f"complete -c gymv -n {_fish_sq(at)} {flags}{value}{desc}")
        for suffix, kind in _arg_cases(n):
            cond = f"{at}; and __gymv_argpos {_fish_sq(suffix)}"
            out.append(f"complete -c gymv -n {_fish_sq(cond)}{_fish_value(kind)}")
    return "\n".join(out) + "\n"


def _fish_flag(name: str) -> str:
    if name.startswith("--"):
        return f"-l {name[2:]}"
    return f"-s {name[1:]}" if len(name) == 2 else f"-o {name[1:]}"


def _fish_value(kind: str) -> str:
    if kind.startswith("choice:"):
        return " -a " + _fish_sq(kind[len("choice:"):])
    if kind == "dirs":
        return " -a " + _fish_sq("(__fish_complete_directories (commandline -ct))")
    if kind == "suites":
        return " -F -a " + _fish_sq("(__gymv_suites)")
    if kind == "none":
        return ""
    if kind == "keys":
        return " -a " + _fish_sq("(__gymv_complete_keys)")
    return " -F"


_FISH_FUNCTIONS = r'''# Prints the command path (e.g. "env serve"), then the index of the positional argument being typed.
function __gymv_state
    set -l tokens (commandline -opc)
    set -e tokens[1]
    set -l cmdpath ""
    set -l npos 0
    set -l expect 0
    for w in $tokens
        if test $expect = 1
            set expect 0
        else if string match -q -- '-*' $w
            if not string match -q -- '*=*' $w; and contains -- "$cmdpath|$w" $__gymv_value_options
                set expect 1
            end
        else if contains -- "$cmdpath|$w" $__gymv_subcommands
            set cmdpath (string trim -- "$cmdpath $w")
            set npos 0
        else
            set npos (math $npos + 1)
        end
    end
    echo $cmdpath
    echo $npos
end

function __gymv_at
    set -l state (__gymv_state)
    test "$state[1]" = "$argv[1]"
end

function __gymv_argpos
    set -l state (__gymv_state)
    test "$argv[1]" = '*'; or test "$state[2]" = "$argv[1]"
end

function __gymv_complete_keys
    string match -q -- '*=*' (commandline -ct); or printf '%s\n' $__gymv_keys
end

function __gymv_suites
    set -l tokens (commandline -opc)
    set -l dir recipes
    for i in (seq (count $tokens))
        if test "$tokens[$i]" = --recipes-dir; and test $i -lt (count $tokens)
            set dir $tokens[(math $i + 1)]
        else if string match -q -- '--recipes-dir=*' $tokens[$i]
            set dir (string replace -- '--recipes-dir=' '' $tokens[$i])
        end
    end
    for f in $dir/suites/*.txt
        basename $f .txt
    end
end
'''

RENDERERS = {"bash": render_bash, "zsh": render_zsh, "fish": render_fish}


def render(shell: str, tree: Command) -> str:
    return RENDERERS[shell](tree)


def write_scripts(directory: str | Path, tree: Command) -> list[Path]:
    from gymv.io import atomic_write_text

    directory = Path(directory)
    written = []
    for shell in SHELLS:
        path = directory / FILENAMES[shell]
        atomic_write_text(path, render(shell, tree))
        written.append(path)
    return written


def stale_scripts(directory: str | Path, tree: Command) -> list[Path]:
    """Committed scripts that differ from (or are missing next to) freshly generated ones."""
    directory = Path(directory)
    stale = []
    for shell in SHELLS:
        path = directory / FILENAMES[shell]
        if not path.is_file() or path.read_text(encoding="utf-8") != render(shell, tree):
            stale.append(path)
    return stale
