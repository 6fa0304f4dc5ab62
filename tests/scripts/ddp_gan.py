"""A GAN-style loop: two DDP models, two optimizers, one ddtop.step per iteration
(the generator's forward runs through the discriminator between the two steps).

    ddtrain start --foreground -n 2 tests/scripts/ddp_gan.py -- 5
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddtop


def main() -> None:
    iterations = int(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    gen = DDP(nn.Linear(4, 8))
    disc = DDP(nn.Linear(8, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    for _ in range(iterations):
        real, noise = torch.randn(16, 8), torch.randn(16, 4)
        d_loss = disc(real).mean() - disc(gen(noise).detach()).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = -disc(gen(noise)).mean()  # through the discriminator again
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        ddtop.step(loss=g_loss, samples=16)
    dist.barrier()  # leave together: gloo can abort a rank whose peer is already gone
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
