terraform {
  # 1.5: preconditions and strcontains used below; nothing newer is needed.
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source = "hashicorp/google"
      # 6.x and 7.x: soft_delete_policy, AbortIncompleteMultipartUpload and matches_prefix in
      # bucket lifecycle rules, Workload Identity Federation pools and providers.
      version = ">= 6.0.0, < 8.0.0"
    }
  }

  # State holds no secret (no service account key is created here), but keep it in a remote
  # backend with locking, e.g. a `gcs` backend in a backend.tf of your own.
}

provider "google" {
  project        = var.project_id
  region         = var.region
  default_labels = merge(var.labels, { "diloco-project" = var.name })
}
