"""The plumbing under hetero_gpt.py: flags, checkpoints, ranks, energy meters, memory,
the ANE programs on disk and the ANE worker process. Nothing here imports the trainer."""
