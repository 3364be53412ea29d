"""``diloco infra plan | up | output | down``: the run's bucket and identities, by terraform
(or, for a Hugging Face Storage Bucket, by huggingface_hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from diloco_anywhere.bucket import hf_buckets
from diloco_anywhere.cli.common import stderr, stdout, user_errors
from diloco_anywhere.config import RunConfig, load_config
from diloco_anywhere.launching.start.infra import (
    CLOUDS,
    HubBucket,
    InfraError,
    Terraform,
    public_values,
    secrets_to_set,
    write_run_toml,
)

infra_app = typer.Typer(
    rich_markup_mode=None,  # plain click help: readable at 80 columns (rich squeezes it)
    help="Provision the run's cloud resources with terraform (infra/aws or infra/gcp), or its "
    "Hugging Face bucket with huggingface_hub, and put the outputs into run.toml.",
    no_args_is_help=True,
)
ConfigPath = Annotated[
    Path | None, typer.Option("--config", help="run.toml of the run. Default: ./run.toml.")
]
FolderOption = Annotated[
    Path | None,
    typer.Option("--dir", help="The Terraform folder. Default: infra/<cloud of run.store>."),
]
VarFileOption = Annotated[
    Path | None,
    typer.Option(help="Variables file. Default: infra/<cloud>.tfvars when it exists."),
]
YesFlag = Annotated[bool, typer.Option("--yes", help="Do not ask before applying.")]


def _config(path: Path | None) -> RunConfig:
    """run.toml given, else ./run.toml (the project's), which infra commands need."""
    if path is None and not Path("run.toml").exists():
        raise InfraError("no run.toml here: give --config run.toml (its store names the cloud)")
    return load_config(path or Path("run.toml"))


def _terraform(
    config: RunConfig, folder: Path | None, var_file: Path | None
) -> Terraform | HubBucket:
    """terraform in the folder of the run's cloud (from run.store's scheme); for a Hugging
    Face bucket, huggingface_hub."""
    root = config.source.parent if config.source else Path.cwd()
    if folder is None and config.run.store.startswith("hf://"):
        url = hf_buckets.parse_bucket_url(config.run.store)
        return HubBucket(url, config.run.store, lambda question: typer.confirm(question))
    if folder is None:
        scheme = config.run.store.partition("://")[0]
        if scheme not in CLOUDS:
            raise InfraError(
                f"run.store {config.run.store!r} is not in a cloud with Terraform here (s3://, "
                f"gs://) nor a Hugging Face bucket (hf://buckets/...): give --dir"
            )
        folder = root / "infra" / CLOUDS[scheme]
    if var_file is None and (folder.parent / f"{folder.name}.tfvars").exists():
        var_file = folder.parent / f"{folder.name}.tfvars"
    return Terraform(folder, var_file)


def plan(config_path: ConfigPath = None, folder: FolderOption = None,
         var_file: VarFileOption = None) -> None:  # fmt: skip
    """Show what `diloco infra up` would create or change; changes nothing."""
    with user_errors():
        terraform = _terraform(_config(config_path), folder, var_file)
        terraform.init()
        terraform.plan()


def up(config_path: ConfigPath = None, folder: FolderOption = None,
       var_file: VarFileOption = None, yes: YesFlag = False) -> None:  # fmt: skip
    """Create or update the bucket, the replicas' and launcher's identities (terraform apply;
    it shows the plan and asks first unless --yes). Then `diloco infra output --write`."""
    with user_errors():
        terraform = _terraform(_config(config_path), folder, var_file)
        terraform.init()
        terraform.apply(approve=yes)
    stdout.print("done: `diloco infra output --write` puts the outputs into run.toml")


def output(
    config_path: ConfigPath = None,
    folder: FolderOption = None,
    write: Annotated[bool, typer.Option(help="Write the values into run.toml.")] = False,
) -> None:
    """Print Terraform's outputs (never a sensitive one), what each belongs to in run.toml,
    and the credentials each platform of run.toml still needs, as commands to run."""
    with user_errors():
        config = _config(config_path)
        terraform = _terraform(config, folder, None)
        values = public_values(terraform.outputs())
        if not values:
            raise InfraError(f"{terraform.where}: no outputs yet; run `diloco infra up` first")
        for name, value in sorted(values.items()):
            stdout.print(f"{name} = {value}", highlight=False, soft_wrap=True)
        if write:
            if config.source is None:
                raise InfraError("--write needs --config run.toml (the file to update)")
            changed = write_run_toml(config.source, values)
            stdout.print(f"{config.source}: " + ("; ".join(changed) or "already up to date"),
                         highlight=False, soft_wrap=True)  # fmt: skip
        platforms = sorted(config.backends)
        stderr.print("still to provide:", highlight=False)
        for line in secrets_to_set(terraform.cloud, config.run.name, values, platforms):
            stderr.print(f"  {line}", highlight=False, soft_wrap=True)


def down(config_path: ConfigPath = None, folder: FolderOption = None,
         var_file: VarFileOption = None, yes: YesFlag = False) -> None:  # fmt: skip
    """Destroy what `diloco infra up` created (terraform destroy; asks first unless --yes).
    A bucket that still holds objects is refused by the cloud: delete the runs first."""
    with user_errors():
        terraform = _terraform(_config(config_path), folder, var_file)
        terraform.init()
        terraform.destroy(approve=yes)


for command in (plan, up, output, down):
    infra_app.command()(command)
