"""Prices and the estimate (launching/cost/prices.py, clouds.py, traffic.py, model_size.py,
cost_estimate.py and cost_so_far.py): the numbers for known inputs, worked out here by hand from
the formulas in docs/collective.md and the prices in launching/cost/prices.toml."""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import pytest

from diloco_anywhere.config import BudgetSection, ConfigError, RunConfig, parse_config
from diloco_anywhere.launching.cost.clouds import GIB, egress, platform_cloud, store_cloud
from diloco_anywhere.launching.cost.cost_estimate import estimate
from diloco_anywhere.launching.cost.cost_so_far import (
    Attempt,
    ReplicaTraffic,
    over_budget,
    spend,
    traffic_so_far,
)
from diloco_anywhere.launching.cost.model_size import parameter_count
from diloco_anywhere.launching.cost.prices import hourly_price, load_prices
from diloco_anywhere.launching.cost.round_plan import (
    RoundPlan,
    StepTime,
    plan_rounds,
    round_plan_for,
)
from diloco_anywhere.launching.cost.traffic import round_traffic
from support import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRICES = load_prices()
NO_OVERRIDES = BudgetSection()
BILLION = 1_000_000_000
# int8 at block 64: a float32 scale per 64 values, then a byte per value
INT8_1B = 4 * math.ceil(BILLION / 64) + BILLION  # 1,062,500,000 bytes
UNITS = {"compute": {"GPU-second", "hour"}, "egress": {"GB"}, "requests": {"1000 requests"}}


# -- The price table -------------------------------------------------------------------------


def _entries():
    for platform, table in PRICES.compute.items():
        for hardware, price in table.items():
            yield "compute", f"{platform}/{hardware}", price
    for cloud, price in PRICES.egress.items():
        yield "egress", cloud, price
    for cloud, table in PRICES.requests.items():
        for kind, price in table.items():
            yield "requests", f"{cloud}/{kind}", price


def test_every_price_has_its_unit_a_date_and_a_source():
    entries = list(_entries())
    assert len(entries) > 40
    for section, name, price in entries:
        assert price.per in UNITS[section], name
        assert price.date[:4] in ("2025", "2026"), name
        assert price.source.strip(), name


def test_the_table_ships_in_the_wheel():
    pyproject = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())
    assert (
        "launching/cost/prices.toml"
        in pyproject["tool"]["setuptools"]["package-data"]["diloco_anywhere"]
    )


def test_the_tables_hardware_names_are_the_platforms_own():
    from diloco_anywhere.backends import hf_jobs, modal, sagemaker

    assert set(PRICES.compute["modal"]) <= set(modal.GPU_NAMES)
    assert set(PRICES.compute["hf_jobs"]) <= set(hf_jobs.flavors())
    assert set(PRICES.compute["sagemaker"]) <= set(sagemaker.instance_types())
    assert "ml.g5.xlarge" in PRICES.compute["sagemaker"]  # the backend's default
    assert "a10g-small" in PRICES.compute["hf_jobs"]  # the backend's default


# -- Hourly prices ---------------------------------------------------------------------------


def test_a_modal_gpu_count_multiplies_its_per_second_price():
    price = hourly_price("modal", "A100-80GB:2", NO_OVERRIDES, PRICES)
    assert price.usd == pytest.approx(2 * 0.000694 * 3600)
    assert price.source == "list price of 2026-05-07"
    assert "modal.com/pricing" in price.reference
    assert hourly_price("modal", "h100", NO_OVERRIDES, PRICES).usd == pytest.approx(3.9492)


def test_hf_flavors_and_sagemaker_instances_are_priced_per_hour():
    assert hourly_price("hf_jobs", "a10g-large", NO_OVERRIDES, PRICES).usd == 1.50
    assert hourly_price("hf_jobs", "h200x8", NO_OVERRIDES, PRICES).usd == 40.00
    assert hourly_price("sagemaker", "ml.g5.xlarge", NO_OVERRIDES, PRICES).usd == 1.408


def test_run_toml_prices_win_hardware_first():
    budget = BudgetSection(hourly_usd={"modal/H100:8": 20.0, "modal": 1.0, "k8s": 2.5})
    assert hourly_price("modal", "H100:8", budget, PRICES).usd == 20.0
    assert hourly_price("modal", "T4", budget, PRICES).usd == 1.0
    own = hourly_price("k8s", "", budget, PRICES)
    assert (own.usd, own.source) == (2.5, 'run.toml [budget] hourly_usd."k8s"')


def test_hardware_without_a_price_is_named_with_what_to_set():
    local = hourly_price("local", "", NO_OVERRIDES, PRICES)
    assert local.usd is None
    assert "set [budget] hourly_usd.local" in local.source
    missing = hourly_price("sagemaker", "ml.p5.48xlarge", NO_OVERRIDES, PRICES)
    assert missing.usd is None
    assert 'hourly_usd."sagemaker/ml.p5.48xlarge"' in missing.source
    cpu = hourly_price("modal", "cpu", NO_OVERRIDES, PRICES)  # Modal bills cores, not GPUs
    assert cpu.usd is None
    assert 'hourly_usd."modal/cpu"' in cpu.source


# -- Traffic per outer step ------------------------------------------------------------------


def test_a_1b_model_in_int8_among_8_replicas_shards():
    traffic = round_traffic(BILLION, "int8", 8)
    assert traffic.mode == "sharded"  # auto: (n - 1) P is far beyond 256 MiB
    assert traffic.payload == INT8_1B
    assert traffic.up == INT8_1B * 9 // 8 == 1_195_312_500  # P (1 + 1/n)
    assert traffic.down == 2 * INT8_1B * 7 // 8 == 1_859_375_000  # 2 P (n - 1) / n
    # 4 MiB of float32 per part: ceil(1e9 / 2^20) = 954 parts, rounded up to a multiple of 8
    assert traffic.parts == 960


def test_a_small_model_gathers_and_gather_reads_every_other_contribution():
    traffic = round_traffic(1_000_000, "fp32", 4)
    assert traffic.mode == "gather"  # saving 4 MB x 3 x 2 / 4 is under 64 MiB
    assert (traffic.up, traffic.down) == (4_000_000, 3 * 4_000_000)
    forced = round_traffic(1_000_000, "fp32", 4, mode="sharded")
    assert (forced.up, forced.down) == (5_000_000, 6_000_000)


def test_fragments_split_the_bytes_not_add_to_them():
    whole = round_traffic(BILLION, "bf16", 8)
    streamed = round_traffic(BILLION, "bf16", 8, fragments=4)
    bf16 = 2 * BILLION
    assert (streamed.up, streamed.down) == (whole.up, whole.down)
    assert (whole.up, whole.down) == (bf16 * 9 // 8, 2 * bf16 * 7 // 8)


# The run's default, 8% of each chunk of 4,096 at 2 bits: per chunk 2 float32 levels (8 bytes),
# 328 positions in Elias-Fano form (228 bytes) and 328 codes of 2 bits (82 bytes); the last
# chunk (1,000,000,000 - 244,140 x 4,096 = 2,560 values) keeps 328 too, its positions in 203
SPARSE_1B = 244_140 * 318 + 8 + 203 + 82


def test_a_1b_model_in_sparse_among_8_replicas_gathers():
    """Reading the others' 78 MB contributions beats a scatter-reduce whose result is int8."""
    traffic = round_traffic(BILLION, "sparse", 8)
    assert traffic.mode == "gather"
    assert traffic.payload == SPARSE_1B == 77_636_813
    assert (traffic.up, traffic.down) == (SPARSE_1B, 7 * SPARSE_1B)
    forced = round_traffic(BILLION, "sparse", 8, mode="sharded")
    assert (forced.up, forced.down) == (
        SPARSE_1B + INT8_1B // 8, (SPARSE_1B + INT8_1B) * 7 // 8
    )  # fmt: skip
    sparseloco = round_traffic(BILLION, "sparse", 8, codec_params={"k": 64})
    assert sparseloco.payload == 244_140 * 88 + 8 + 58 + 16  # 1.56%: 88 bytes a chunk


# -- Egress --------------------------------------------------------------------------------


def test_where_replicas_and_stores_run():
    assert store_cloud("s3://bucket/run", NO_OVERRIDES) == "aws"
    assert store_cloud("gs://bucket/run", NO_OVERRIDES) == "gcp"
    assert store_cloud("az://container/run", NO_OVERRIDES) == "azure"
    assert store_cloud("hf://buckets/me/run", NO_OVERRIDES) == "hf"
    assert store_cloud("/data/store", NO_OVERRIDES) == "local"
    assert platform_cloud("sagemaker", NO_OVERRIDES) == "aws"
    assert platform_cloud("k8s", NO_OVERRIDES) == "unknown"
    said = BudgetSection(clouds={"k8s": "gcp", "store": "hf"})
    assert platform_cloud("k8s", said) == "gcp"
    assert store_cloud("s3://bucket/run", said) == "hf"


def test_the_same_cloud_is_free():
    assert egress("aws", "aws", GIB, 7 * GIB, NO_OVERRIDES, PRICES).usd == 0.0
    assert egress("hf", "hf", GIB, 7 * GIB, NO_OVERRIDES, PRICES).usd == 0.0


def test_reads_pay_the_stores_cloud_and_writes_the_replicas():
    # Modal reading 2 GiB from S3: AWS's $0.09 a GB; its writes: Modal lists no egress price
    assert egress("modal", "aws", GIB, 2 * GIB, NO_OVERRIDES, PRICES).usd == pytest.approx(0.18)
    # SageMaker with a GCS bucket: reads leave GCP ($0.12), writes leave AWS ($0.09)
    bill = egress("aws", "gcp", 3 * GIB, 2 * GIB, NO_OVERRIDES, PRICES)
    assert bill.usd == pytest.approx(2 * 0.12 + 3 * 0.09)
    assert bill.unpriced == ()


def test_egress_overrides_win():
    budget = BudgetSection(egress_usd_per_gb={"aws": 0.05})
    assert egress("modal", "aws", 0, 2 * GIB, budget, PRICES).usd == pytest.approx(0.10)


def test_an_unknown_cloud_is_named_not_guessed():
    bill = egress("unknown", "aws", GIB, GIB, NO_OVERRIDES, PRICES)
    assert bill.usd == pytest.approx(0.09)  # the reads leave AWS whatever the reader
    assert bill.unpriced == ("writes from an unknown cloud: say where it runs in [budget] clouds",)


# -- The model's size ------------------------------------------------------------------------


def test_the_built_in_gpt_is_counted_without_building_its_weights():
    # tiny: vocabulary 256, width 64, 64 positions, 2 blocks, the head tied to the embedding
    block = 2 * 2 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    tiny = 256 * 64 + 64 * 64 + 2 * block + 2 * 64
    assert parameter_count(RunConfig()) == (tiny, "the built-in GPT task, counted on meta")
    assert tiny == 120_576


def test_the_parameter_setting_wins_and_other_tasks_need_it():
    given = RunConfig.model_validate({"budget": {"parameters": 7}})
    assert parameter_count(given) == (7, "[budget] parameters")
    hf = RunConfig.model_validate(
        {"task": {"entrypoint": "diloco_anywhere.tasks.hf_causal_lm:build"}}
    )
    count, why = parameter_count(hf)
    assert count is None
    assert "set [budget] parameters" in why
    assert "hf_causal_lm" in why
    script = RunConfig.model_validate({"task": {"command": ["python", "train.py"]}})
    assert parameter_count(script)[0] is None
    bad = RunConfig.model_validate({"task": {"options": {"preset": "huge"}}})
    count, why = parameter_count(bad)
    assert count is None
    assert "'huge' unknown" in why
    negative = RunConfig.model_validate({"task": {"options": {"seq_len": -1}}})
    assert parameter_count(negative)[0] is None


# -- The estimate --------------------------------------------------------------------------


def _mixed_run() -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": {"store": "s3://bucket/prefix", "replicas": 5},
            "diloco": {"codec": "int8", "outer_steps": 10, "sync_every": 100},
            "budget": {"step_seconds": 1.0, "parameters": BILLION},
        }
    )


MIXED = {"sagemaker": ("ml.g5.xlarge", 2), "modal": ("H100", 2), "local": ("", 1)}


def test_the_estimate_of_a_mixed_run_by_hand():
    result = estimate(_mixed_run(), MIXED)
    round_hours = 100 * 1.0 / 3600
    assert result.hours == pytest.approx(10 * round_hours)
    assert result.compute_usd_per_hour == pytest.approx(2 * 1.408 + 2 * 0.001097 * 3600)
    # 5 replicas shard: each reads 2 P (n - 1) / n; SageMaker reads S3 in its own cloud, the
    # two Modal replicas and the local one pay AWS's egress for theirs; nobody bills writes
    down = 2 * INT8_1B * 4 // 5
    assert result.traffic.down == down
    egress_per_round = 3 * down / GIB * 0.09
    assert result.egress_usd_per_hour == pytest.approx(egress_per_round / round_hours)
    # requests per replica: parts ceil(1e9 / 2^20) = 954 -> 955 (a multiple of 5); puts: the
    # parts, the manifest, 2 listings, 955 / 5 reduced shards and the metrics chunk; gets:
    # the others' parts of its shards and their reduced shards, 4 manifests, 100 polls;
    # the heartbeat every 10 s: a listing, a put and a get
    puts = 955 + 1 + 2 + 191 + 1
    gets = 2 * 4 * 191 + 4 + 100
    per_hour = ((puts / round_hours + 720) * 0.005 + (gets / round_hours + 360) * 0.0004) / 1000
    assert result.requests_usd_per_hour == pytest.approx(5 * per_hour)
    assert result.usd == pytest.approx(result.usd_per_hour * result.hours)
    assert result.requests_usd_per_round == pytest.approx(5 * per_hour * round_hours)


def test_the_estimate_prices_the_same_runs_egress_in_every_codec():
    """Per day, all replicas: the run's own codec as its egress per hour says; the others as
    their traffic would bill (sparse gathers 4 x 78 MB where int8 shards 2 x 1.06 GB)."""
    result = estimate(_mixed_run(), MIXED)
    by_codec = result.egress_usd_per_day_by_codec
    assert list(by_codec) == ["fp32", "bf16", "int8", "sparse 8.01% 2-bit"]
    assert by_codec["int8"] == pytest.approx(24 * result.egress_usd_per_hour)
    round_hours = 100 * 1.0 / 3600
    sparse_per_round = 3 * 4 * SPARSE_1B / GIB * 0.09  # 3 replicas outside AWS read 4 P each
    assert by_codec["sparse 8.01% 2-bit"] == pytest.approx(24 / round_hours * sparse_per_round)
    assert (
        by_codec["fp32"] > by_codec["bf16"] > by_codec["int8"] > 5 * by_codec["sparse 8.01% 2-bit"]
    )
    assert any(
        "egress per day by codec ([diloco] codec; this run's: int8): fp32 $" in line
        for line in result.lines()
    )


def test_unpriced_hardware_counts_zero_and_is_named():
    result = estimate(_mixed_run(), MIXED)
    local = next(p for p in result.platforms if p.platform == "local")
    assert local.usd_per_replica_hour is None
    assert any("set [budget] hourly_usd.local" in what for what in result.unpriced)
    assert any("unpriced (counted as $0)" in line and "local" in line for line in result.lines())


def test_the_estimate_takes_run_toml_prices():
    config = _mixed_run().model_copy(
        update={
            "budget": BudgetSection(
                step_seconds=1.0, parameters=BILLION, hourly_usd={"local": 3.0, "modal/H100": 5.0}
            )
        }
    )
    result = estimate(config, MIXED)
    assert result.compute_usd_per_hour == pytest.approx(2 * 1.408 + 2 * 5.0 + 3.0)
    assert result.unpriced == ()


def test_an_unknown_model_size_leaves_traffic_out_and_says_so():
    config = RunConfig.model_validate(
        {"task": {"entrypoint": "my_task:build"}, "run": {"store": "s3://b/p"}}
    )
    rounds = plan_rounds(config.diloco, StepTime(2.0, "given"), ["modal"])
    result = estimate(config, {"modal": ("T4", 1)}, rounds=rounds)
    assert result.traffic is None
    assert result.egress_usd_per_hour == 0.0
    assert any("set [budget] parameters" in what for what in result.unpriced)
    assert result.compute_usd_per_hour == pytest.approx(0.000164 * 3600)
    # the heartbeats' requests remain: 5 replicas' worth is 1 here
    assert result.requests_usd_per_hour == pytest.approx((720 * 0.005 + 360 * 0.0004) / 1000)
    assert json.loads(json.dumps(result.as_dict()))["traffic"] is None


def _paced(pace: str, sagemaker: float = 4.0) -> RunConfig:
    """The mixed run, SageMaker's A10Gs ``sagemaker`` times slower a step than the rest (H100s
    on Modal)."""
    budget = {
        "step_seconds": 1.0,
        "parameters": BILLION,
        "platform_step_seconds": {"sagemaker": sagemaker},
    }
    return _mixed_run().model_copy(
        update={
            "budget": BudgetSection.model_validate(budget),
            "diloco": _mixed_run().diloco.model_copy(update={"pace": pace}),
        }
    )


def test_rounds_paced_by_steps_are_the_slowest_platforms_and_the_others_waiting_is_priced():
    result = estimate(_paced("steps"), MIXED)
    assert result.hours == pytest.approx(10 * 100 * 4.0 / 3600)  # every round at SageMaker's pace
    waiting = {p.platform: p.waiting for p in result.platforms}
    assert waiting == pytest.approx({"sagemaker": 0.0, "modal": 0.75, "local": 0.75})
    assert result.waiting_usd_per_hour == pytest.approx(0.75 * 2 * 0.001097 * 3600)  # local: $0
    lines = result.lines()
    assert any("modal x2" in line and "waits 75% of each round" in line for line in lines)
    waiting_line = next(line for line in lines if line.startswith("of it waiting"))
    assert f"${result.waiting_usd_per_hour * result.hours:,.2f} in all" in waiting_line
    assert 'pace = "time"' in waiting_line
    assert "with pace = 'steps' a round of 100 steps takes 400 s" in result.step.source
    assert result.step.seconds == pytest.approx(4.0)
    assert json.loads(json.dumps(result.as_dict()))["waiting_usd_per_hour"] > 0


def test_rounds_paced_by_time_take_the_fastest_platforms_time_and_nobody_waits():
    result = estimate(_paced("time", sagemaker=5.0), MIXED)
    assert result.hours == pytest.approx(10 * 100 * 1.0 / 3600)  # the H100s' pace
    assert {p.platform: p.round_steps for p in estimate_rounds(_paced("time", 5.0)).platforms} == {
        "sagemaker": 20,
        "modal": 100,
        "local": 100,
    }
    assert {p.platform: p.waiting for p in result.platforms} == pytest.approx(
        {"sagemaker": 0.0, "modal": 0.0, "local": 0.0}
    )
    assert result.waiting_usd_per_hour == 0.0
    assert not any(line.startswith("of it waiting") for line in result.lines())


def test_steps_that_fit_no_whole_unit_are_rounded_down_and_only_that_platform_waits_the_rest():
    """4 s a step fits 25 steps in the H100s' 100 s; steps come in units of 10, so it trains
    20 (80 s): the round still closes at 100 s, the H100s never wait, and it waits a fifth
    of the round (30, 120 s, would make every other replica wait a sixth)."""
    rounds = estimate_rounds(_paced("time", 4.0))
    assert rounds.round_seconds == pytest.approx(100.0)
    assert rounds.waiting_of("modal") == 0.0
    assert rounds.waiting_of("sagemaker") == pytest.approx(0.2)


def test_a_platform_too_slow_for_the_fewest_steps_holds_timed_rounds_up_and_is_priced():
    config = _paced("time", sagemaker=40.0)
    rounds = estimate_rounds(config)
    fewest = config.diloco.round_steps_bounds[0]
    assert rounds.round_seconds == pytest.approx(fewest * 40.0)
    assert {p.platform: p.round_steps for p in rounds.platforms} == {
        "sagemaker": fewest,
        "modal": 100,
        "local": 100,
    }
    assert rounds.waiting_of("modal") == pytest.approx(1 - 100 / (fewest * 40.0))
    result = estimate(config, MIXED)
    assert any("min_round_steps" in line for line in result.lines())


def estimate_rounds(config: RunConfig) -> RoundPlan:
    return round_plan_for(config, MIXED)


def test_a_platform_step_time_for_no_platform_is_refused_naming_the_platforms():
    config = _paced("steps")
    with pytest.raises(ConfigError, match=r"'sagemker': not a platform; the platforms are local, "):
        plan_rounds(config.diloco, StepTime(1.0, "given"), MIXED, {"sagemker": 4.0})


# -- Spend so far, and the cap -------------------------------------------------------------


def test_spend_so_far_by_hand():
    attempts = [
        Attempt("modal", "H100", 0.0, 2 * 3600.0),  # 2 h that ended
        Attempt("modal", "H100", 3 * 3600.0),  # running: 1 h by now
        Attempt("k8s", "", 0.0, None),  # 4 h, unpriced
    ]
    traffic = [ReplicaTraffic("modal", 5 * GIB, 10 * GIB), ReplicaTraffic("k8s", GIB, 2 * GIB)]
    spent = spend(attempts, traffic, _mixed_run(), now=4 * 3600.0, requests_usd=0.5)
    assert spent.replica_hours == {"modal": 3.0, "k8s": 4.0}
    assert spent.compute_usd == pytest.approx(3 * 3.9492)
    assert spent.egress_by_platform["modal"] == pytest.approx(10 * 0.09)
    assert spent.egress_by_platform["k8s"] == pytest.approx(2 * 0.09)
    assert spent.usd == pytest.approx(3 * 3.9492 + 12 * 0.09 + 0.5)
    assert len(spent.unpriced) == 2  # k8s's hardware, and its writes' cloud
    assert spent.lines()[0].endswith(f"= ${spent.usd:,.2f}")


def test_the_spend_says_what_compute_was_billed_while_replicas_waited_on_syncs():
    """A fast replica on Modal waiting on a slow one 60% of its time (``pace = "steps"``)."""
    attempts = [Attempt("modal", "H100", 0.0, 2 * 3600.0), Attempt("k8s", "", 0.0, 3600.0)]
    traffic = [ReplicaTraffic("modal", 0, 0, 0.6), ReplicaTraffic("k8s", 0, 0, 0.02)]
    spent = spend(attempts, traffic, _mixed_run(), now=2 * 3600.0)
    assert spent.idle_by_platform["modal"] == pytest.approx(0.6 * 2 * 3.9492)
    assert spent.idle_by_platform["k8s"] == 0.0  # unpriced: nothing billed idle either
    modal = next(line for line in spent.lines() if line.startswith("  modal"))
    assert f"(${0.6 * 2 * 3.9492:,.2f} of it waiting on syncs)" in modal


def test_traffic_so_far_sums_every_incarnation():
    def sync(up: int, down: int) -> SimpleNamespace:
        return SimpleNamespace(bytes_up=up, bytes_down=down)

    metrics = {
        "modal-0": SimpleNamespace(
            platform="modal", last_sync_by_incarnation={0: sync(10, 20), 1: sync(5, 7)}, syncs=[]
        ),
        "local-0": SimpleNamespace(platform="local", last_sync_by_incarnation={}, syncs=[]),
    }
    assert traffic_so_far(metrics) == [
        ReplicaTraffic("modal", 15, 27),
        ReplicaTraffic("local", 0, 0),
    ]


def test_over_budget_says_which_cap_and_none_without_caps():
    spent = spend([Attempt("hf_jobs", "h200", 0.0, 10 * 3600.0)], [], _mixed_run(), now=0.0)
    assert spent.usd == pytest.approx(50.0)
    assert over_budget(BudgetSection(), spent, hours=1000.0) is None
    assert over_budget(BudgetSection(max_usd=60.0, max_hours=11.0), spent, hours=10.0) is None
    assert over_budget(BudgetSection(max_usd=50.0), spent, hours=10.0) == (
        "the run's spend at list prices, $50.00, reached [budget] max_usd = $50.00"
    )
    assert over_budget(BudgetSection(max_hours=10.0), spent, hours=10.5) == (
        "the run has run 10.5 h since its launch, reaching [budget] max_hours = 10"
    )


def test_budget_fields_are_checked_on_load():
    config = parse_config('[budget]\nparameters = 10\nclouds = { k8s = "gcp" }\n', "run.toml")
    assert (config.budget.parameters, config.budget.clouds) == (10, {"k8s": "gcp"})
    with pytest.raises(ConfigError) as error:
        parse_config('[budget]\nparameters = -1\nclouds = { k8s = "ibm" }\n', "run.toml")
    lines = str(error.value).splitlines()
    assert any(line.startswith("run.toml: budget.parameters = -1") for line in lines)
    assert any(line.startswith("run.toml: budget.clouds.k8s = 'ibm'") for line in lines)
