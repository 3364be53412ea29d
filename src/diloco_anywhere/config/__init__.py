"""run.toml: one file describes a run. Validated on load; a bad file starts nothing.

Every field has a default except where a run cannot guess (none today: the embedded default,
``default_run.toml``, is a complete run of the built-in task on local processes). Errors list
every bad field on its own line: its path, the value found, and what is allowed.

DiLoCo defaults follow the paper (arXiv 2311.08105, section 3): inner AdamW, outer SGD with
Nesterov momentum 0.9 and learning rate 0.7. ``diloco bench convergence`` confirmed 0.7 for 4
replicas and found 0.5 best for one (docs/tuning.md).
"""

from diloco_anywhere.config.diloco import (
    PACE_TOLERANCE,
    SPARSE_OUTER,
    DilocoSection,
    SparseSection,
    describe_codec,
    parse_codec,
)
from diloco_anywhere.config.errors import ConfigError, problems
from diloco_anywhere.config.loading import (
    DEFAULT_CONFIG,
    load_config,
    parse_config,
    validate_config,
    with_changes,
)
from diloco_anywhere.config.run_config import RunConfig
from diloco_anywhere.config.sections import (
    AlertsSection,
    BudgetSection,
    CheckpointSection,
    ImageSection,
    KeepSection,
    RunSection,
    SyncSection,
    TaskSection,
)

__all__ = [
    "DEFAULT_CONFIG",
    "PACE_TOLERANCE",
    "SPARSE_OUTER",
    "AlertsSection",
    "BudgetSection",
    "CheckpointSection",
    "ConfigError",
    "DilocoSection",
    "ImageSection",
    "KeepSection",
    "RunConfig",
    "RunSection",
    "SparseSection",
    "SyncSection",
    "TaskSection",
    "describe_codec",
    "load_config",
    "parse_codec",
    "parse_config",
    "problems",
    "validate_config",
    "with_changes",
]
