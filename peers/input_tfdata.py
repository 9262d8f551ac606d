"""Peer of the input workers: the same units (chunks of examples) made by tf.data instead of grain.

    TOKENIZERS_PARALLELISM=false python peers/input_tfdata.py --config=configs/bert_base.py:base --calls=2

Each chunk is made by the pipeline's own maker (input_pipeline/common/chunked.py;
the pipelines made of chunks: bert_pretraining, packed_lm, bilm, translation)
inside `tf.py_function`, `--calls` of them at once (`num_parallel_calls`,
deterministic order), so the figure compares with
`python bench.py --config=... --input_only --config.data.workers=N`: examples/s
from the first chunk on, for `--seconds`. Without TOKENIZERS_PARALLELISM=false
the tokenizers' own threads and tf.data's stopped making progress here.
"""

import json
import os
import sys
import threading
import time

from absl import app
from absl import flags
from ml_collections import config_flags
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import input_pipeline  # noqa: E402
from input_pipeline.common import chunked  # noqa: E402


def examples_per_sec(config, calls: int, seconds: float) -> float:
  tokenizer = input_pipeline.get_tokenizer(config.data, config.model.vocab_size)
  stream = input_pipeline.get_dataset(config.data, 'train', tokenizer=tokenizer,
                                      batch_size=config.train.batch_size, seed=0)
  if not isinstance(stream, chunked.ChunkedIterator):
    raise SystemExit(f'input_tfdata.py: data.pipeline={config.data.pipeline!r} is not made of '
                     'chunks; compare bert_pretraining, packed_lm, bilm or translation.')
  # One maker a thread (a maker reads its documents forward), by thread id: tf.py_function's
  # threads do not keep a threading.local between calls.
  makers = {}

  def make(u):
    maker = makers.get(threading.get_ident())
    if maker is None:
      maker = makers[threading.get_ident()] = stream.maker()
    _, _, examples = maker(int(u))
    return [examples[k] for k in sorted(examples)]

  _, _, first = stream.maker()(0)
  dtypes = [tf.as_dtype(first[k].dtype) for k in sorted(first)]
  units = tf.data.Dataset.range(2**62).map(lambda u: tf.py_function(make, [u], dtypes),
                                           num_parallel_calls=calls, deterministic=True)
  units = iter(units.prefetch(2))
  next(units)
  examples, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    examples += len(next(units)[0])
  return examples / (time.perf_counter() - start)


def main(argv):
  del argv
  rate = examples_per_sec(flags.FLAGS.config, flags.FLAGS.calls, flags.FLAGS.seconds)
  print(json.dumps({'tfdata_parallel_calls': flags.FLAGS.calls,
                    'input_examples_per_sec': round(rate, 1)}))


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.')
  flags.DEFINE_integer('calls', 1, "tf.data's num_parallel_calls.")
  flags.DEFINE_float('seconds', 15.0, 'Measure this long.')
  app.run(main)
