"""``diloco bench ...``: measured numbers (docs/benchmarks.md), never timed tests.

The commands live by group (store.py; data.py; sync.py: sync and sharded; training.py: the
benches that train runs), and each imports its bench's code (torch and the rest) only when it runs.
"""

from __future__ import annotations

import typer

from diloco_anywhere.cli.bench.checkpoint import bench_checkpoint_command
from diloco_anywhere.cli.bench.data import bench_data_command
from diloco_anywhere.cli.bench.gpu import bench_gpu_command
from diloco_anywhere.cli.bench.store import bench_codecs_command, bench_store_command
from diloco_anywhere.cli.bench.sync import bench_sharded_command, bench_sync_command
from diloco_anywhere.cli.bench.training import (
    bench_chaos_command,
    bench_convergence_command,
    bench_hetero_command,
    bench_overlap_command,
    bench_throughput_command,
    bench_unattended_command,
)

bench_app = typer.Typer(
    rich_markup_mode=None,  # plain click help: readable at 80 columns (rich squeezes it)
    help="Benchmarks: measured numbers (docs/benchmarks.md), never timed tests.",
    no_args_is_help=True,
)
# in this order in `diloco bench --help`
bench_app.command("store")(bench_store_command)
bench_app.command("codecs")(bench_codecs_command)
bench_app.command("data")(bench_data_command)
bench_app.command("sync")(bench_sync_command)
bench_app.command("sharded")(bench_sharded_command)
bench_app.command("checkpoint")(bench_checkpoint_command)
bench_app.command("convergence")(bench_convergence_command)
bench_app.command("overlap")(bench_overlap_command)
bench_app.command("throughput")(bench_throughput_command)
bench_app.command("hetero")(bench_hetero_command)
bench_app.command("chaos")(bench_chaos_command)
bench_app.command("unattended")(bench_unattended_command)
bench_app.command("gpu")(bench_gpu_command)
