"""What a CPU engine process imports: building a model on the meta device must not pull in
torch._dynamo (with sympy and triton, 133 MiB resident), which nothing on the CPU path uses
(rein.model.loader.no_weight_init)."""

from __future__ import annotations

import subprocess
import sys

import torch

from rein.model.loader import WEIGHT_INITS, no_weight_init

LOAD_AND_LIST = """
import sys, torch
from rein.model.files import resolve_model
from rein.model.loader import load_model
from rein.model.spec import ModelSpec
files = resolve_model(sys.argv[1])
model = load_model(files, ModelSpec.from_dir(files.directory), 64, torch.float32, torch.device("cpu"))
with torch.inference_mode():
    model.compute_logits(torch.randn(3, model.spec.hidden_size))
print(sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
"""


def test_loading_a_model_on_the_cpu_imports_no_dynamo(tiny_models):
    out = subprocess.run([sys.executable, "-c", LOAD_AND_LIST, str(tiny_models())], capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_no_weight_init_leaves_tensors_as_they_are_and_restores_the_initializers():
    before = {name: getattr(torch.nn.init, name) for name in WEIGHT_INITS}
    weight = torch.full((4, 3), 7.0)
    with no_weight_init():
        torch.nn.init.normal_(weight)
        torch.nn.init.kaiming_uniform_(weight, a=5 ** 0.5)
        layer = torch.nn.Linear(3, 4)   # reset_parameters runs, touching nothing
    assert torch.equal(weight, torch.full((4, 3), 7.0))
    assert {name: getattr(torch.nn.init, name) for name in WEIGHT_INITS} == before
    torch.nn.init.normal_(weight)
    assert not torch.equal(weight, torch.full((4, 3), 7.0)) and layer.weight.shape == (4, 3)
