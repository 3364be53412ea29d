# The run's store on Google Cloud: one private GCS bucket, a replica service account that
# reaches <store_prefix>/ only, and GitHub Actions impersonating a launcher service account
# through Workload Identity Federation (no key anywhere). docs/infra.md explains the choices.

locals {
  run_names      = length(var.run_names) > 0 ? var.run_names : [var.name]
  store_url      = "gs://${var.bucket_name}/${var.store_prefix}"
  round_prefixes = [for run in local.run_names : "${var.store_prefix}/${run}/rounds/"]

  # Service account IDs are 6-30 characters: <stem>-replica and <stem>-launcher fit.
  stem = replace(substr(var.name, 0, 20), "/-+$/", "")

  # Objects under the prefix, and listings of it. IAM checks storage.objects.list against the
  # bucket, so the only handle on a listing is the prefix it asks for (objectListPrefix).
  prefix_condition = replace(trimspace(<<-CEL
    resource.name.startsWith("projects/_/buckets/${var.bucket_name}/objects/${var.store_prefix}/") ||
    (resource.type == "storage.googleapis.com/Bucket" &&
      (api.getAttribute("storage.googleapis.com/objectListPrefix", "") == "${var.store_prefix}" ||
      api.getAttribute("storage.googleapis.com/objectListPrefix", "").startsWith("${var.store_prefix}/")))
  CEL
  ), "\n", " ")
}

resource "google_storage_bucket" "store" {
  #checkov:skip=CKV_GCP_62:Usage logs would write about one log record per request to another bucket; rounds are polled many times a second. Use Cloud Audit Logs (Data Access for Cloud Storage) if you need a record (docs/infra.md).
  name     = var.bucket_name
  project  = var.project_id
  location = upper(var.region)

  # IAM only (no object ACLs), and never public whatever a policy says.
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # Deleting the bucket must be a deliberate act: empty it first.
  force_destroy = false

  # Versioning on, as on S3: objects are create-only (ifGenerationMatch=0), so the only
  # noncurrent versions are deleted objects, recoverable for noncurrent_version_days. Unlike
  # S3, storage.objects.delete (in the replicas' role) may also delete a named generation:
  # against a leaked replica credential, soft delete (soft_delete_days) is the guard.
  versioning {
    enabled = true
  }

  # Off by default: it keeps every deleted object, rounds included, at least 7 days, billed;
  # versioning already keeps deleted objects (docs/infra.md).
  soft_delete_policy {
    retention_duration_seconds = var.soft_delete_days * 86400
  }

  # Round objects a crash left behind (the collector deletes the others, docs/collective.md).
  lifecycle_rule {
    condition {
      age            = var.round_retention_days
      matches_prefix = local.round_prefixes
    }
    action {
      type = "Delete"
    }
  }

  # ... and their noncurrent versions a day later.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 1
      matches_prefix             = local.round_prefixes
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  # Every other deleted object, after noncurrent_version_days.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  # XML multipart uploads that never completed.
  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}

# -- replicas ---------------------------------------------------------------------------------

resource "google_service_account" "replica" {
  project      = var.project_id
  account_id   = "${local.stem}-replica"
  display_name = "diloco replicas of ${var.name}"
  description  = substr("Reads, creates and deletes objects under gs://${var.bucket_name}/${var.store_prefix}/", 0, 256)
}

resource "google_service_account" "launcher" {
  project      = var.project_id
  account_id   = "${local.stem}-launcher"
  display_name = "diloco launcher of ${var.name}"
  description  = substr("GitHub Actions of ${var.github_owner}/${var.github_repo}: publishes run.toml to the store, reads status", 0, 256)
}

locals {
  store_members = {
    replica  = "serviceAccount:${google_service_account.replica.email}"
    launcher = "serviceAccount:${google_service_account.launcher.email}"
  }
}

# roles/storage.objectUser (get, list, create, delete objects; no IAM, no bucket settings),
# only under the prefix.
resource "google_storage_bucket_iam_member" "store" {
  for_each = local.store_members

  bucket = google_storage_bucket.store.name
  role   = "roles/storage.objectUser"
  member = each.value

  condition {
    title       = "diloco-store-prefix"
    description = "Objects under ${var.store_prefix}/ and listings of that prefix only"
    expression  = local.prefix_condition
  }
}

# Optional: object names (not contents) bucket-wide, for gcsfs's getStorageLayout probe.
resource "google_project_iam_custom_role" "lister" {
  count       = var.bucket_wide_listing ? 1 : 0
  project     = var.project_id
  role_id     = "dilocoStoreLister_${replace(local.stem, "-", "_")}"
  title       = "diloco store lister (${var.name})"
  description = "storage.objects.list only: names, never contents"
  permissions = ["storage.objects.list"]
}

resource "google_storage_bucket_iam_member" "lister" {
  for_each = var.bucket_wide_listing ? local.store_members : {}

  bucket = google_storage_bucket.store.name
  role   = google_project_iam_custom_role.lister[0].name
  member = each.value
}

# GKE pods running as the listed Kubernetes service accounts act as the replica account.
resource "google_service_account_iam_member" "gke_replicas" {
  for_each = toset(var.gke_service_accounts)

  service_account_id = google_service_account.replica.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${each.value}]"
}

# -- GitHub Actions: Workload Identity Federation ---------------------------------------------

locals {
  github_repo = "${var.github_owner}/${var.github_repo}"
  # Exact subjects, no wildcard: a pull request, a tag or another branch gets nothing.
  github_subjects = concat(
    [for branch in var.github_branches : "repo:${local.github_repo}:ref:refs/heads/${branch}"],
    [for env in var.github_environments : "repo:${local.github_repo}:environment:${env}"],
  )
  github_subject_condition = join(" || ", [for subject in local.github_subjects : "assertion.sub == \"${subject}\""])
  github_condition = join(" && ", compact([
    "assertion.repository == \"${local.github_repo}\"",
    "(${local.github_subject_condition})",
    var.github_repository_id == "" ? "" : "assertion.repository_id == \"${var.github_repository_id}\"",
  ]))
}

resource "google_iam_workload_identity_pool" "github" {
  project                   = var.project_id
  workload_identity_pool_id = "github-${local.stem}"
  display_name              = substr("GitHub ${var.name}", 0, 32)
  description               = "GitHub Actions of ${local.github_repo}"
}

resource "google_iam_workload_identity_pool_provider" "github" {
  #checkov:skip=CKV_GCP_125:False positive: the condition is assertion.repository == "<owner>/<repo>" && (assertion.sub == "repo:<owner>/<repo>:ref:refs/heads/<branch>" || ...), built by a for-expression over validated exact names that checkov cannot evaluate; tests/test_infra.py checks it.
  project                            = var.project_id
  workload_identity_pool_id          = google_iam_workload_identity_pool.github.workload_identity_pool_id
  workload_identity_pool_provider_id = "github"
  display_name                       = "GitHub Actions"
  description                        = "Tokens of ${local.github_repo} on its allowed branches and environments only"

  attribute_mapping = {
    "google.subject"          = "assertion.sub"
    "attribute.repository"    = "assertion.repository"
    "attribute.repository_id" = "assertion.repository_id"
    "attribute.ref"           = "assertion.ref"
  }

  # Checked on every token exchange: another repository's token is refused before any binding.
  attribute_condition = local.github_condition

  oidc {
    issuer_uri = "https://token.actions.githubusercontent.com"
  }

  lifecycle {
    precondition {
      condition     = length(local.github_subjects) > 0
      error_message = "github_branches and github_environments are both empty: nothing could impersonate the launcher. Name at least one branch or environment."
    }
  }
}

# The repository's identities (already narrowed by attribute_condition) may act as the launcher.
resource "google_service_account_iam_member" "launcher_github" {
  service_account_id = google_service_account.launcher.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "principalSet://iam.googleapis.com/${google_iam_workload_identity_pool.github.name}/attribute.repository/${local.github_repo}"
}
