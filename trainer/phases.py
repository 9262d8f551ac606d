"""A run's phases: the steps it trains at one sequence length (BERT, appendix A.2).

The paper pretrains at 128 tokens for 90% of the steps, then at 512 "to learn
the positional embeddings". A config's first phase is its own fields;
config.data.later_phases lists the others, each (from_fraction,
max_seq_length, max_predictions_per_seq, remat): from step
round(from_fraction * train.num_steps) on, the data has that length and
masking, and with remat the layers recompute their activations in the
backward pass (the same step in less memory: BERT-large's 512-token step
fits a TPU v4-8 so).
One run goes through them with one optimizer state and one learning rate
schedule, as google-research/bert's run_pretraining.py does when its second
phase resumes the first's output_dir with the same num_train_steps.
"""

import dataclasses
from typing import Any

import ml_collections
import numpy as np

from trainer import checkpoints

# The fields a later phase sets, in the order of its tuple (after from_fraction), and their types.
PHASE_FIELDS = (('data', 'max_seq_length', int), ('data', 'max_predictions_per_seq', int),
                ('model', 'remat', bool))
# The pipelines whose examples are made for a length and a masking rate (sec. A.2).
PHASED_PIPELINES = ('bert_pretraining',)


@dataclasses.dataclass(frozen=True)
class Phase:
  """Steps start+1 .. end of the run (state.step from start to end) train with `config`."""
  index: int
  start: int
  end: int
  config: Any  # the run's config with this phase's fields, and no later phases

  @property
  def max_seq_length(self) -> int | None:
    return self.config.data.get('max_seq_length')

  def describe(self, count: int) -> str:
    data = self.config.data
    remat = ', remat' if self.config.model.get('remat') else ''
    return (f'phase {self.index + 1} of {count}, steps {self.start + 1}-{self.end}: '
            f'{data.max_seq_length} tokens, {data.get("max_predictions_per_seq", 0)} '
            f'predictions per sequence{remat}')


def _later(config) -> tuple:
  return tuple(config.data.get('later_phases', ()) or ())


def _start_step(fraction: float, num_steps: int) -> int:
  return round(fraction * num_steps)


def check(config) -> None:
  """The table's form, in one line naming the fix; each phase's fields are checked by
  trainer.checks.validate on that phase's config."""
  later = _later(config)
  if not later:
    return
  if config.data.get('pipeline') not in PHASED_PIPELINES:
    raise ValueError(f'data.later_phases is for data.pipeline={" or ".join(PHASED_PIPELINES)}, '
                     f'not {config.data.get("pipeline")!r}: set --config.data.later_phases=().')
  num_steps, previous = config.train.num_steps, 0
  for i, entry in enumerate(later):
    if not (isinstance(entry, (tuple, list)) and len(entry) == 1 + len(PHASE_FIELDS)
            and isinstance(entry[0], (int, float))
            and all(type(x) is t for x, (_, _, t) in zip(entry[1:], PHASE_FIELDS))):
      raise ValueError(f'data.later_phases[{i}]={entry!r}: write each phase as (from_fraction, '
                       'max_seq_length, max_predictions_per_seq, remat), e.g. '
                       '(0.9, 512, 80, False).')
    fraction = entry[0]
    start = _start_step(fraction, num_steps)
    if not 0 < fraction < 1 or not previous < start < num_steps:
      raise ValueError(f'data.later_phases[{i}] starts at {fraction} of train.num_steps='
                       f'{num_steps} (step {start}): each phase needs steps of its own, so use '
                       'fractions in (0, 1), increasing, or --config.data.later_phases=() for '
                       'one phase.')
    previous = start


def of(config) -> list[Phase]:
  """The run's phases, in order; a config without data.later_phases has one."""
  check(config)
  later = _later(config)
  num_steps = config.train.num_steps
  starts = [0] + [_start_step(entry[0], num_steps) for entry in later]
  ends = starts[1:] + [num_steps]
  phases = []
  for index, (start, end) in enumerate(zip(starts, ends)):
    phase_config = config.copy_and_resolve_references()
    with phase_config.unlocked():
      if index:
        for (part, field, _), value in zip(PHASE_FIELDS, later[index - 1][1:]):
          phase_config[part][field] = value
      if 'later_phases' in phase_config.data:
        phase_config.data.later_phases = ()
    phases.append(Phase(index, start, end, phase_config))
  return phases


def chosen(config, number: int) -> list[Phase]:
  """Phase `number` (from 1) of the config, or every phase for 0; ValueError naming the range."""
  phases = of(config)
  if not 0 <= number <= len(phases):
    raise ValueError(f'--phase={number}: this config has {len(phases)} phase(s) '
                     f'(data.later_phases): use 1-{len(phases)}, or 0 for each.')
  return phases[number - 1:number] if number else phases


def data_seed(seed: int, index: int) -> int:
  """The seed of phase `index`'s data: the run's for the first phase; for a later one, a seed
  drawn from (seed, index), so that no phase of one run reads another seed's stream."""
  return seed if index == 0 else int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def at(phases: list[Phase], step: int) -> Phase:
  """The phase that trains the step after `step` (the last one once the run is done)."""
  return next((p for p in phases if p.start <= step < p.end), phases[-1])


def lengths(config: ml_collections.ConfigDict) -> list[int]:
  """Each phase's max_seq_length; [] for a config without one."""
  if config.data.get('max_seq_length') is None:
    return []
  return [config.data.max_seq_length] + [entry[1] for entry in _later(config)]


def trained_positions(workdir: str) -> int | None:
  """The positions the newest checkpoint in `workdir` has trained: the longest sequence of the
  phases it went through, or of the run it started from. None where the checkpoint does not say
  (written before phases existed, or by a model without positions): nothing is checked then."""
  return positions_in(checkpoints.newest_data(workdir))


def positions_in(data: dict | None) -> int | None:
  """The trained positions a checkpoint's data item says (checkpoints.newest_data's); None
  where it says nothing."""
  positions = (data or {}).get('positions')
  return None if positions is None else int(positions)
