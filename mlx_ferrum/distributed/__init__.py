"""Tensor and pipeline parallelism over ``mx.distributed``, for runs started with ``mlx.launch``.

- :mod:`~mlx_ferrum.distributed.group`: :func:`init_group` (strict start-up checks) and
  the step :class:`Watchdog`.
- :mod:`~mlx_ferrum.distributed.sharding`: the tensor-parallel plan of every family
  (two ``all_sum`` per layer, the KV cache holding only the rank's KV heads).
- :mod:`~mlx_ferrum.distributed.pipeline`: layers split across ranks, activations passed
  with ``send``/``recv``.
- :mod:`~mlx_ferrum.distributed.lockstep`: :class:`LockstepEngine`, rank 0 owning the
  requests and broadcasting each step's additions and aborts in one collective.

A launch (see README "Multiple Macs")::

    mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- \\
        mlx-ferrum generate --model M --prompt P --tensor-parallel-size 2
"""

from __future__ import annotations

import os
from typing import Any, Union

from .group import ParallelGroup, Watchdog, init_group


def load_sharded(path_or_repo_id: Union[str, os.PathLike], parallel: ParallelGroup, dtype: Any = None):
    """Load this rank's part of a checkpoint: ``(model, folder)``.

    Tensor parallel: every layer is split (:func:`~mlx_ferrum.distributed.sharding.shard_model`)
    before the weights are materialized. Pipeline parallel: only this rank's layers are
    built, and only the safetensors shards holding them are read
    (:func:`~mlx_ferrum.distributed.pipeline.load_pipeline_stage`). Both: this rank's
    stage, with its layers split across the stage's tensor ranks.

    Raises:
        ShardingError: the model cannot be split into ``parallel.size`` parts.
        ModelLoadError (and its subclasses): as :func:`~mlx_ferrum.models.loader.load_model`.
    """
    if parallel.pipeline_parallel_size > 1:
        from .pipeline import load_pipeline_stage

        return load_pipeline_stage(path_or_repo_id, parallel, dtype=dtype)
    from ..models.loader import load_model
    from .sharding import shard_model

    model, _config, folder = load_model(path_or_repo_id, dtype=dtype,
                                        shard=lambda m: shard_model(m, parallel.group))
    return model, folder


def lockstep_engine(model, tokenizer, config, parallel: ParallelGroup, **kwargs):
    """A :class:`~mlx_ferrum.distributed.lockstep.LockstepEngine` over this rank's model."""
    from .lockstep import LockstepEngine

    return LockstepEngine(model, tokenizer, config, parallel, **kwargs)


__all__ = ["ParallelGroup", "Watchdog", "init_group", "load_sharded", "lockstep_engine"]
