terraform {
  # 1.5: `check` blocks and preconditions used below; nothing newer is needed.
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.100: the last 5.x release (an optional thumbprint_list on the GitHub OIDC provider
      # came in 5.81); nothing here needs 6.x, and tests apply it with 5.100 (docs/infra.md).
      version = ">= 5.100.0, < 7.0.0"
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
