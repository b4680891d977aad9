"""deepinfer.models.cpu: the CPU's module swaps keep the parameters and the outputs of the modules they replace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer.kernels import cpu_linear, get_ops
from deepinfer.models import cpu as cpu_modules
from deepinfer.models.config import ModelConfig
from deepinfer.models.layers import MLP


def _config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=16, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16)


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_install_swaps_the_mlp_and_its_linears_keeping_its_outputs(rows):
    g = torch.Generator().manual_seed(3)
    mlp = MLP(_config(), get_ops("cpu"))
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    x = torch.randn(rows, 64, generator=g)
    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    with torch.inference_mode():
        expected = mlp(x)
    cpu_modules.install(mlp)
    assert type(mlp) is cpu_modules.CpuMLP
    assert type(mlp.gate_up_proj) is cpu_linear.CpuLinear and type(mlp.down_proj) is cpu_linear.CpuLinear
    assert mlp.state_dict().keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in mlp.state_dict().items())
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), expected, atol=2e-5, rtol=2e-5)


def test_install_leaves_other_modules_alone():
    """Only exact nn.Linear / layers.MLP: a subclass (a tensor-parallel or GeGLU module) keeps its own forward."""

    class OtherLinear(nn.Linear):
        pass

    model = nn.Sequential(OtherLinear(4, 4), nn.Linear(4, 4))
    cpu_modules.install(model)
    assert type(model[0]) is OtherLinear and type(model[1]) is cpu_linear.CpuLinear
