"""MkDocs hooks of the documentation site (``mkdocs.yml``): generated tables and checked commands.

Generated from the code, so the site cannot drift from it: a page's ``<!-- generated: NAME -->``
line is replaced by the table ``NAME`` (:data:`GENERATORS`): the builders registry, the keys of
an experiment file (its section classes and their ``#:`` comments) and what ``tuned`` stands for
among its builders, the dataset's Arrow schema.

Checked on every build: every ``synctune ...`` command line in a page (code blocks and inline
code) is parsed against the click tree of ``synctune.cli`` without running anything; an unknown
command or option, or an extra argument, is a warning, which ``mkdocs build --strict`` turns into
a failed build. ``tests/test_docs.py`` applies the same check to the README.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

log = logging.getLogger("mkdocs.hooks.synctune")

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"`(synctune(?:\s[^`]*)?)`")
_SHELL_STOP = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&", "2>&1"}
_MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)


# ------------------------------------------------------------------------------ command lines


def command_lines(text: str) -> list[tuple[int, list[str]]]:
    """Every ``synctune`` command line of a Markdown text: (line number, argv after ``synctune``).

    In code blocks, each line (joined with the next where it ends in a backslash) is split as a
    shell would, comments dropped, and every ``synctune`` word starts a command that runs to the
    next shell operator. Outside code blocks, inline code that starts with ``synctune `` is one.
    """
    found: list[tuple[int, list[str]]] = []
    lines = text.splitlines()
    fenced = False
    i = 0
    while i < len(lines):
        line, start = lines[i], i + 1
        if _FENCE.match(line):
            fenced = not fenced
            i += 1
            continue
        if fenced:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            found += [(start, argv) for argv in _commands_in(line)]
        else:
            for m in _INLINE.finditer(line):
                found += [(start, argv) for argv in _commands_in(m.group(1))]
        i += 1
    return found


def _commands_in(line: str) -> list[list[str]]:
    if "synctune" not in line:
        return []
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: not a shell line
        return []
    out = []
    for k, word in enumerate(words):
        if word.startswith("synctune ") and k > 0:  # a quoted command: ray exec CLUSTER "synctune ..."
            out += _commands_in(word)
            continue
        if word != "synctune" or (k > 0 and words[k - 1] not in _SHELL_STOP | {"--", "$"}):
            continue
        argv = []
        for w in words[k + 1:]:
            if w in _SHELL_STOP or w.startswith((">", "|")):
                break
            argv.append(w)
        out.append(argv)
    return out


def check_command(argv: list[str]) -> str | None:
    """Why ``synctune ARGV`` would not parse (an unknown command or option, a missing option
    value, an extra argument), or None. Only click's parser runs: no callback, no conversion,
    so placeholders such as ``MODEL`` or ``STRATEGY.json`` pass."""
    import click

    from synctune.cli import cli

    cmd: click.Command = cli
    ctx = click.Context(cli, info_name="synctune")
    args = list(argv)
    while True:
        if any(a in ("-h", "--help") for a in args):
            args = args[:next(k for k, a in enumerate(args) if a in ("-h", "--help"))]
        try:
            _, rest, _ = cmd.make_parser(ctx).parse_args(args=args)
        except click.UsageError as exc:
            return f"{ctx.command_path}: {exc.format_message()}"
        if isinstance(cmd, click.Group):
            if not rest:
                return None
            if re.fullmatch(r"[A-Z][A-Z_]*", rest[0]):  # a placeholder: synctune COMMAND --help
                return None
            sub = cmd.get_command(ctx, rest[0])
            if sub is None:
                return f"{ctx.command_path}: no such command {rest[0]!r} (commands: {', '.join(cmd.list_commands(ctx))})"
            ctx = click.Context(sub, info_name=rest[0], parent=ctx)
            cmd, args = sub, rest[1:]
            continue
        if rest and not ctx.allow_extra_args:
            return f"{ctx.command_path}: unexpected extra argument(s) {' '.join(rest)}"
        return None


def check_text(text: str) -> list[str]:
    """The command lines of ``text`` that do not parse, each as 'line N: synctune ...: why'."""
    errors = []
    for lineno, argv in command_lines(text):
        why = check_command(argv)
        if why:
            errors.append(f"line {lineno}: synctune {shlex.join(argv)}: {why}")
    return errors


# ------------------------------------------------------------------------------ generated tables


def _cell(text: str) -> str:
    """One table cell: one line, reST roles and literals as Markdown code, pipes escaped."""
    text = re.sub(r":[a-z]+:`~?([^`]*)`", r"`\1`", " ".join(str(text).split()))
    return re.sub(r"``([^`]*)``", r"`\1`", text).replace("|", "\\|")


def builders_table() -> str:
    """The builders registry: name, what it reproduces, options with their defaults."""
    from synctune.strategy import BUILDERS

    rows = ["| builder | reproduces | options (`-O key=value`), defaults |", "| --- | --- | --- |"]
    for name in BUILDERS:
        info = BUILDERS.get(name)
        opts = ", ".join(f"`{f.name}={_default(f)}`" for f in dataclasses.fields(info.options)) or "none"
        rows.append(f"| `{name}` | {_cell(info.description)} | {opts} |")
    return "\n".join(rows)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return str(f.default_factory())
    return "required"


def _field_comments(cls: type) -> dict[str, str]:
    """A dataclass's ``#:`` comments, per field, from its source."""
    import inspect

    comments: dict[str, str] = {}
    pending: list[str] = []
    shared = ""  # fields declared together under one comment share it: the first one's name
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#:"):
            pending.append(s[2:].strip())
            continue
        m = re.match(r"^([a-z_][a-z0-9_]*)\s*:", s)
        if m and pending:
            comments[m.group(1)] = " ".join(pending)
            shared = m.group(1)
        elif m and shared:
            comments[m.group(1)] = f"See `{shared}` above."
        else:
            shared = ""
        pending = []
    return comments


def experiment_keys_table() -> str:
    """Every key of an experiment file: section, key (and its flat spelling), default, meaning."""
    from synctune.search import experiment as ex

    rows = ["| section | key (flat spelling) | default | what it sets |", "| --- | --- | --- | --- |"]
    for cls in ex._Section.__subclasses__():
        comments = {}
        for klass in reversed(cls.__mro__):
            if dataclasses.is_dataclass(klass) and klass is not object:
                comments.update(_field_comments(klass))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name in cls.settings():
            flat = cls.flat_key(name)
            key = f"`{name}`" + (f" (`{flat}`)" if flat != name else "")
            field = fields[name]
            value = field.default if field.default is not dataclasses.MISSING else None
            default = _default(field)
            if isinstance(value, tuple):  # as a file writes it
                default = "[" + ", ".join(map(str, value)) + "]"
            default = "required" if default == "required" else f"`{default}`" if default != "" else '`""`'
            rows.append(f"| `{cls.KEY}` | {key} | {_cell(default)} | {_cell(_with_choices(comments.get(name, ''), ex))} |")
    return "\n".join(rows)


def _with_choices(text: str, module) -> str:
    """``text`` with each module constant it cites (``:data:`ALGORITHMS```) followed by its values."""
    def spell(m: re.Match) -> str:
        values = getattr(module, m.group(1), None)
        if isinstance(values, tuple) and values and all(isinstance(v, str) for v in values):
            return f"{m.group(0)}: " + ", ".join(f"`{v}`" for v in values)
        return m.group(0)

    return re.sub(r":data:`([A-Z_]+)`", spell, text)


def dataset_schema_table() -> str:
    """The dataset's Arrow schema (``synctune.data.record.arrow_schema``): column and type."""
    from synctune.data.record import RECORD_SCHEMA_VERSION, arrow_schema

    rows = [f"Record schema version {RECORD_SCHEMA_VERSION}.", "", "| column | Arrow type |", "| --- | --- |"]
    rows += [f"| `{f.name}` | `{f.type}` |" for f in arrow_schema()]
    return "\n".join(rows)


def tuned_baselines() -> str:
    """What ``tuned`` stands for among an experiment's builders (``TUNED_BASELINES``)."""
    from synctune.strategy.builders import TUNED_BASELINES

    return ", ".join(f"`{entry}`" for entry in TUNED_BASELINES) + "."


GENERATORS = {
    "builders": builders_table,
    "tuned-baselines": tuned_baselines,
    "experiment-keys": experiment_keys_table,
    "dataset-schema": dataset_schema_table,
}


# ------------------------------------------------------------------------------ mkdocs hooks


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - mkdocs' signature
    def generate(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            log.warning("%s: unknown generated table %r (known: %s)", page.file.src_uri, name, ", ".join(GENERATORS))
            return m.group(0)
        return GENERATORS[name]()

    markdown = _MARKER.sub(generate, markdown)
    for error in check_text(markdown):
        log.warning("%s: %s", page.file.src_uri, error)
    return markdown
