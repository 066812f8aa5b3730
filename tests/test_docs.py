"""The documentation is checked on every run: the site builds with ``mkdocs build --strict`` (a
broken link or anchor fails it, and so does a ``synctune`` command line that does not parse against
the click tree), the README is short and its commands parse, the cheap examples run as written,
the dataset card's Hub metadata loads each release, every figure the README quotes links to its
results page, and the command line's help agrees with the README."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from _optional import require_optional
from synctune.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CARD = ROOT / "dataset" / "README.md"

_spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
docs_hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_hooks)


def _mkdocs_missing() -> str | None:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocs_click  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        return f"the documentation tools are not installed ({exc}); pip install -c constraints.txt -e '.[test]'"
    return None


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=str(config.parent), env=env, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------ the site


def test_site_builds_strict(tmp_path):
    """The whole site, generated references included, builds without one warning."""
    require_optional("mkdocs", _mkdocs_missing())
    built = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr[-4000:]
    cli_page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    # the generated CLI reference has every command of the click tree
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert f'id="synctune-{name}"' in cli_page, name
        if isinstance(command, click.Group):
            for sub in command.list_commands(click.Context(command, parent=ctx)):
                assert f'id="synctune-{name}-{sub}"' in cli_page, f"{name} {sub}"
    keys = (tmp_path / "site" / "reference" / "experiment-keys" / "index.html").read_text()
    assert "memory_headroom" in keys and "confirm_rounds" in keys
    builders = (tmp_path / "site" / "guides" / "strategies" / "index.html").read_text()
    from synctune.strategy import BUILDERS
    assert all(f"<code>{name}</code>" in builders for name in BUILDERS)


def _small_site(tmp_path: Path, page: str) -> Path:
    """A one-page site with the project's hooks, to show what fails a build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the page](page.md#a-section).\n")
    (docs / "page.md").write_text("# Page\n\n## A section\n\n" + page)
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\nstrict: true\nhooks: [{ROOT / 'scripts' / 'docs_hooks.py'}]\n"
                      "validation: {links: {not_found: warn, anchors: warn}}\n"
                      "markdown_extensions: [toc]\nnav: [index.md, page.md]\n")
    return config


CLEAN = "```bash\nsynctune search experiments/quickstart.yaml --resume\n```\n"


def test_a_small_site_with_the_hooks_builds(tmp_path):
    require_optional("mkdocs", _mkdocs_missing())
    built = _build(_small_site(tmp_path, CLEAN), tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]


@pytest.mark.parametrize("page, said", [
    (CLEAN + "\nA [broken link](nowhere.md).\n", "nowhere.md"),
    (CLEAN + "\nA [broken anchor](index.md#no-such-heading).\n", "no-such-heading"),
    ("```bash\nsynctune search experiments/quickstart.yaml --no-such-option\n```\n", "--no-such-option"),
    ("Run `synctune serch experiments/quickstart.yaml`.\n", "no such command 'serch'"),
])
def test_a_broken_link_or_a_wrong_command_line_fails_the_build(tmp_path, page, said):
    require_optional("mkdocs", _mkdocs_missing())
    built = _build(_small_site(tmp_path, page), tmp_path / "site")
    assert built.returncode != 0 and said in built.stderr, built.stderr[-3000:]


# ------------------------------------------------------------------------------ command lines


def _markdown_files() -> list[Path]:
    return [README, CARD, ROOT / "experiments" / "README.md", ROOT / "experiments" / "findings" / "README.md",
            ROOT / "dashboards" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_command_line_parses():
    """README, the folders' READMEs and the docs: every `synctune ...` line parses against the click
    tree (the build checks the docs too; this also covers the files outside docs/)."""
    errors = []
    for path in _markdown_files():
        errors += [f"{path.relative_to(ROOT)}: {e}" for e in docs_hooks.check_text(path.read_text())]
    assert not errors, "\n".join(errors)
    assert len(docs_hooks.command_lines(README.read_text())) >= 10


@pytest.mark.parametrize("line, why", [
    ("synctune trial --model cnn-small --cluster local-1x2 --runtime fsdp --fsdp reshard=true", None),
    ("synctune sim memory --data DIR", None),
    ("synctune apply S.json -m cnn-small --seed 3", None),
    ("synctune report SEARCH --tracking-uri sqlite:///x.db", None),
    ("synctune lab collect --name v1", None),
    ("synctune search x.yaml --no-such-option", "No such option"),
    ("synctune strategy bild allreduce", "no such command"),
    ("synctune models a b c", "unexpected extra"),
    ("synctune trial --model", "requires an argument"),
])
def test_command_line_check(line, why):
    """The checker itself: options the old hand-kept synopsis lacked parse; wrong ones do not."""
    got = docs_hooks.check_command(shlex.split(line)[1:])
    assert (got is None) if why is None else (got is not None and why in got), got


def test_command_lines_are_found_where_they_are_written():
    text = ("```bash\nray job submit --address A -- synctune search a.yaml   # comment\n"
            "synctune models \\\n    --json > x.json\nray exec c.yaml \"synctune dataset push s3://b/r\"\n```\n"
            "Prose with `synctune ui --port 5001` and `synctune.data` (not a command).\n")
    assert [argv for _, argv in docs_hooks.command_lines(text)] == [
        ["search", "a.yaml"], ["models", "--json"], ["dataset", "push", "s3://b/r"], ["ui", "--port", "5001"]]


# ------------------------------------------------------------------------------ the README


def test_readme_is_short_and_its_first_headings_are_a_newcomers_path():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    headings = [line[3:].lower() for line in lines if line.startswith("## ")]
    for wanted, heading in zip(["install", "first search", "your own model", "cluster", "browsing results",
                                "dataset"], headings):
        assert wanted in heading, headings
    # the CPU build of torch comes before the command that would otherwise pull CUDA's
    text = README.read_text()
    assert text.index("download.pytorch.org/whl/cpu") < text.index("pip install -c constraints.txt -e .")
    # the real releases, no placeholder
    assert "example.org" not in text and "synctune dataset pull dataset/synctune-v0.3" in text


_FIGURE = re.compile(r"\b\d+\.\d+x\b|\b\d+(?:\.\d+)?%|\[\d+\.\d+, \d+\.\d+\]")


def test_every_figure_the_readme_quotes_links_to_its_source():
    """A measured figure (a speed-up, a percentage, an interval) in a README paragraph comes with a
    link to the results page that holds its commit, date and command; a confidence level is not a
    figure."""
    paragraphs = re.split(r"\n\s*\n", README.read_text())
    quoted = 0
    for paragraph in paragraphs:
        figures = [m.group(0) for m in _FIGURE.finditer(paragraph) if m.group(0) != "95%"]
        if figures:
            quoted += 1
            assert "](docs/results/" in paragraph, f"{figures} without a link to docs/results/: {paragraph[:200]}"
    assert quoted >= 1


def test_links_in_the_readme_point_to_files_that_exist():
    text = README.read_text()
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), target
        if anchor and path.endswith(".md"):
            page = (ROOT / path).read_text()
            ids = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
                   for h in re.findall(r"^#+ (.*?)(?: \{ #[^}]+ \})?$", page, re.M)}
            ids |= set(re.findall(r"\{ #([a-z0-9-]+) \}", page))
            assert anchor in ids, f"{target}: anchors {sorted(ids)}"


# ------------------------------------------------------------------------------ examples that run


PRELUDE = '''
import torch


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def my_batches(batch_size, rank, world):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randn(batch_size, 8, generator=g), torch.randint(0, 3, (batch_size,), generator=g)
'''


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def _run(argv: list[str], env: dict) -> str:
    result = CliRunner(env=env).invoke(cli, argv, catch_exceptions=False)
    assert result.exit_code == 0, f"synctune {shlex.join(argv)}: {result.output}"
    return result.output


def test_readme_own_model_commands_run(tmp_path, monkeypatch):
    """The README's workload (its model and batches filled in) and its three commands, as written."""
    text = README.read_text()
    job = next(b for b in _code_blocks(text, "python") if b.startswith("# my_job.py"))
    (tmp_path / "my_job.py").write_text(PRELUDE + job)
    monkeypatch.chdir(tmp_path)
    env = {"SYNCTUNE_HOME": str(tmp_path / "home")}
    section = text[text.index("## Your own model"):text.index("**2. Search**")]
    commands = [argv for _, argv in docs_hooks.command_lines(section)]
    assert [a[:2] for a in commands] == [["models", "-w"], ["strategy", "build"], ["strategy", "validate"]]
    for argv in commands:
        out = _run(argv, env)
    assert "ok" in out.lower() or "valid" in out.lower(), out
    assert (tmp_path / "parallax.json").is_file()


def test_cheap_doc_commands_run(tmp_path, monkeypatch):
    """Help, the zoo, a spec dump, the clusters, the builders, and the applying guide's build and
    apply, as the pages write them."""
    monkeypatch.chdir(tmp_path)
    env = {"SYNCTUNE_HOME": str(tmp_path / "home")}
    assert "search" in _run(["--help"], env)
    assert "cnn-small" in _run(["models"], env)
    assert '"variables"' in _run(["models", "cnn-small", "--json"], env)
    assert "local-2x2" in _run(["clusters"], env)
    assert "ps-hierarchical" in _run(["strategy", "builders"], env)
    applying = (ROOT / "docs" / "guides" / "applying.md").read_text()
    ran = 0
    for block in _code_blocks(applying, "bash"):
        for _, argv in docs_hooks.command_lines(f"```bash\n{block}```\n"):
            if argv[:2] == ["strategy", "build"] or argv[:1] == ["apply"]:
                _run(argv, env)
                ran += 1
    assert ran == 2
    assert (tmp_path / "train.py").is_file()


def test_dataset_reading_snippets_run(monkeypatch):
    """The README's and the card's pyarrow/pandas snippets, as written, from the repository root."""
    monkeypatch.chdir(ROOT)
    snippets = [b for path in (README, CARD) for b in _code_blocks(path.read_text(), "python")
                if "pyarrow.dataset" in b]
    assert len(snippets) == 2
    for code in snippets:
        exec(compile(code, "<snippet>", "exec"), {})  # noqa: S102 - the documentation's own code


def _card_metadata() -> dict:
    import yaml

    text = CARD.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_dataset_card_metadata_names_every_release():
    """The Hub's card metadata: a licence, and one config per release in releases.json whose
    data_files match exactly that release's Parquet files; the card's schema table has the code's
    columns."""
    import json

    meta = _card_metadata()
    assert meta["license"] == "cc-by-4.0"
    releases = {r["name"]: r for r in json.loads((ROOT / "dataset" / "releases.json").read_text())}
    configs = {c["config_name"]: c for c in meta["configs"]}
    assert set(configs) == set(releases)
    assert [c["config_name"] for c in meta["configs"] if c.get("default")] == ["synctune-v0.3"]
    for name, config in configs.items():
        (files,) = config["data_files"]
        assert files["split"] == "train"
        matched = sorted((ROOT / "dataset").glob(files["path"]))
        on_disk = sorted((ROOT / releases[name]["source"]).rglob("*.parquet"))
        assert matched == on_disk and matched, name
        assert f"`{name}`" in CARD.read_text()
    from synctune.data.record import arrow_schema

    table = CARD.read_text().split("## Schema")[1].split("\n## ")[0]
    documented = set(re.findall(r"`([a-z_0-9]+)`", "".join(line.split("|")[1] for line in table.splitlines()
                                                            if line.startswith("| `"))))
    assert documented == set(arrow_schema().names)


def test_hugging_face_datasets_loads_a_release_from_the_card(tmp_path, monkeypatch):
    """`load_dataset("dataset", NAME)` reads a release folder as it is, from the card's configs."""
    try:
        import datasets
    except ImportError as exc:
        require_optional("datasets", f"Hugging Face datasets is not installed ({exc})")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    import json

    for release in json.loads((ROOT / "dataset" / "releases.json").read_text()):
        loaded = datasets.load_dataset("dataset", release["name"], split="train", cache_dir=str(tmp_path / "cache"))
        assert loaded.num_rows == release["rows"] and "median_s" in loaded.column_names, release["name"]


# ------------------------------------------------------------------------------ help


def test_help_points_where_the_readme_points_and_groups_list_their_commands():
    ctx = click.Context(cli)
    top = cli.get_help(ctx)
    assert "synctune search experiments/quickstart.yaml" in " ".join(top.split())
    assert "synctune search experiments/quickstart.yaml" in README.read_text()
    for name in cli.list_commands(ctx):
        group = cli.get_command(ctx, name)
        if isinstance(group, click.Group):
            words = set(re.findall(r"[a-z]+", (group.help or "").lower()))
            missing = [c for c in group.list_commands(click.Context(group, parent=ctx)) if c not in words]
            assert not missing, f"synctune {name}'s help does not mention {missing}"
