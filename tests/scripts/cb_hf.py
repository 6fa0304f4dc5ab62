"""A Hugging Face Trainer run with ddtop's callback, as its rank under
`ddtrain start -n 2` or torchrun: a tiny GPT-2 built from a config (nothing
downloaded), synthetic tokens, on CPU.

    ddtrain start -n 2 tests/scripts/cb_hf.py -- --steps 10 --accumulate 2

STEPS optimizer steps per rank (one epoch), ACCUMULATE micro-batches each; the
Trainer logs every 2 steps and evaluates every 5, and each evaluation's
compute_metrics waits EVAL_S (outside any forward: only the callback says that
this is evaluation). `--no-callback`: the same run without the callback.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ddtop.transformers import DdtopCallback

BATCH = 4
SEQ = 16
VOCAB = 64
LR = 0.01


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, samples: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (samples, SEQ),
                                 generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per rank")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--eval-s", type=float, default=1.3)
    parser.add_argument("--no-callback", action="store_true")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    eval_s = args.eval_s

    def compute_metrics(prediction: object) -> dict[str, float]:
        time.sleep(eval_s)
        return {"waited_s": eval_s}

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                       n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    with tempfile.TemporaryDirectory(dir=".") as out:  # where the run is: none left in /tmp
        training = TrainingArguments(
            output_dir=out, use_cpu=True, report_to=[], save_strategy="no", seed=0,
            num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant",
            per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
            gradient_accumulation_steps=args.accumulate, logging_steps=2,
            eval_strategy="steps", eval_steps=5, disable_tqdm=True, dataloader_num_workers=0,
            ddp_find_unused_parameters=False)
        trainer = Trainer(
            model=model, args=training,
            train_dataset=Tokens(args.steps * args.accumulate * BATCH * world, seed=1),
            eval_dataset=Tokens(BATCH * world, seed=2), compute_metrics=compute_metrics,
            callbacks=[] if args.no_callback else [DdtopCallback()])
        trainer.train()


if __name__ == "__main__":
    main()
