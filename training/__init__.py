"""ddtop.training: everything that runs inside a rank (the only part that imports torch).

Launch it through ddtrain, which starts one process per rank:

    ddtrain start --foreground --world-size 8

or under torchrun, on one machine or many (flags are those of `ddtrain start`):

    torchrun --standalone --nproc-per-node 2 -m ddtop.training --epochs 1
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id job1 -m ddtop.training --run-id job1
"""
