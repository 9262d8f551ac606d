"""trainer/ranges.py: every field of every config has a range; each range accepts the configs'
values and rejects one outside it in one line naming the field, before anything compiles."""

import glob
import importlib
import os
import re

import pytest

from trainer import ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Config arguments beyond each file's VARIANTS (or its default): other task kinds and sizes.
MORE_ARGS = {
    'bert_finetune': ('offline_span,tiny', 'offline_capitalized,tiny', 'stsb,tiny', 'squad'),
    'gpt_finetune': ('offline_cloze,tiny', 'stsb'),
    'cove_classifier': ('offline_shuffled,tiny',),
    'elmo_tagger': ('offline_replaced,tiny',),
}


def every_config() -> list[tuple[str, object]]:
  """(file:arg, config) for every variant of every config file, and more task kinds."""
  found = []
  for path in sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))):
    name = os.path.basename(path)[:-3]
    if name == 'common':
      continue
    module = importlib.import_module(f'configs.{name}')
    args = tuple(getattr(module, 'VARIANTS', {}) or [None]) + MORE_ARGS.get(name, ())
    for arg in args:
      found.append((f'{name}:{arg or ""}', module.get_config(arg) if arg else module.get_config()))
  return found


CONFIGS = every_config()


def field_type(config, path):
  *parents, last = path.split('.')
  for key in parents:
    config = config[key]
  return config.get_type(last)


def test_every_field_of_every_config_has_a_range():
  missing = {f'{name}: {path}' for name, config in CONFIGS
             for path, _ in ranges.leaves(config)
             if ranges.rule(config, path) is None and field_type(config, path) is not bool}
  assert not missing, sorted(missing)


@pytest.mark.parametrize('name,config', CONFIGS, ids=[name for name, _ in CONFIGS])
def test_the_configs_values_are_in_range(name, config):
  del name
  ranges.check(config)


def set_field(config, path, value):
  *parents, last = path.split('.')
  for key in parents:
    config = config[key]
  config[last] = value


@pytest.mark.parametrize('name,config', CONFIGS, ids=[name for name, _ in CONFIGS])
def test_a_value_outside_each_range_is_one_line_naming_the_field(name, config):
  rejected = 0
  for path, default in ranges.leaves(config):
    entry = ranges.rule(config, path)
    if entry is None or isinstance(entry, ranges.Free) or default is None or isinstance(
        default, bool):
      continue
    for bad in entry.outside(default):
      broken = config.copy_and_resolve_references()
      set_field(broken, path, bad)
      with pytest.raises(ValueError) as error:
        ranges.check(broken)
      line = str(error.value)
      assert '\n' not in line, (name, path, line)
      # The table's own entries name the field and the value; the readers' checks (the
      # pipeline's for a task, the mesh's) name the field or the value.
      if isinstance(entry, ranges.Checked):
        value = bad
        while isinstance(value, tuple):
          value = value[0]
        named = path.split('.')[-1] in line or repr(value) in line
      else:
        named = f'{path}=' in line or f'{path}[0]' in line
      assert named, (name, path, bad, line)
      rejected += 1
  assert rejected >= 30, (name, rejected)


@pytest.mark.parametrize('value,expected', [
    (1.5, 'model.dropout_rate=1.5 is outside [0, 1)'),
    (1.0, 'model.dropout_rate=1.0 is outside [0, 1)'),
    (float('nan'), 'model.dropout_rate=nan is outside [0, 1)'),
    (0.0, None), (0.999, None),
])
def test_interval_ends(value, expected):
  config = dict(CONFIGS)['bert_base:tiny'].copy_and_resolve_references()
  config.model.dropout_rate = value
  if expected is None:
    ranges.check(config)
  else:
    with pytest.raises(ValueError, match=re.escape(expected)):
      ranges.check(config)


def test_a_negative_learning_rate_and_a_mistyped_name_are_rejected():
  config = dict(CONFIGS)['gpt:tiny'].copy_and_resolve_references()
  config.optimizer.learning_rate = -2.5e-4
  with pytest.raises(ValueError, match=r'optimizer.learning_rate=-0.00025 is outside \(0, inf\)'):
    ranges.check(config)
  config = dict(CONFIGS)['transformer_wmt:tiny'].copy_and_resolve_references()
  config.data.source_tokenizer = 'word'
  with pytest.raises(ValueError, match="data.source_tokenizer='word' is not .* use one of words, "
                                       'bpe'):
    ranges.check(config)
  config = dict(CONFIGS)['elmo:tiny'].copy_and_resolve_references()
  config.model.cell_clip = 0.0  # no clipping: allowed
  ranges.check(config)
  assert ranges.POSITIVE_INT.problem(2.5, 'model.hidden_size').startswith(
      'model.hidden_size=2.5 is outside [1, inf)')
