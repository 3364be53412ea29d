"""The ``diloco`` command line: a run launched (``launch.py``) and watched (``run.py``), printing
``tables.py``, keeping a run going (``keep.py``), training data (``data.py``), cloud resources
(``infra.py``) and benchmarks (``bench/``). Nothing
here imports torch until a command needs it: ``diloco --help`` answers at once."""

from __future__ import annotations

import typer

from diloco_anywhere.cli import keep, launch, run
from diloco_anywhere.cli.bench import bench_app
from diloco_anywhere.cli.common import parse_size
from diloco_anywhere.cli.data import data_app
from diloco_anywhere.cli.infra import infra_app

app = typer.Typer(
    rich_markup_mode=None,  # plain click help: readable at 80 columns (rich squeezes it)
    help="DiLoCo training across platforms that share nothing but an object store.",
    no_args_is_help=True,
    add_completion=False,
)
for command in (launch.launch, run.status, run.logs, run.stop, keep.keep, keep.replace, run.report,
                run.export):  # fmt: skip
    app.command()(command)
app.add_typer(data_app, name="data")
app.add_typer(infra_app, name="infra")
app.add_typer(bench_app, name="bench")

__all__ = ["app", "parse_size"]
