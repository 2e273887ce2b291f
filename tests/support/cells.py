"""Notebook cells that tests of more than one module run: a Lightning regression module with its
data (the Lightning and CUDA tests), a small transformer with its training step (the sharded
models' tests, on CPU and on GPUs), a registered loader whose elements say where they were built
(the delivery tests, on this machine and on a cluster), and the lines that end a training cell with every
rank's steps and parameters gathered, with what each rank printed of its passes (the healing tests with served
loaders, on this machine and on a cluster)."""

import json
import re


def indices_loader(origin: str) -> str:
    """A cell that defines ``Indices(n, fail_at=None)``, whose element i is ``(i, origin)`` (``origin``: an
    expression evaluated where the element is built; ``fail_at``: the element that raises), and registers
    ``loader`` over 50 of them, shuffled from seed 0, 4 to a batch."""
    return f"""
import json, os, torch, taas
from torch.utils.data import DataLoader, Dataset
class Indices(Dataset):
    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"sample {{i}} is corrupt")
        return torch.tensor([i, {origin}])
torch.manual_seed(0)
loader = DataLoader(Indices(50), batch_size=4, shuffle=True)
taas.register(loader)
"""


REGRESSION = """
import torch, pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
X = torch.randn(256, 4)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
"""  # a tiny model and its data, defined in the notebook

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


# The end of a training cell: every rank's optimizer steps and the sum of its parameters, gathered and printed
# (``replicas_equal``). The cell defines ``model`` and counts ``steps``; ``dist`` and ``json`` are imported.
GATHERED_STATE = """state = [steps, sum(p.sum().item() for p in model.parameters())]
every = [None] * dist.get_world_size()
dist.all_gather_object(every, state)
print("STATE " + json.dumps(every), flush=True)
"""


def replicas_equal(result) -> bool:
    """Whether a cell ending with ``GATHERED_STATE`` found the same steps and parameters in every rank."""
    states = set(re.findall(r"STATE (.*)", result.stdout))
    return len(states) == 1 and len({json.dumps(each) for each in json.loads(states.pop())}) == 1


def drawn_passes(result, word: str) -> dict[int, list]:
    """What each rank printed as JSON after ``word`` (``print("TOOK " + json.dumps(took))``), by rank."""
    return {
        int(rank): json.loads(found) for rank, found in re.findall(rf"\[rank (\d)\] {word} (.*)", result.each_rank())
    }
