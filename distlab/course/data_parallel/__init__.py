"""Chapters 2 and 3: the DDP lab's Bucket and PyTorch's DDP in the labs' loop, their test models, the meters' harness.
ddp (Bucket, TorchDDP), reference (test models, single-process ground truth), measure (states, traffic, races).
May import: engine, theory, meters, bench, course.
"""
