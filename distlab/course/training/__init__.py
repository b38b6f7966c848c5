"""Chapter 9: training for real — text every Python install has, a sharded loader, one loop for every
strategy, checkpoints that survive a killed rank and resume at another world size.

Modules: corpus (the stdlib's source, tokenised as bytes, split and cached), loader (each data-parallel
rank's disjoint slice of every global batch; a position that is one integer), strategies (one argument:
one process, DDP, fully_shard, the labs' ZeRO classes, tensor parallelism, a dp x tp mesh, a pipeline), pp
(one stage per rank with torch.distributed.pipelining), checkpoint (torch.distributed.checkpoint, written
then renamed), loop (`train`, on every rank).

    from distlab.course.training import TrainConfig, train
    runs = distlab.launch(train, 4, args=(TrainConfig(strategy="fsdp2", steps=50),))
"""
from distlab.course.training.corpus import ByteTokenizer, Corpus, corpus, stdlib_files
from distlab.course.training.loader import ShardedLoader, global_rows, rank_rows, windows
from distlab.course.training.loop import Run, TrainConfig, foreign, train, training_step
from distlab.course.training.pp import Pipeline, pipeline_step
from distlab.course.training.strategies import STRATEGIES, check_strategy, data_ranks, wrap

__all__ = ["ByteTokenizer", "Corpus", "corpus", "stdlib_files", "ShardedLoader", "global_rows", "rank_rows",
           "windows", "Run", "TrainConfig", "foreign", "train", "training_step", "Pipeline", "pipeline_step",
           "STRATEGIES", "check_strategy", "data_ranks", "wrap"]
