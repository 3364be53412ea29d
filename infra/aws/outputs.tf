# What run.toml and the platforms need; docs/infra.md maps each one to its place.

output "bucket" {
  description = "The store's bucket."
  value       = aws_s3_bucket.store.bucket
}

output "store_url" {
  description = "run.toml [run] store."
  value       = local.store_url
}

output "region" {
  description = "run.toml [backends.sagemaker] region; AWS_DEFAULT_REGION of replicas outside AWS."
  value       = var.region
}

output "sagemaker_role_arn" {
  description = "run.toml [backends.sagemaker] role_arn."
  value       = aws_iam_role.sagemaker.arn
}

output "launcher_role_arn" {
  description = "role-to-assume of aws-actions/configure-aws-credentials in the repository's workflows."
  value       = aws_iam_role.launcher.arn
}

output "ecr_repository_url" {
  description = "run.toml [backends.sagemaker] image is <ecr_repository_url>:<tag>; the image workflow pushes here."
  value       = aws_ecr_repository.image.repository_url
}

output "replica_policy_arn" {
  description = "The run-prefix policy: attach it to any other role that runs replicas (an EKS IRSA or Pod Identity role, say)."
  value       = aws_iam_policy.replica.arn
}

output "replica_user_name" {
  description = "The IAM user for replicas outside AWS, or null; make its key with aws iam create-access-key --user-name <this>."
  value       = var.create_replica_user ? aws_iam_user.replica[0].name : null
}
