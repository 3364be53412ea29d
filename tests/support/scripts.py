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
