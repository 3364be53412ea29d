# What run.toml, the workflows and the platforms need; docs/infra.md maps each one to its place.

output "bucket" {
  description = "The store's bucket."
  value       = google_storage_bucket.store.name
}

output "store_url" {
  description = "run.toml [run] store."
  value       = local.store_url
}

output "region" {
  description = "The bucket's location: run replicas near it."
  value       = var.region
}

output "replica_service_account" {
  description = "The replicas' identity: GKE Workload Identity (annotate the Kubernetes service account with it), or a key made with gcloud for replicas outside Google Cloud (docs/infra.md)."
  value       = google_service_account.replica.email
}

output "launcher_service_account" {
  description = "service_account of google-github-actions/auth in the repository's workflows."
  value       = google_service_account.launcher.email
}

output "workload_identity_provider" {
  description = "workload_identity_provider of google-github-actions/auth."
  value       = google_iam_workload_identity_pool_provider.github.name
}

output "project_id" {
  description = "The Google Cloud project."
  value       = var.project_id
}
