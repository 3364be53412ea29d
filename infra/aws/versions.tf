terraform {
  # 1.5: `check` blocks and preconditions used below; nothing newer is needed.
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 6.10: the ECR repository's image_tag_mutability_exclusion_filter (IMMUTABLE_WITH_EXCLUSION)
      # and an optional thumbprint_list on the GitHub OIDC provider.
      version = ">= 6.10.0, < 7.0.0"
    }
  }

  # State holds no secret (no access key is created here, see iam.tf), but it names every
  # resource: keep it in a remote backend with encryption and locking, e.g.
  # terraform init -backend-config=... with an `s3` backend added in a backend.tf of your own.
}

provider "aws" {
  region = var.region

  default_tags {
    tags = merge(var.tags, { "diloco:project" = var.project })
  }
}
