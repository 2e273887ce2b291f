"""An FSDP2 model trained in a taas cell comes back into the notebook whole, as the plain model it wraps."""

from __future__ import annotations

from support.cells import NOTEBOOK

from taas_magic.rank.sharded import DESTROYED

# Sharded and unsharded training add the same float32 numbers in another order (FSDP's reduce-scatter of two
# ranks' gradients, against one batch of both): a few ulps apart after three steps, more on CPUs whose kernels
# round otherwise (1.5e-6 on one weight with AVX-512). A step of AdamW moves a weight by about its lr, 1e-2.
ATOL = 1e-5

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
            f"if not torch.allclose(value, expected[name], rtol=1e-5, atol={ATOL})]"
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
            f"if not torch.allclose(value, expected[name], rtol=1e-5, atol={ATOL})]"
        )
        == []
    )
    assert kernel.value("optimizer.param_groups[0]['params'][0] is model.tokens.weight") is True
