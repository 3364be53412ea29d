"""Where a run's objects live in its store: one method per kind of key (docs/collective.md).

Round numbers are zero-padded so that a listing sorts rounds in order. A contributor is named
``{replica}-{incarnation}``; the incarnation is digits only, so the name splits back
unambiguously even when the replica name contains '-'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROUND_DIGITS = 10
MAX_ROUND = 10**ROUND_DIGITS - 1
# Same rule as the wire header's names: usable as one store key segment.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}")


def check_name(name: str, what: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(
            f"{what} {name!r} is not allowed: 1-128 letters, digits, '_', '.', '=', '-', "
            f"starting with a letter, digit or '_'"
        )
    return name


MAX_COUNT = 2**63 - 1
MAX_RANK = 4095  # processes of one replica
MAX_LAUNCH = 999_999  # launches of one run, and starts of one replica in a launch
DIGITS = re.compile(r"[0-9]{1,19}")


def parse_count(text: str, maximum: int = MAX_COUNT) -> int | None:
    """A whole number written in ASCII digits (as this code writes rounds, incarnations,
    periods and shards into keys) from 0 to ``maximum``; None for anything else. Every number
    read from a key goes through here: ``str.isdigit`` also accepts digits such as '²' that
    ``int`` refuses, and an unbounded number overflows what a record may hold."""
    if not DIGITS.fullmatch(text):
        return None
    value = int(text)
    return value if value <= maximum else None


def _check_count(value: int, what: str, maximum: int = MAX_COUNT) -> int:
    if not (isinstance(value, int) and 0 <= value <= maximum):
        raise ValueError(f"{what} {value!r} is not allowed: an integer from 0 to {maximum}")
    return value


def contributor(replica: str, incarnation: int) -> str:
    return f"{check_name(replica, 'replica')}-{_check_count(incarnation, 'incarnation')}"


def parse_contributor(name: str) -> tuple[str, int]:
    """``'modal-0-3'`` -> ``('modal-0', 3)``."""
    replica, _, incarnation = name.rpartition("-")
    number = parse_count(incarnation)
    if not (replica and number is not None and NAME.fullmatch(replica)):
        raise ValueError(f"contributor {name!r} is not '<replica>-<incarnation>'")
    return replica, number


@dataclass(frozen=True)
class Participant:
    """One incarnation of one replica: the unit that contributes to rounds."""

    replica: str
    incarnation: int

    @property
    def name(self) -> str:
        return contributor(self.replica, self.incarnation)


@dataclass(frozen=True)
class RunLayout:
    """The keys of run ``run``. ``rank``: the process of a sharded replica (``sharding =
    "fsdp"``) whose exchange these keys are: rank r of every replica claims its membership and
    runs its rounds under ``{run}/ranks/{r}/`` (rank 0 under the run itself, so the run's tools
    read a sharded run as any other); checkpoints, metrics and configs are the run's."""

    run: str
    rank: int = 0

    def __post_init__(self) -> None:
        check_name(self.run, "run")
        _check_count(self.rank, "rank", MAX_RANK)

    @property
    def exchange(self) -> str:
        """Where this rank's membership and rounds live."""
        return self.run if self.rank == 0 else f"{self.run}/ranks/{self.rank}"

    def config(self, checksum: int) -> str:
        """The run.toml a launcher published for remote replicas (``published_config.py``)."""
        return f"{self.run}/configs/{_check_count(checksum, 'checksum', 2**32 - 1):08x}.toml"

    def sharding(self) -> str:
        """How the run's replicas hold the model: the first replica's record, which every
        later one must match (``training.sharding.check_sharding``)."""
        return f"{self.run}/sharding"

    def initial_state(self) -> str:
        """The run's initial model (this rank's shard of it), as its first replica recorded
        it, which every replica starting before the first checkpoint must match
        (``training.initial_state``)."""
        return f"{self.exchange}/initial-state"

    def replica_index(self, index: int, member: Participant) -> str:
        """Incarnation ``member`` took data shard ``index`` (``training.replica_index``): one
        running replica per index."""
        return f"{self.replica_indices(index)}/{member.name}"

    def replica_indices(self, index: int) -> str:
        """The folder of the incarnations given ``index``, each a key named by its
        contributor name (``parse_contributor``)."""
        return f"{self.run}/indices/{_check_count(index, 'replica index'):06d}"

    # -- membership --------------------------------------------------------------------------------

    def members(self) -> str:
        return f"{self.exchange}/members"

    def incarnations(self, replica: str) -> str:
        return f"{self.members()}/{check_name(replica, 'replica')}"

    def claim(self, replica: str, incarnation: int) -> str:
        return f"{self.incarnations(replica)}/{_check_count(incarnation, 'incarnation')}/claim"

    def lease(self, replica: str, incarnation: int, beat: int) -> str:
        """Lease ``beat`` of an incarnation: its heartbeat's counter, never a time."""
        folder = f"{self.incarnations(replica)}/{_check_count(incarnation, 'incarnation')}"
        return f"{folder}/lease-{_check_count(beat, 'lease beat')}"

    def departure(self, replica: str) -> str:
        """How a replica's newest incarnation to leave left: a reason, and whether it will
        come back as it is (``collective.departures``)."""
        return f"{self.exchange}/departures/{check_name(replica, 'replica')}"

    def parse_member_key(self, key: str) -> tuple[str, int, int | None] | None:
        """``members/{replica}/{incarnation}/claim`` -> (replica, incarnation, None);
        ``.../lease-{beat}`` -> (replica, incarnation, beat); anything else -> None."""
        prefix = f"{self.members()}/"
        parts = key.removeprefix(prefix).split("/") if key.startswith(prefix) else []
        if len(parts) != 3 or not NAME.fullmatch(parts[0]):
            return None
        incarnation = parse_count(parts[1])
        if incarnation is None:
            return None
        if parts[2] == "claim":
            return parts[0], incarnation, None
        if not parts[2].startswith("lease-"):
            return None
        beat = parse_count(parts[2].removeprefix("lease-"))
        return None if beat is None else (parts[0], incarnation, beat)

    # -- rounds ------------------------------------------------------------------------------------

    def rounds(self) -> str:
        return f"{self.exchange}/rounds"

    def round(self, round_: int) -> str:
        return f"{self.rounds()}/{_check_count(round_, 'round', MAX_ROUND):0{ROUND_DIGITS}d}"

    def fragment(self, round_: int, fragment: int) -> str:
        return f"{self.round(round_)}/{_check_count(fragment, 'fragment')}"

    def parts(self, round_: int, fragment: int, replica: str, incarnation: int) -> str:
        return f"{self.fragment(round_, fragment)}/parts/{contributor(replica, incarnation)}"

    def part(self, round_: int, fragment: int, replica: str, incarnation: int, shard: int) -> str:
        folder = self.parts(round_, fragment, replica, incarnation)
        return f"{folder}/{_check_count(shard, 'shard')}"

    def manifests(self, round_: int, fragment: int) -> str:
        return f"{self.fragment(round_, fragment)}/manifests"

    def manifest(self, round_: int, fragment: int, replica: str, incarnation: int) -> str:
        return f"{self.manifests(round_, fragment)}/{contributor(replica, incarnation)}"

    def seal(self, round_: int, fragment: int) -> str:
        return f"{self.fragment(round_, fragment)}/SEAL"

    def parse_seal(self, key: str) -> int | None:
        """``rounds/{round}/{fragment}/SEAL`` -> round; anything else -> None."""
        parts = key.removeprefix(f"{self.rounds()}/").split("/")
        if key.startswith(f"{self.rounds()}/") and len(parts) == 3 and parts[2] == "SEAL":
            fragment = parse_count(parts[1])
            return None if fragment is None else parse_count(parts[0], MAX_ROUND)
        return None

    def reduced(self, round_: int, fragment: int, shard: int) -> str:
        return f"{self.fragment(round_, fragment)}/reduced/{_check_count(shard, 'shard')}"

    # -- global checkpoints ------------------------------------------------------------------------

    def checkpoints(self) -> str:
        return f"{self.run}/checkpoints"

    def checkpoint(self, round_: int) -> str:
        """The global state after round ``round_`` (``training/checkpoints/``)."""
        return f"{self.checkpoints()}/{_check_count(round_, 'round', MAX_ROUND):0{ROUND_DIGITS}d}"

    def checkpoint_part(self, round_: int, rank: int | None = None) -> str:
        """The folder of one rank's part of a sharded replica's checkpoint; the checkpoint's
        own folder for an unsharded one (``rank`` None)."""
        folder = self.checkpoint(round_)
        return (
            folder if rank is None else f"{folder}/rank-{_check_count(rank, 'rank', MAX_RANK):04d}"
        )

    def checkpoint_shard(self, round_: int, shard: int, rank: int | None = None) -> str:
        folder = self.checkpoint_part(round_, rank)
        return f"{folder}/shard-{_check_count(shard, 'shard'):05d}.safetensors"

    def checkpoint_state(self, round_: int, rank: int | None = None) -> str:
        return f"{self.checkpoint_part(round_, rank)}/state"

    def checkpoint_rank_done(self, round_: int, rank: int) -> str:
        """Rank ``rank``'s record of its part (written last), for rank 0 to commit."""
        return f"{self.checkpoint_part(round_, rank)}/PART"

    def checkpoint_commit(self, round_: int) -> str:
        return f"{self.checkpoint(round_)}/COMMIT"

    def parse_checkpoint_commit(self, key: str) -> int | None:
        """``checkpoints/{round}/COMMIT`` -> round; anything else (a number past ``MAX_ROUND``
        included: no key of that round can be built) -> None."""
        parts = key.removeprefix(f"{self.checkpoints()}/").split("/")
        if key.startswith(f"{self.checkpoints()}/") and len(parts) == 2 and parts[1] == "COMMIT":
            return parse_count(parts[0], MAX_ROUND)
        return None

    # -- a replica's own state (training/recovery/own_state.py) ------------------------------------

    def replica_states(self, replica: str) -> str:
        """Where replica ``replica`` keeps its own state (inner optimizer, random generators,
        local weights), saved at the run's checkpoint steps; no other replica reads it."""
        return f"{self.run}/replicas/{check_name(replica, 'replica')}/state"

    def replica_state(self, replica: str, round_: int) -> str:
        """Replica ``replica``'s own state after round ``round_``."""
        number = _check_count(round_, "round", MAX_ROUND)
        return f"{self.replica_states(replica)}/{number:0{ROUND_DIGITS}d}"

    def replica_state_shard(self, replica: str, round_: int, shard: int) -> str:
        folder = self.replica_state(replica, round_)
        return f"{folder}/shard-{_check_count(shard, 'shard'):05d}.safetensors"

    def replica_state_structure(self, replica: str, round_: int) -> str:
        return f"{self.replica_state(replica, round_)}/state"

    def replica_state_commit(self, replica: str, round_: int) -> str:
        """Written last, create-only: the saved state exists once this record does."""
        return f"{self.replica_state(replica, round_)}/COMMIT"

    def parse_replica_state_commit(self, replica: str, key: str) -> int | None:
        """``replicas/{replica}/state/{round}/COMMIT`` -> round; anything else -> None."""
        prefix = f"{self.replica_states(replica)}/"
        parts = key.removeprefix(prefix).split("/")
        if key.startswith(prefix) and len(parts) == 2 and parts[1] == "COMMIT":
            return parse_count(parts[0], MAX_ROUND)
        return None

    # -- the training data's stream (data/claims.py) -----------------------------------------------

    def data_plan(self) -> str:
        """How the run's data stream is cut (corpus, seq_len, unit size), as its first replica
        planned it: every later one must match (create-only)."""
        return f"{self.run}/data/plan"

    def data_claims(self) -> str:
        return f"{self.run}/data/claims"

    def data_corpus(self) -> str:
        """The run's own copy of a raw corpus, prepared on the fly (data/prepare_once.py)."""
        return f"{self.run}/data/corpus"

    def data_claim(self, unit: int, attempt: int) -> str:
        """Attempt ``attempt`` at training unit ``unit`` of the data stream (create-only: taking
        it is taking the unit)."""
        unit, attempt = _check_count(unit, "unit"), _check_count(attempt, "attempt", MAX_LAUNCH)
        return f"{self.data_claims()}/{unit:012d}-{attempt:06d}"

    def parse_data_claim(self, key: str) -> tuple[int, int] | None:
        """``data/claims/{unit}-{attempt}`` -> (unit, attempt); anything else -> None."""
        name = key.removeprefix(f"{self.data_claims()}/")
        unit, _, attempt = name.partition("-")
        if not key.startswith(f"{self.data_claims()}/") or "/" in name:
            return None
        numbers = parse_count(unit), parse_count(attempt, MAX_LAUNCH)
        return None if None in numbers else numbers  # type: ignore[return-value]

    # -- launches (launching/start/launches.py) ----------------------------------------------------

    def launches(self) -> str:
        return f"{self.run}/launches"

    def launch_folder(self, number: int) -> str:
        return f"{self.launches()}/{_check_count(number, 'launch', MAX_LAUNCH):06d}"

    def launch(self, number: int) -> str:
        """Launch ``number``'s record: taking it is taking the number (create-only)."""
        return f"{self.launch_folder(number)}/LAUNCH"

    def launch_job(self, number: int, replica: str, attempt: int) -> str:
        """The job of one start (``attempt``) of ``replica`` in launch ``number``."""
        folder = f"{self.launch_folder(number)}/jobs/{check_name(replica, 'replica')}"
        return f"{folder}/{_check_count(attempt, 'attempt', MAX_LAUNCH):06d}"

    def launch_stopped(self, number: int, replica: str, attempt: int) -> str:
        """``diloco stop`` stopped ``attempt`` of ``replica`` of launch ``number`` on purpose:
        not to be restarted (a later attempt, started by ``diloco replace``, is not)."""
        folder = f"{self.launch_folder(number)}/stopped/{check_name(replica, 'replica')}"
        return f"{folder}/{_check_count(attempt, 'attempt', MAX_LAUNCH):06d}"

    def launch_restart(self, number: int, replica: str, attempt: int) -> str:
        """A keeper's claim to start ``attempt`` of ``replica`` (create-only: one keeper acts),
        and why (``launching/keep/keeper.py``)."""
        folder = f"{self.launch_folder(number)}/restarts/{check_name(replica, 'replica')}"
        return f"{folder}/{_check_count(attempt, 'attempt', MAX_LAUNCH):06d}"

    def launch_end(self, number: int) -> str:
        """Launch ``number`` was ended by a keeper (done, or out of budget), and why
        (create-only: one keeper stops the replicas)."""
        return f"{self.launch_folder(number)}/END"

    def launch_alert(self, number: int, event: str) -> str:
        """Alert ``event`` of launch ``number`` was sent (create-only: sent once, by whoever
        observed it first; ``launching/keep/alerts.py``)."""
        return f"{self.launch_folder(number)}/alerts/{check_name(event, 'alert event')}"

    def parse_launch(self, key: str) -> int | None:
        """``launches/{number}/LAUNCH`` -> number; anything else -> None."""
        parts = key.removeprefix(f"{self.launches()}/").split("/")
        if key.startswith(f"{self.launches()}/") and parts[1:] == ["LAUNCH"]:
            return parse_count(parts[0], MAX_LAUNCH)
        return None

    def parse_launch_key(self, key: str, number: int) -> tuple[str, str, int] | None:
        """A key of launch ``number``: ``(kind, replica, attempt)`` with kind ``job``,
        ``restart`` or ``stopped``; None for anything else."""
        prefix = f"{self.launch_folder(number)}/"
        parts = key.removeprefix(prefix).split("/") if key.startswith(prefix) else []
        kinds = {"jobs": "job", "restarts": "restart", "stopped": "stopped"}
        if len(parts) == 3 and parts[0] in kinds and NAME.fullmatch(parts[1]):
            attempt = parse_count(parts[2], MAX_LAUNCH)
            return None if attempt is None else (kinds[parts[0]], parts[1], attempt)
        return None

    # -- the status page (launching/watch/status_page.py) ------------------------------------------

    def status_page(self) -> str:
        """The run's status as one self-contained HTML page, written by each keeper pass."""
        return f"{self.run}/status/index.html"

    def status_json(self) -> str:
        """The same status as JSON, for scripts."""
        return f"{self.run}/status/status.json"

    def clock(self, nonce: str) -> str:
        """A small object a keeper writes, reads the time of (``Store.modified``) and deletes:
        the store's clock is the one every keeper shares, whatever their own say."""
        return f"{self.run}/status/clock-{check_name(nonce, 'nonce')}"

    # -- files a script adds to the export (training/state/export_files.py) ------------------------

    def export_files(self) -> str:
        return f"{self.run}/export"

    def export_file(self, name: str) -> str:
        """A file ``diloco export`` writes beside the weights, e.g. a model's config.json."""
        return f"{self.export_files()}/{check_name(name, 'export file')}"

    # -- metrics -----------------------------------------------------------------------------------

    def metrics(self) -> str:
        return f"{self.run}/metrics"

    def metrics_chunk(self, replica: str, incarnation: int, seq: int) -> str:
        """One chunk of a replica incarnation's metrics; ``seq`` counts its chunks."""
        folder = f"{self.metrics()}/{check_name(replica, 'replica')}"
        incarnation, seq = _check_count(incarnation, "incarnation"), _check_count(seq, "seq")
        return f"{folder}/{incarnation:06d}-{seq:08d}"
