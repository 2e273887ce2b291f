"""An FSDP2 model trained in a taas cell comes back into the notebook whole, as the plain model it wraps."""

from __future__ import annotations

import pytest

from taas_magic.rank.sharded import DESTROYED

pytestmark = pytest.mark.kernel

# A small decoder-only Transformer, its data and one training step, defined in the notebook itself.
NOTEBOOK = """
import copy
import torch
from torch import nn
from torch.nn import functional as F

class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(batch, length, dim))

class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))

class Transformer(nn.Module):
    def __init__(self, vocabulary=32, dim=16, heads=2, layers=2, length=8):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocabulary, dim), nn.Embedding(length, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocabulary, bias=False)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

def train_step(model, optimizer, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()

torch.manual_seed(0)
initial = Transformer()
data = torch.randint(0, 32, (3, 2, 4, 9))  # steps, ranks, sequences, tokens
"""

# The model of NOTEBOOK, sharded per block and on the root, with its optimizer: what a rank's cell starts with.
SHARDED = """import torch.distributed as dist, taas
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
model = copy.deepcopy(initial)
for block in model.layers:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
"""


def test_an_fsdp2_transformer_trained_in_two_ranks_comes_back_whole_and_equals_one_trained_unsharded(kernel):
    kernel.execute(NOTEBOOK).ok()
    result = kernel.execute(
        "%%taas --gpus 2 --device cpu\n"
        + SHARDED
        + """\
losses = [train_step(model, optimizer, data[step, taas.rank()]) for step in range(3)]
""",
        timeout=60,
    ).ok()
    assert result.stderr == ""
    assert kernel.value("[c.__name__ for c in type(model).__mro__]") == ["Transformer", "Module", "object"]
    assert kernel.value("[type(m).__name__ for m in model.layers] + [type(block).__name__]") == ["Block"] * 3
    assert kernel.value("block is model.layers[1]") is True
    assert kernel.value("sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())") == 0
    assert kernel.value("{type(p).__name__ for p in model.parameters()}") == {"Parameter"}
    # The same model trained here, unsharded, on both ranks' batches at once: FSDP averages the ranks' gradients.
    kernel.execute("""
reference = copy.deepcopy(initial)
reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
reference_losses = [train_step(reference, reference_optimizer, data[step].flatten(0, 1)) for step in range(3)]
expected = reference.state_dict()
""").ok()
    assert kernel.value("list(model.state_dict()) == list(expected)") is True
    assert (
        kernel.value(
            "[name for name, value in model.state_dict().items() "
            "if not torch.allclose(value, expected[name], rtol=1e-5, atol=1e-6)]"
        )
        == []
    )
    assert kernel.value("torch.allclose(model(data[0, 0, :, :-1]), reference(data[0, 0, :, :-1]), atol=1e-5)") is True
    assert kernel.value("optimizer.state[model.head.weight]['exp_avg'].shape == model.head.weight.shape") is True
    kernel.execute("train_step(model, optimizer, data[0, 0])").ok()  # model and optimizer keep training here, on CPU


def test_a_cell_that_destroys_its_process_group_is_told_in_one_line_what_to_do(kernel):
    kernel.execute(NOTEBOOK).ok()
    result = kernel.execute(
        """%%taas --gpus 2 --device cpu
import torch.distributed as dist, taas
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
sharded_model = fully_shard(copy.deepcopy(initial))
loss = sharded_model(data[0, taas.rank(), :, :-1]).sum()
loss.backward()  # FSDP reshards after backward: the parameters are DTensors again
loss = loss.item()
dist.destroy_process_group()
""",
        timeout=30,
    ).ok()
    assert result.stderr == f"taas: not copied back from rank 0: sharded_model ({DESTROYED})\n"
    assert kernel.value("('sharded_model' in globals(), type(loss).__name__)") == (False, "float")


def test_a_session_keeps_training_its_sharded_model_after_sending_it_back_whole(kernel):
    kernel.execute(NOTEBOOK).ok()
    try:
        kernel.execute(
            "%%taas --gpus 2 --device cpu --keep\n"
            + SHARDED
            + """\
losses = [train_step(model, optimizer, data[0, taas.rank()])]
""",
            timeout=60,
        ).ok()
        assert kernel.value("type(model).__name__") == "Transformer"
        # A cell in part of the ranks cannot gather what is sharded over all of them: it says so, and waits for nothing.
        result = kernel.execute("%%taas --ranks 0 --return model,losses\nlosses = losses\n", timeout=30).ok()
        assert result.stderr == (
            "taas: not copied back from rank 0: model (sharded over ranks 0-1, and this cell runs in rank 0 only)\n"
        )
        result = kernel.execute(
            """%%taas --return model,optimizer,still_sharded
losses += [train_step(model, optimizer, data[step, taas.rank()]) for step in (1, 2)]
still_sharded = type(model).__name__, type(model.head.weight).__name__
""",
            timeout=60,
        ).ok()
        assert result.stderr == ""
    finally:
        kernel.execute("%taas stop")
    assert kernel.value("still_sharded") == ("FSDPTransformer", "DTensor")
    kernel.execute("""
reference = copy.deepcopy(initial)
reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
reference_losses = [train_step(reference, reference_optimizer, data[step].flatten(0, 1)) for step in range(3)]
expected = reference.state_dict()
""").ok()
    assert (
        kernel.value(
            "[name for name, value in model.state_dict().items() "
            "if not torch.allclose(value, expected[name], rtol=1e-5, atol=1e-6)]"
        )
        == []
    )
    assert kernel.value("optimizer.param_groups[0]['params'][0] is model.tokens.weight") is True
