# Every input that is not a plain on/off switch is validated here, with a message that says
# what is allowed (the same rules as the copier template's questions where both ask).

variable "project" {
  description = "The run project's name (copier's project_name): names the SageMaker role <project>-sagemaker, the launcher role, the ECR repository and, by default, the run whose rounds expire."
  type        = string

  validation {
    # IAM role names are at most 64 characters: "<project>-sagemaker" leaves 54.
    condition     = can(regex("^[a-z][a-z0-9-]{0,52}[a-z0-9]$", var.project))
    error_message = "project: 2-54 lowercase letters, digits and '-', starting with a letter and not ending with '-'."
  }
}

variable "region" {
  description = "The AWS region of the bucket, the ECR repository and the SageMaker jobs (run.toml [backends.sagemaker] region)."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]{1,2}$", var.region))
    error_message = "region: an AWS region name such as us-east-1, eu-west-3 or us-gov-west-1."
  }
}

variable "bucket_name" {
  description = "The S3 bucket of the run's store (copier's bucket). Bucket names are global: pick one nobody has."
  type        = string

  validation {
    condition = (
      can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name)) &&
      !strcontains(var.bucket_name, "..") &&
      !startswith(var.bucket_name, "xn--") &&
      !startswith(var.bucket_name, "sthree-") &&
      !endswith(var.bucket_name, "-s3alias") &&
      !endswith(var.bucket_name, "--ol-s3") &&
      !can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$", var.bucket_name))
    )
    error_message = "bucket_name: 3-63 lowercase letters, digits, '.' and '-', starting and ending with a letter or digit, without '..', not an IP address, not starting with xn-- or sthree-, not ending with -s3alias or --ol-s3."
  }
  validation {
    # Virtual-hosted-style HTTPS (what every SDK uses) fails certificate checks on dotted names.
    condition     = !strcontains(var.bucket_name, ".")
    error_message = "bucket_name: no '.', please: a dotted bucket name breaks the TLS certificate check of virtual-hosted-style requests."
  }
}

variable "store_prefix" {
  description = "The folder of the store inside the bucket: run.toml [run] store = s3://<bucket>/<store_prefix>. Replicas get this prefix only."
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
  description = "Runs (run.toml [run] name) whose round objects expire after round_retention_days; empty means [project], the template's run name. Checkpoints and metrics never expire."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for name in var.run_names : can(regex("^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}$", name))
    ]) && length(var.run_names) <= 900
    error_message = "run_names: run names as run.toml allows them (1-128 letters, digits, '_', '.', '=', '-', starting with a letter, digit or '_'), at most 900 (S3 allows 1000 lifecycle rules)."
  }
}

variable "round_retention_days" {
  description = "Days after which objects under <store_prefix>/<run>/rounds/ expire: a backstop for rounds a crash left behind. A run paused longer than this cannot replay the rounds after its last checkpoint."
  type        = number
  default     = 7

  validation {
    condition     = var.round_retention_days >= 1 && var.round_retention_days <= 365 && floor(var.round_retention_days) == var.round_retention_days
    error_message = "round_retention_days: a whole number of days from 1 to 365."
  }
}

variable "noncurrent_version_days" {
  description = "Days a deleted or overwritten object stays recoverable (S3 versioning) before it is removed for good."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1 && var.noncurrent_version_days <= 365 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days: a whole number of days from 1 to 365."
  }
}

variable "create_replica_user" {
  description = "Create an IAM user <project>-replica with the replica policy, for replicas outside AWS (Modal, HF Jobs, Kubernetes elsewhere). Its access key is made with the AWS CLI, never by Terraform (docs/infra.md)."
  type        = bool
  default     = false
}

variable "github_owner" {
  description = "The GitHub user or organization of the project's repository (copier's github_owner), spelt as GitHub does: the OIDC subject is compared case-sensitively."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9](-?[A-Za-z0-9])*$", var.github_owner)) && length(var.github_owner) <= 39
    error_message = "github_owner: 1-39 letters, digits and single '-', starting and ending with a letter or digit."
  }
}

variable "github_repo" {
  description = "The repository's name (without the owner) whose workflows may assume the launcher role."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]{1,100}$", var.github_repo)) && !contains([".", ".."], var.github_repo)
    error_message = "github_repo: 1-100 letters, digits, '_', '.' and '-' (not '.' or '..')."
  }
}

variable "github_branches" {
  description = "Branches whose workflow runs may assume the launcher role (subject repo:<owner>/<repo>:ref:refs/heads/<branch>)."
  type        = list(string)
  default     = ["main"]

  validation {
    # No wildcard: each entry is one exact branch, so the trust policy matches exact subjects.
    condition = alltrue([
      for branch in var.github_branches :
      can(regex("^[A-Za-z0-9._/-]{1,200}$", branch)) && !strcontains(branch, "..") && !startswith(branch, "/") && !endswith(branch, "/")
    ])
    error_message = "github_branches: exact branch names (letters, digits, '.', '_', '-', '/'; no '*' or '..')."
  }
}

variable "github_environments" {
  description = "GitHub deployment environments whose jobs may assume the launcher role (subject repo:<owner>/<repo>:environment:<name>); protect them with required reviewers."
  type        = list(string)
  default     = []

  validation {
    condition = alltrue([
      for env in var.github_environments : can(regex("^[A-Za-z0-9 ._-]{1,255}$", env))
    ])
    error_message = "github_environments: exact environment names (letters, digits, ' ', '.', '_', '-'; no '*')."
  }
}

variable "create_github_oidc_provider" {
  description = "Create the account's GitHub OIDC provider (token.actions.githubusercontent.com). An account has at most one per URL: set false when it exists already, and it is looked up instead."
  type        = bool
  default     = true
}

variable "tags" {
  description = "Tags added to every resource (besides diloco:project = <project>)."
  type        = map(string)
  default     = {}

  validation {
    condition = alltrue([
      for key, value in var.tags :
      length(key) >= 1 && length(key) <= 128 && length(value) <= 256 && !startswith(lower(key), "aws:")
    ])
    error_message = "tags: keys of 1-128 characters not starting with aws:, values of at most 256 characters."
  }
}
