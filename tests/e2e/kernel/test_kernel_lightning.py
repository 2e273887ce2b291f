"""PyTorch Lightning in a taas cell: it detects the torchrun-style launch and needs no init."""

from __future__ import annotations

from support.cells import REGRESSION


def test_lightning_trainer_runs_ddp_across_the_ranks_without_process_group_code(kernel):
    kernel.execute(REGRESSION).ok()
    result = kernel.execute(
        """#pragma taas --gpus 2
import torch.distributed as dist
model = Regression()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(TensorDataset(X, Y), batch_size=32))
w = model.layer.weight.detach().flatten()
print("RESULT", trainer.global_rank, trainer.world_size, type(trainer.strategy.cluster_environment).__name__,
      dist.get_world_size(), [round(v, 3) for v in w.tolist()])
""",
        timeout=180,
    ).ok()
    lines = [line.split("RESULT ", 1)[1] for line in result.stdout.splitlines() if "RESULT" in line]
    assert len(lines) == 2, result.stdout + result.stderr
    ranks = sorted(line.split()[0] for line in lines)
    assert ranks == ["0", "1"]
    assert all("2 TorchElasticEnvironment 2" in line for line in lines)
    weights = {line.split("[", 1)[1] for line in lines}
    assert len(weights) == 1, "DDP kept both ranks' weights identical"
    # The trained LightningModule comes back to the notebook with rank 0's weights.
    assert kernel.value("type(model).__name__") == "Regression"
    back = kernel.value("str([round(v, 3) for v in model.layer.weight.detach().flatten().tolist()])")
    assert "[" + weights.pop() == back
