"""A plain Hugging Face Trainer script (no ddtop line): a 2-layer GPT-2 of a few
thousand weights built from a config (nothing downloaded), random token
sequences, `use_cpu=True`, no saving, no reporting; STEPS optimizer steps
(default 8). Run by torchrun or `ddtrain start -n 2`, each rank is one process of
Accelerate's multi-CPU set-up (a gloo group, DDP). The Trainer all-gathers the
number of items in the batch before every step: a collective of its own.

    ddtrain start -n 2 tests/scripts/fw_hf_trainer.py
"""

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, count: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    steps = int(os.environ.get("STEPS", "8"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    # In the working directory: a rank killed (a drill's hang) leaves it where the run is.
    with tempfile.TemporaryDirectory(prefix="fw_hf_trainer-", dir=".") as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=steps,
                                 per_device_train_batch_size=4, report_to=[],
                                 save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, ddp_find_unused_parameters=False)
        Trainer(model=GPT2LMHeadModel(config), args=args,
                train_dataset=Tokens(4 * 2 * steps, 16, 64)).train()
