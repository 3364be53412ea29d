# Every input that is not a plain on/off switch is validated here, with a message that says
# what is allowed (the same rules as the copier template's questions where both ask).

variable "project_id" {
  description = "The Google Cloud project that holds the bucket, the service accounts and the Workload Identity pool."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id: a Google Cloud project ID, 6-30 lowercase letters, digits and '-', starting with a letter and not ending with '-'."
  }
}

variable "name" {
  description = "The run project's name (copier's project_name): names the service accounts (<name>-replica, <name>-launcher, cut to fit), the pool and, by default, the run whose rounds expire."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,61}[a-z0-9]$", var.name))
    error_message = "name: 2-63 lowercase letters, digits and '-', starting with a letter and not ending with '-'."
  }
}

variable "region" {
  description = "The bucket's location: a region such as us-central1 (next to the replicas), a dual-region such as nam4, or a multi-region (us, eu, asia)."
  type        = string

  validation {
    condition     = can(regex("^([a-z]+-[a-z]+[0-9]+|[a-z]{2,4}[0-9]|us|eu|asia)$", lower(var.region)))
    error_message = "region: a Cloud Storage location such as us-central1, europe-west4, nam4 or us."
  }
}

variable "bucket_name" {
  description = "The GCS bucket of the run's store (copier's bucket). Bucket names are global: pick one nobody has."
  type        = string

  validation {
    condition = (
      can(regex("^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$", var.bucket_name)) &&
      !startswith(var.bucket_name, "goog") &&
      !strcontains(var.bucket_name, "google") &&
      !strcontains(var.bucket_name, "g00gle")
    )
    error_message = "bucket_name: 3-63 lowercase letters, digits, '-' and '_', starting and ending with a letter or digit, not starting with goog nor containing google (dotted names need domain verification: not supported here)."
  }
}

variable "store_prefix" {
  description = "The folder of the store inside the bucket: run.toml [run] store = gs://<bucket>/<store_prefix>. Replicas get this prefix only."
  type        = string
  default     = "runs"

  validation {
    # Store keys are path segments of letters, digits, '_', '.', '=', '-' (layout.py's NAME).
    condition = (
      can(regex("^[A-Za-z0-9_][A-Za-z0-9_.=-]*(/[A-Za-z0-9_][A-Za-z0-9_.=-]*)*$", var.store_prefix)) &&
      length(var.store_prefix) <= 200
    )
    error_message = "store_prefix: one or more '/'-separated segments of letters, digits, '_', '.', '=' and '-' (not starting with '.' or '-'), without a leading or trailing '/', at most 200 characters; it cannot be empty (the replicas' grant is this prefix)."
  }
}

variable "run_names" {
  description = "Runs (run.toml [run] name) whose round objects are deleted after round_retention_days; empty means [name], the template's run name. Checkpoints and metrics are never deleted."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for run in var.run_names : can(regex("^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}$", run))
    ]) && length(var.run_names) <= 50
    error_message = "run_names: run names as run.toml allows them (1-128 letters, digits, '_', '.', '=', '-', starting with a letter, digit or '_'), at most 50."
  }
}

variable "round_retention_days" {
  description = "Days after which objects under <store_prefix>/<run>/rounds/ are deleted: a backstop for rounds a crash left behind. A run paused longer than this cannot replay the rounds after its last checkpoint."
  type        = number
  default     = 7

  validation {
    condition     = var.round_retention_days >= 1 && var.round_retention_days <= 365 && floor(var.round_retention_days) == var.round_retention_days
    error_message = "round_retention_days: a whole number of days from 1 to 365."
  }
}

variable "noncurrent_version_days" {
  description = "Days a deleted or replaced object stays recoverable (object versioning) before it is deleted for good."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1 && var.noncurrent_version_days <= 365 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days: a whole number of days from 1 to 365."
  }
}

variable "soft_delete_days" {
  description = "Days Cloud Storage keeps deleted objects (soft delete), whoever deleted them; 0 turns it off. It keeps every round too, so it costs as much as the run's traffic over that many days."
  type        = number
  default     = 0

  validation {
    condition     = var.soft_delete_days == 0 || (var.soft_delete_days >= 7 && var.soft_delete_days <= 90 && floor(var.soft_delete_days) == var.soft_delete_days)
    error_message = "soft_delete_days: 0 (off) or a whole number of days from 7 to 90 (Cloud Storage's limits)."
  }
}

variable "bucket_wide_listing" {
  description = "Also grant the replicas storage.objects.list on the whole bucket, without condition (object names only, no content): gcsfs's getStorageLayout probe needs it. Off: replicas list under store_prefix only and should run with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (docs/infra.md)."
  type        = bool
  default     = false
}

variable "github_owner" {
  description = "The GitHub user or organization of the project's repository (copier's github_owner), spelt as GitHub does: the token's claims are compared case-sensitively."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9](-?[A-Za-z0-9])*$", var.github_owner)) && length(var.github_owner) <= 39
    error_message = "github_owner: 1-39 letters, digits and single '-', starting and ending with a letter or digit."
  }
}

variable "github_repo" {
  description = "The repository's name (without the owner) whose workflows may impersonate the launcher service account."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]{1,100}$", var.github_repo)) && !contains([".", ".."], var.github_repo)
    error_message = "github_repo: 1-100 letters, digits, '_', '.' and '-' (not '.' or '..')."
  }
}

variable "github_repository_id" {
  description = "The repository's numeric ID (gh api repos/<owner>/<repo> --jq .id), or empty. When set, tokens must also carry it: a repository deleted and re-created under the same name by someone else gets nothing."
  type        = string
  default     = ""

  validation {
    condition     = can(regex("^[0-9]{0,20}$", var.github_repository_id))
    error_message = "github_repository_id: digits only (GitHub's numeric repository ID), or empty."
  }
}

variable "github_branches" {
  description = "Branches whose workflow runs may impersonate the launcher (token subject repo:<owner>/<repo>:ref:refs/heads/<branch>)."
  type        = list(string)
  default     = ["main"]

  validation {
    condition = alltrue([
      for branch in var.github_branches :
      can(regex("^[A-Za-z0-9._/-]{1,200}$", branch)) && !strcontains(branch, "..") && !startswith(branch, "/") && !endswith(branch, "/")
    ])
    error_message = "github_branches: exact branch names (letters, digits, '.', '_', '-', '/'; no '*' or '..')."
  }
}

variable "github_environments" {
  description = "GitHub deployment environments whose jobs may impersonate the launcher (subject repo:<owner>/<repo>:environment:<name>)."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for env in var.github_environments : can(regex("^[A-Za-z0-9 ._-]{1,255}$", env))
    ])
    error_message = "github_environments: exact environment names (letters, digits, ' ', '.', '_', '-'; no '*')."
  }
}

variable "gke_service_accounts" {
  description = "Kubernetes service accounts, as <namespace>/<name>, of GKE clusters in this project with Workload Identity, that run replicas as the replica service account (run.toml [backends.k8s] service_account)."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for ksa in var.gke_service_accounts :
      can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", ksa))
    ])
    error_message = "gke_service_accounts: entries <namespace>/<name> of Kubernetes names (lowercase letters, digits, '-', and '.' in the name)."
  }
}

variable "labels" {
  description = "Labels added to every resource that takes them (besides diloco-project = <name>)."
  type        = map(string)
  default     = {}

  validation {
    condition = alltrue([
      for key, value in var.labels :
      can(regex("^[a-z][a-z0-9_-]{0,62}$", key)) && can(regex("^[a-z0-9_-]{0,63}$", value))
    ])
    error_message = "labels: keys of 1-63 lowercase letters, digits, '_' and '-' starting with a letter; values of at most 63 of the same."
  }
}
