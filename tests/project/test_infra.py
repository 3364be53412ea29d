"""The Terraform in infra/ (aws, gcp), read statically: no provider can be downloaded here, so
`terraform validate/plan` cannot run. Every .tf is parsed with python-hcl2 and the security
properties docs/infra.md promises are asserted on the parsed configuration: a private bucket
(public access blocked, ACLs off, TLS only), lifecycle rules, run-prefix-only grants, no
wildcard principal in an Allow, GitHub OIDC trust pinned to the repository, PassRole pinned to
one role and one service, validated inputs, the outputs run.toml needs. Then `terraform fmt`
where a terraform binary exists, and checkov where the Makefile installed it
(.tools/checkov, its own virtualenv: checkov pins a botocore that breaks s3fs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from functools import cache
from typing import Any

import hcl2
import pytest

from support import ROOT
from support.template import render

INFRA = ROOT / "infra"
CLOUDS = ("aws", "gcp")
CHECKOV = ROOT / ".tools" / "checkov" / "bin" / "checkov"

# What run.toml, the workflows and the platforms are told to take from `terraform output`.
EXPECTED_OUTPUTS = {
    "aws": {
        "bucket",
        "store_url",
        "region",
        "sagemaker_role_arn",
        "launcher_role_arn",
        "ecr_repository_url",
        "replica_policy_arn",
        "replica_user_name",
    },
    "gcp": {
        "bucket",
        "store_url",
        "region",
        "replica_service_account",
        "launcher_service_account",
        "workload_identity_provider",
        "project_id",
    },
}

# The only actions AWS allows on no resource but "*" that this configuration uses.
# Actions AWS allows on "*" only (no resource-level permissions).
STAR_RESOURCE_ACTIONS = {"ecr:GetAuthorizationToken", "cloudwatch:PutMetricData"}
SKIP_COMMENT = re.compile(r"#\s*checkov:skip=([A-Z0-9_]+):(.*)")


# -- reading the configuration ----------------------------------------------------------------


def _unquote(text: str) -> str:
    """python-hcl2 8 keeps the quotes of string literals and block labels; drop them."""
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return text


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            _unquote(key): _clean(item)
            for key, item in value.items()
            if key not in ("__is_block__", "__comments__")
        }
    if isinstance(value, list):
        return [_clean(item) for item in value]
    if isinstance(value, str):
        return _unquote(value)
    return value


@cache
def config(cloud: str) -> dict[str, Any]:
    """Every .tf of infra/<cloud> merged: resource/data as {type: {name: body}}, variable and
    output as {name: body}, locals as one dict, and the raw text of each file."""
    merged: dict[str, Any] = {
        "resource": {},
        "data": {},
        "variable": {},
        "output": {},
        "locals": {},
        "text": {},
    }
    files = sorted((INFRA / cloud).glob("*.tf"))
    assert files, f"no .tf file in infra/{cloud}"
    for path in files:
        text = path.read_text()
        merged["text"][path.name] = text
        parsed = _clean(hcl2.loads(text))
        for kind in ("resource", "data"):
            for block in parsed.get(kind, []):
                for type_, named in block.items():
                    for name, body in named.items():
                        assert name not in merged[kind].setdefault(type_, {}), (type_, name)
                        merged[kind][type_][name] = body
        for kind in ("variable", "output"):
            for block in parsed.get(kind, []):
                for name, body in block.items():
                    assert name not in merged[kind], f"{kind} {name} declared twice"
                    merged[kind][name] = body
        for block in parsed.get("locals", []):
            merged["locals"].update(block)
    return merged


def resource(cloud: str, type_: str, name: str) -> dict[str, Any]:
    found = config(cloud)["resource"].get(type_, {})
    assert name in found, f"infra/{cloud}: no resource {type_}.{name}"
    return found[name]


def policy_document(name: str) -> list[dict[str, Any]]:
    documents = config("aws")["data"].get("aws_iam_policy_document", {})
    assert name in documents, f"no data.aws_iam_policy_document.{name}"
    return documents[name]["statement"]


def resolve(text: str, cloud: str, depth: int = 5) -> str:
    """Inline each ${local.x} whose value is a string (a template or one expression), so a
    test sees what a policy gets."""
    locals_ = config(cloud)["locals"]

    def inline(match: re.Match[str]) -> str:
        value = locals_.get(match.group(1))
        return value if isinstance(value, str) else match.group(0)

    for _ in range(depth):
        text, changed = re.subn(r"\$\{local\.([a-z_]+)\}", inline, text)
        if not changed:
            break
    return text


def statements_everywhere() -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, statement)
        for name, document in config("aws")["data"].get("aws_iam_policy_document", {}).items()
        for statement in document["statement"]
    ]


def effect(statement: dict[str, Any]) -> str:
    return statement.get("effect", "Allow")


# -- both clouds ------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
def test_every_file_parses_and_declares_inputs_outputs_resources(cloud: str) -> None:
    conf = config(cloud)
    for kind in ("resource", "variable", "output"):
        assert conf[kind], f"infra/{cloud} declares no {kind}"
    assert {"main.tf", "variables.tf", "outputs.tf", "versions.tf"} <= set(conf["text"])


@pytest.mark.parametrize("cloud", CLOUDS)
def test_every_user_input_is_validated(cloud: str) -> None:
    """Every variable but the on/off switches (bool: Terraform checks the type) has at least
    one validation, whose condition reads the variable and whose message says what is
    allowed."""
    for name, body in config(cloud)["variable"].items():
        assert body.get("description"), f"variable {name} has no description"
        if body.get("type") == "${bool}" or body.get("type") == "bool":
            continue
        validations = body.get("validation", [])
        assert validations, f"infra/{cloud}: variable {name} takes input but has no validation"
        for validation in validations:
            assert f"var.{name}" in validation["condition"], (name, validation["condition"])
            assert len(validation["error_message"]) > 20, name
            assert validation["error_message"].startswith(name), (
                f"variable {name}: the message should name the variable"
            )


@pytest.mark.parametrize("cloud", CLOUDS)
def test_outputs_are_what_run_toml_and_the_platforms_need(cloud: str) -> None:
    outputs = config(cloud)["output"]
    assert set(outputs) == EXPECTED_OUTPUTS[cloud]
    for name, body in outputs.items():
        assert body.get("description"), f"output {name} has no description"
        assert "sensitive" not in body, f"output {name}: no output here should carry a secret"
    store_url = resolve(outputs["store_url"]["value"], cloud)
    scheme = {"aws": "s3", "gcp": "gs"}[cloud]
    assert store_url == f"{scheme}://${{var.bucket_name}}/${{var.store_prefix}}"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_no_key_or_secret_is_created_in_terraform_state(cloud: str) -> None:
    resources = config(cloud)["resource"]
    for secret_type in (
        "aws_iam_access_key",
        "aws_iam_user_login_profile",
        "google_service_account_key",
        "google_storage_hmac_key",
    ):
        assert secret_type not in resources, f"{secret_type} would put a secret in state"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_nothing_is_public(cloud: str) -> None:
    text = "\n".join(config(cloud)["text"].values())
    for public in ("allUsers", "allAuthenticatedUsers", '"Principal": "*"', '"AWS": "*"'):
        assert public not in text, f"infra/{cloud} mentions {public}"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_every_checkov_skip_gives_its_reason(cloud: str) -> None:
    skips = [
        (match.group(1), match.group(2))
        for text in config(cloud)["text"].values()
        for match in SKIP_COMMENT.finditer(text)
    ]
    for check, reason in skips:
        assert len(reason.strip()) >= 40, f"checkov skip {check}: say why, in a sentence"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_round_lifecycle_matches_the_store_layout(cloud: str) -> None:
    """Round objects are <store_prefix>/<run>/rounds/... (layout.py); only they expire."""
    from diloco_anywhere.bucket.format.layout import RunLayout

    round_key = RunLayout("demo").round(7)
    assert round_key.startswith("demo/rounds/")
    prefixes = config(cloud)["locals"]["round_prefixes"]
    assert '"${var.store_prefix}/${run}/rounds/"' in prefixes.replace("\\", "")


# -- AWS --------------------------------------------------------------------------------------


def test_aws_bucket_blocks_public_access_and_acls() -> None:
    block = resource("aws", "aws_s3_bucket_public_access_block", "store")
    for setting in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert block[setting] is True, setting
    assert block["bucket"] == "${aws_s3_bucket.store.id}"
    ownership = resource("aws", "aws_s3_bucket_ownership_controls", "store")
    assert ownership["rule"][0]["object_ownership"] == "BucketOwnerEnforced"


def test_aws_bucket_is_encrypted_and_versioned() -> None:
    sse = resource("aws", "aws_s3_bucket_server_side_encryption_configuration", "store")
    default = sse["rule"][0]["apply_server_side_encryption_by_default"][0]
    assert default["sse_algorithm"] in ("AES256", "aws:kms", "aws:kms:dsse")
    versioning = resource("aws", "aws_s3_bucket_versioning", "store")
    assert versioning["versioning_configuration"][0]["status"] == "Enabled"
    assert resource("aws", "aws_s3_bucket", "store")["force_destroy"] is False


def test_aws_bucket_policy_denies_plain_http_to_everyone() -> None:
    policy = resource("aws", "aws_s3_bucket_policy", "store")
    assert policy["policy"] == "${data.aws_iam_policy_document.bucket.json}"
    denies = [
        s
        for s in policy_document("bucket")
        if effect(s) == "Deny"
        and any(
            c["test"] == "Bool"
            and c["variable"] == "aws:SecureTransport"
            and c["values"] == ["false"]
            for c in s.get("condition", [])
        )
    ]
    assert len(denies) == 1, "one Deny on aws:SecureTransport = false"
    deny = denies[0]
    assert deny["actions"] == ["s3:*"]
    assert set(deny["resources"]) == {
        "${aws_s3_bucket.store.arn}",
        "${aws_s3_bucket.store.arn}/*",
    }
    # Everyone: a Deny that named fewer principals would leave the others on plain HTTP.
    assert [(p["type"], p["identifiers"]) for p in deny["principals"]] == [("*", ["*"])]
    # Nothing but Deny in the bucket policy: grants live in IAM, on the run prefix.
    assert {effect(s) for s in policy_document("bucket")} == {"Deny"}


def test_aws_lifecycle_aborts_uploads_and_expires_rounds() -> None:
    lifecycle = resource("aws", "aws_s3_bucket_lifecycle_configuration", "store")
    rules = lifecycle["rule"]
    aborts = [r for r in rules if "abort_incomplete_multipart_upload" in r]
    assert len(aborts) == 1
    assert aborts[0]["abort_incomplete_multipart_upload"][0]["days_after_initiation"] == 1
    assert aborts[0]["filter"] == [{"prefix": ""}], "the abort rule covers the whole bucket"
    assert aborts[0]["status"] == "Enabled"

    (dynamic,) = [d["rule"] for d in lifecycle["dynamic"] if "rule" in d]
    assert dynamic["for_each"] == "${local.round_prefixes}"
    content = dynamic["content"][0]
    assert content["status"] == "Enabled"
    assert content["filter"][0]["prefix"] == "${rule.value}"
    assert content["expiration"][0]["days"] == "${var.round_retention_days}"

    retention = config("aws")["variable"]["round_retention_days"]
    condition = retention["validation"][0]["condition"]
    assert ">= 1" in condition
    assert "<= 365" in condition


def test_aws_replica_policy_is_the_run_prefix_only() -> None:
    statements = policy_document("replica")
    assert {effect(s) for s in statements} == {"Allow"}
    objects_arn = "${aws_s3_bucket.store.arn}/${var.store_prefix}/*"
    assert resolve("${local.store_objects_arn}", "aws") == objects_arn

    (objects,) = [s for s in statements if "s3:GetObject" in s["actions"]]
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= set(objects["actions"])
    assert [resolve(r, "aws") for r in objects["resources"]] == [objects_arn]
    for action in objects["actions"]:
        assert action.startswith("s3:"), action
        assert "*" not in action, action
        # No version deletes: a leaked replica key cannot purge what versioning keeps.
        assert action not in ("s3:DeleteObjectVersion", "s3:PutBucketVersioning"), action

    (listing,) = [s for s in statements if "s3:ListBucket" in s["actions"]]
    assert listing["actions"] == ["s3:ListBucket"]
    assert listing["resources"] == ["${aws_s3_bucket.store.arn}"]
    (prefix,) = [c for c in listing["condition"] if c["variable"] == "s3:prefix"]
    assert prefix["test"] in ("StringLike", "StringEquals")
    assert prefix["values"], "s3:prefix condition with no value"
    for value in prefix["values"]:
        assert value.startswith("${var.store_prefix}"), value
    assert len(statements) == 2


def test_aws_no_allow_has_a_wildcard_principal_action_or_resource() -> None:
    for document, statement in statements_everywhere():
        where = f"data.aws_iam_policy_document.{document} {statement.get('sid')}"
        principals = statement.get("principals", []) + statement.get("not_principals", [])
        wildcard = any(
            p["type"] == "*" or "*" in p["identifiers"] or "arn:aws:iam::*:root" in p["identifiers"]
            for p in principals
        )
        if effect(statement) == "Deny":
            continue  # a Deny with "*" takes access away from everyone: the TLS-only rule
        assert not wildcard, f"{where}: an Allow with a wildcard principal"
        for negated in ("not_actions", "not_resources"):
            assert negated not in statement, f"{where}: {negated}"
        for action in statement["actions"]:
            assert not action.endswith("*"), f"{where}: action {action}"
        for arn in statement.get("resources", []):
            if arn == "*":
                assert set(statement["actions"]) <= STAR_RESOURCE_ACTIONS, (
                    f"{where}: '*' resource for {statement['actions']}"
                )


def test_aws_sagemaker_role_is_the_one_run_toml_names() -> None:
    role = resource("aws", "aws_iam_role", "sagemaker")
    assert role["name"] == "${var.project}-sagemaker"
    template = (ROOT / "template" / "run.toml.jinja").read_text()
    assert ":role/{{ project_name }}-sagemaker" in template
    # ... and its image is the ECR repository named after the project: `latest`, which the
    # launch pins to a digest, since every tag there is immutable.
    assert "amazonaws.com/{{ project_name }}:latest" in template
    repository = resource("aws", "aws_ecr_repository", "image")
    assert repository["name"] == "${var.project}"
    assert repository["image_tag_mutability"] == "IMMUTABLE"

    (trust,) = policy_document("sagemaker_trust")
    assert trust["actions"] == ["sts:AssumeRole"]
    assert trust["principals"] == [{"type": "Service", "identifiers": ["sagemaker.amazonaws.com"]}]
    assert role["assume_role_policy"] == "${data.aws_iam_policy_document.sagemaker_trust.json}"

    attached = config("aws")["resource"]["aws_iam_role_policy_attachment"]
    assert attached["sagemaker_replica"]["role"] == "${aws_iam_role.sagemaker.name}"
    assert attached["sagemaker_replica"]["policy_arn"] == "${aws_iam_policy.replica.arn}"


def test_aws_sagemaker_runtime_pulls_one_repository_and_writes_training_logs_only() -> None:
    statements = policy_document("sagemaker_runtime")
    actions = {a for s in statements for a in s["actions"]}
    assert actions <= {
        "cloudwatch:PutMetricData",
        "ecr:GetAuthorizationToken",
        "ecr:BatchCheckLayerAvailability",
        "ecr:BatchGetImage",
        "ecr:GetDownloadUrlForLayer",
        "logs:CreateLogGroup",
        "logs:CreateLogStream",
        "logs:DescribeLogStreams",
        "logs:PutLogEvents",
    }
    for statement in statements:
        if any(
            a.startswith("ecr:") and a != "ecr:GetAuthorizationToken" for a in statement["actions"]
        ):
            assert statement["resources"] == ["${aws_ecr_repository.image.arn}"]
        if any(a.startswith("logs:") for a in statement["actions"]):
            for arn in statement["resources"]:
                assert resolve(arn, "aws").endswith(
                    (
                        "log-group:/aws/sagemaker/TrainingJobs",
                        "log-group:/aws/sagemaker/TrainingJobs:log-stream:*",
                    )
                ), arn
        if "cloudwatch:PutMetricData" in statement["actions"]:
            (condition,) = statement["condition"]
            assert condition["variable"] == "cloudwatch:namespace"
            assert condition["values"] == ["/aws/sagemaker/TrainingJobs"]


def test_aws_github_oidc_trust_is_pinned_to_the_repository() -> None:
    (trust,) = policy_document("launcher_trust")
    assert trust["actions"] == ["sts:AssumeRoleWithWebIdentity"]
    assert trust["principals"] == [
        {"type": "Federated", "identifiers": ["${local.github_oidc_provider_arn}"]}
    ]
    host = config("aws")["locals"]["github_oidc_host"]
    assert host == "token.actions.githubusercontent.com"
    conditions = {
        c["variable"].replace("${local.github_oidc_host}", host): c for c in trust["condition"]
    }
    aud = conditions["token.actions.githubusercontent.com:aud"]
    assert (aud["test"], aud["values"]) == ("StringEquals", ["sts.amazonaws.com"])
    sub = conditions["token.actions.githubusercontent.com:sub"]
    assert sub["test"] in ("StringEquals", "StringLike")
    assert sub["values"] == "${local.github_subjects}"
    assert_github_subjects("aws")

    provider = resource("aws", "aws_iam_openid_connect_provider", "github")
    assert provider["client_id_list"] == ["sts.amazonaws.com"]
    assert provider["count"] == "${var.create_github_oidc_provider ? 1 : 0}"


def assert_github_subjects(cloud: str) -> None:
    """The subjects are repo:<owner>/<repo>:ref:refs/heads/<branch> and
    repo:<owner>/<repo>:environment:<env>, from validated exact names: never 'repo:*'."""
    locals_ = config(cloud)["locals"]
    assert locals_["github_repo"] == "${var.github_owner}/${var.github_repo}"
    subjects = locals_["github_subjects"].replace('\\"', '"')
    assert '"repo:${local.github_repo}:ref:refs/heads/${branch}"' in subjects
    assert '"repo:${local.github_repo}:environment:${env}"' in subjects
    assert "*" not in subjects
    variables = config(cloud)["variable"]
    for name, sample_ok in (("github_branches", "main"), ("github_environments", "production")):
        pattern = re.search(r'regex\("([^"]+)"', variables[name]["validation"][0]["condition"])
        assert pattern, name
        regex = re.compile(pattern.group(1).replace("\\\\", "\\"))
        assert regex.fullmatch(sample_ok), (name, sample_ok)
        for wildcard in ("*", "main*", "feature/*", "prod?"):
            assert not regex.fullmatch(wildcard), f"{name} accepts {wildcard!r}"
    for name in ("github_owner", "github_repo"):
        pattern = re.search(r'regex\("([^"]+)"', variables[name]["validation"][0]["condition"])
        regex = re.compile(pattern.group(1).replace("\\\\", "\\"))
        for bad in ("*", "acme/*", "ac*me", "acme:ref"):
            assert not regex.fullmatch(bad), f"{name} accepts {bad!r}"


def test_aws_launcher_passes_only_the_sagemaker_role_to_sagemaker() -> None:
    statements = policy_document("launcher")
    passes = [s for s in statements if "iam:PassRole" in s["actions"]]
    assert len(passes) == 1
    (pass_role,) = passes
    assert pass_role["actions"] == ["iam:PassRole"]
    assert pass_role["resources"] == ["${aws_iam_role.sagemaker.arn}"]
    (service,) = [c for c in pass_role["condition"] if c["variable"] == "iam:PassedToService"]
    assert (service["test"], service["values"]) == ("StringEquals", ["sagemaker.amazonaws.com"])

    sagemaker = [a for s in statements for a in s["actions"] if a.startswith("sagemaker:")]
    assert {"sagemaker:CreateTrainingJob", "sagemaker:DescribeTrainingJob"} <= set(sagemaker)
    assert "sagemaker:StopTrainingJob" in sagemaker
    for statement in statements:
        if any(a.startswith("sagemaker:") for a in statement["actions"]):
            for arn in statement["resources"]:
                assert ":training-job/" in arn, arn
        if any(
            a.startswith("ecr:") and a != "ecr:GetAuthorizationToken" for a in statement["actions"]
        ):
            assert statement["resources"] == ["${aws_ecr_repository.image.arn}"]
            assert "ecr:PutImage" in statement["actions"]
    attached = config("aws")["resource"]["aws_iam_role_policy_attachment"]
    assert attached["launcher_replica"]["role"] == "${aws_iam_role.launcher.name}"
    assert attached["launcher_replica"]["policy_arn"] == "${aws_iam_policy.replica.arn}"


def test_aws_ecr_scans_on_push_and_keeps_tags_immutable() -> None:
    repository = resource("aws", "aws_ecr_repository", "image")
    assert repository["image_scanning_configuration"][0]["scan_on_push"] is True
    assert repository["image_tag_mutability"] == "IMMUTABLE"


def test_aws_replica_user_is_optional_and_gets_the_policy_through_a_group() -> None:
    variable = config("aws")["variable"]["create_replica_user"]
    assert variable["default"] is False
    resources = config("aws")["resource"]
    gated = "${var.create_replica_user ? 1 : 0}"
    for type_, name in (
        ("aws_iam_user", "replica"),
        ("aws_iam_group", "replicas"),
        ("aws_iam_group_policy_attachment", "replicas"),
        ("aws_iam_user_group_membership", "replica"),
    ):
        assert resources[type_][name]["count"] == gated, (type_, name)
    attachment = resources["aws_iam_group_policy_attachment"]["replicas"]
    assert attachment["policy_arn"] == "${aws_iam_policy.replica.arn}"
    for direct in (
        "aws_iam_user_policy",
        "aws_iam_user_policy_attachment",
        "aws_iam_policy_attachment",
    ):
        assert direct not in resources, f"{direct}: policies reach users through the group"


# -- GCP --------------------------------------------------------------------------------------


def test_gcp_bucket_is_uniform_and_never_public() -> None:
    bucket = resource("gcp", "google_storage_bucket", "store")
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert bucket["force_destroy"] is False
    assert bucket["versioning"][0]["enabled"] is True


def test_gcp_lifecycle_aborts_uploads_and_deletes_rounds() -> None:
    rules = resource("gcp", "google_storage_bucket", "store")["lifecycle_rule"]
    by_action: dict[str, list[dict[str, Any]]] = {}
    for rule in rules:
        by_action.setdefault(rule["action"][0]["type"], []).append(rule["condition"][0])
    (abort,) = by_action["AbortIncompleteMultipartUpload"]
    assert abort == {"age": 1}
    rounds = [c for c in by_action["Delete"] if "age" in c]
    assert len(rounds) == 1
    assert rounds[0]["age"] == "${var.round_retention_days}"
    assert rounds[0]["matches_prefix"] == "${local.round_prefixes}"


def test_gcp_replicas_get_the_run_prefix_only() -> None:
    grants = config("gcp")["resource"]["google_storage_bucket_iam_member"]
    store = grants["store"]
    assert store["role"] in ("roles/storage.objectUser", "roles/storage.objectAdmin")
    assert store["bucket"] == "${google_storage_bucket.store.name}"
    (condition,) = store["condition"]
    assert condition["expression"] == "${local.prefix_condition}"
    expression = config("gcp")["locals"]["prefix_condition"].replace('\\"', '"')
    objects = (
        'resource.name.startsWith("projects/_/buckets/${var.bucket_name}/objects/'
        '${var.store_prefix}/")'
    )
    assert objects in expression
    # Listing is checked on the bucket: allowed only for a listing of the prefix.
    listing = (
        'api.getAttribute("storage.googleapis.com/objectListPrefix", "")'
        '.startsWith("${var.store_prefix}/")'
    )
    assert listing in expression
    assert 'resource.type == "storage.googleapis.com/Bucket" &&' in expression

    # The only unconditioned grant is the optional names-only lister (off by default).
    for name, grant in grants.items():
        if "condition" in grant:
            continue
        assert name == "lister", f"google_storage_bucket_iam_member.{name} has no condition"
        assert grant["role"] == "${google_project_iam_custom_role.lister[0].name}"
    lister = resource("gcp", "google_project_iam_custom_role", "lister")
    assert lister["permissions"] == ["storage.objects.list"]
    assert config("gcp")["variable"]["bucket_wide_listing"]["default"] is False
    for type_ in ("google_storage_bucket_iam_binding", "google_storage_bucket_iam_policy"):
        assert type_ not in config("gcp")["resource"], f"{type_} is authoritative: use members"


def test_gcp_workload_identity_is_pinned_to_the_repository() -> None:
    provider = resource("gcp", "google_iam_workload_identity_pool_provider", "github")
    assert provider["oidc"][0]["issuer_uri"] == "https://token.actions.githubusercontent.com"
    assert provider["attribute_condition"] == "${local.github_condition}"
    assert provider["attribute_mapping"]["google.subject"] == "assertion.sub"
    assert provider["attribute_mapping"]["attribute.repository"] == "assertion.repository"
    locals_ = config("gcp")["locals"]
    condition = locals_["github_condition"].replace('\\"', '"')
    assert 'assertion.repository == "${local.github_repo}"' in condition
    assert "(${local.github_subject_condition})" in condition
    assert "assertion.repository_id ==" in condition
    subjects = locals_["github_subject_condition"].replace('\\"', '"')
    assert 'assertion.sub == "${subject}"' in subjects
    assert_github_subjects("gcp")

    binding = config("gcp")["resource"]["google_service_account_iam_member"]["launcher_github"]
    assert binding["role"] == "roles/iam.workloadIdentityUser"
    assert binding["service_account_id"] == "${google_service_account.launcher.name}"
    assert binding["member"] == (
        "principalSet://iam.googleapis.com/${google_iam_workload_identity_pool.github.name}"
        "/attribute.repository/${local.github_repo}"
    )
    for name, member in config("gcp")["resource"]["google_service_account_iam_member"].items():
        assert member["role"] == "roles/iam.workloadIdentityUser", name
        assert "*" not in member["member"], name


# -- tools ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_terraform_fmt() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("no terraform binary on PATH: `terraform fmt -check` not run")
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(INFRA)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"terraform fmt would change:\n{result.stdout}{result.stderr}"


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["repository", "project"])
@pytest.mark.parametrize("cloud", CLOUDS)
def test_checkov(cloud: str, where: str, tmp_path) -> None:
    """checkov on this repository's Terraform and on a rendered project's."""
    if not CHECKOV.exists():
        pytest.skip(
            f"checkov not installed at {CHECKOV.relative_to(ROOT)} (the Makefile's checkov target)"
        )
    folder = INFRA / cloud
    if where == "project":
        storage = {"aws": "s3", "gcp": "gcs"}[cloud]
        folder = render(tmp_path, storage=storage, backends=["k8s"]) / "infra" / cloud
    started = time.monotonic()
    result = subprocess.run(
        [
            str(CHECKOV),
            "-d",
            str(folder),
            "--framework",
            "terraform",
            "--skip-download",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
    )
    report = json.loads(result.stdout)
    assert isinstance(report, dict), f"checkov found nothing to scan: {result.stdout[:500]}"
    summary, results = report["summary"], report["results"]
    failed = [
        f"{c['check_id']} {c['resource']}: {c['check_name']}"
        for c in results.get("failed_checks", [])
    ]
    assert summary["parsing_errors"] == 0, (
        f"checkov could not parse infra/{cloud}: {result.stderr[-2000:]}"
    )
    assert not failed, "\n".join(failed)
    assert summary["failed"] == 0
    assert summary["passed"] > 0
    skip_comments = {
        match.group(1)
        for text in config(cloud)["text"].values()
        for match in SKIP_COMMENT.finditer(text)
    }
    for check in results.get("skipped_checks", []):
        assert check["check_id"] in skip_comments, f"{check['check_id']} skipped without a comment"
        assert check["check_result"].get("suppress_comment"), check["check_id"]
    print(
        f"checkov {where} infra/{cloud}: {summary['passed']} passed, {summary['failed']} failed, "
        f"{summary['skipped']} skipped ({time.monotonic() - started:.1f} s)"
    )


@pytest.mark.integration
@pytest.mark.parametrize(("storage", "cloud"), [("s3", "aws"), ("gcs", "gcp")])
def test_a_rendered_project_gets_exactly_the_checked_terraform(tmp_path, storage, cloud) -> None:
    """What checkov and the property tests checked here is the Terraform a rendered project
    gets, byte for byte (the template links it), with the answers as its variables."""
    project = render(tmp_path, storage=storage, backends=["k8s"])
    ours = sorted(p.name for p in (ROOT / "infra" / cloud).glob("*.tf"))
    theirs = sorted(p.name for p in (project / "infra" / cloud).glob("*.tf"))
    assert theirs == ours
    for name in ours:
        assert (project / "infra" / cloud / name).read_bytes() == (
            ROOT / "infra" / cloud / name
        ).read_bytes()
    variables = _clean(hcl2.loads((project / "infra" / f"{cloud}.tfvars").read_text()))
    assert set(variables) <= set(config(cloud)["variable"])
