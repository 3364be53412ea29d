"""Training scripts of the docs' plain loop that tests launch as `[task] command` replicas,
each with its own mistake in how it builds the model."""

from __future__ import annotations

LOOP = """

def data(start):
    while True:
        yield torch.randn(8, 4)


with diloco_anywhere.join() as replica:
    with replica.diloco(model, inner) as training:
        for x in training.batches(data):
            model(x).pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
"""


def loop_script(setup: str) -> str:
    """A replica script: ``setup`` builds ``model`` and ``inner`` (its optimizer), the loop
    trains them under ``replica.diloco`` on random batches."""
    return f"import os\nimport time\nimport torch\nimport diloco_anywhere\n\n{setup}{LOOP}"


LINEAR = "model = torch.nn.Linear(4, 1)\ninner = torch.optim.SGD(model.parameters(), lr=0.1)\n"
SEEDED_ALIKE = loop_script("torch.manual_seed(0)\n" + LINEAR)
SEEDED_PER_REPLICA = loop_script(  # the mistake: a seed per replica
    'torch.manual_seed(int(os.environ["DILOCO_REPLICA_INDEX"]))\n' + LINEAR
)
FAILS_BEFORE_JOIN_ON_INDEX_1 = loop_script(  # the mistake: replica 1 dies before it joins
    'if os.environ["DILOCO_REPLICA_INDEX"] == "1":\n    raise SystemExit("no such file: data/")\n'
    "torch.manual_seed(0)\n" + LINEAR
)

# Replica 0 trains the run to its end; every other index raises one of this project's mistakes
# outside `with replica:` (after join, as a Trainer built before the `with` does), and index 7
# before it joins (at the script's import of its settings).
MISTAKES = {
    1: ("ConfigError", "diloco_anywhere.config"),
    2: ("SharedOutputDirError", "diloco_anywhere.training.mistakes"),
    3: ("TrainingOutsideDilocoError", "diloco_anywhere.training.mistakes"),
    4: ("NotSyncingError", "diloco_anywhere.training.mistakes"),
    5: ("ModelUnlikeRunError", "diloco_anywhere.training.mistakes"),
    6: ("RunCannotGoOnError", "diloco_anywhere.training.mistakes"),
}
BEFORE_JOIN = 7
MISTAKEN = loop_script(
    f"""import importlib

MISTAKES = {MISTAKES!r}
index = int(os.environ["DILOCO_REPLICA_INDEX"])
if index == {BEFORE_JOIN}:
    from diloco_anywhere.config import ConfigError
    raise ConfigError("replica 7's settings: raised before join")
if index in MISTAKES:
    name, module = MISTAKES[index]
    replica = diloco_anywhere.join()
    raise getattr(importlib.import_module(module), name)(f"{{name}} outside the with")
torch.manual_seed(0)
"""
    + LINEAR
)
