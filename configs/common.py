"""Config parts shared by every experiment."""

import ml_collections


def set_mesh_and_rules(config: ml_collections.ConfigDict) -> None:
  """The device mesh and the logical-axis rules of the Transformer models."""
  # Mesh axis sizes; -1 takes the remaining devices.
  config.mesh = (('data', -1), ('fsdp', 1), ('tensor', 1))
  # Logical axis -> mesh axes. Parameters shard over fsdp (embed) and tensor
  # (vocab, heads, mlp); the batch over data and fsdp.
  config.logical_axis_rules = (
      ('batch', ('data', 'fsdp')),
      ('vocab', 'tensor'),
      ('embed', 'fsdp'),
      ('mlp', 'tensor'),
      ('heads', 'tensor'),
      ('kv', None),
      ('length', None),
      ('act_embed', None),
      ('act_mlp', 'tensor'),
      ('act_heads', 'tensor'),
  )


def pretraining_schedule(batch_size: int, num_steps: int, tiny: bool) -> ml_collections.ConfigDict:
  """config.train of a pretraining run; tiny runs log, evaluate and checkpoint more often."""
  train = ml_collections.ConfigDict()
  train.batch_size = batch_size  # global, across all hosts and devices
  train.num_steps = num_steps
  train.grad_accum_steps = 1
  train.log_every = 20 if tiny else 100
  train.eval_every = 200 if tiny else 10_000
  train.eval_steps = 10 if tiny else 100
  train.checkpoint_every = 200 if tiny else 10_000
  train.keep_checkpoints = 3
  return train
