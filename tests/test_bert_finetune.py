"""BERT's fine-tuning heads, losses, inputs and host-side scores (Devlin et al. 2018, sec. 4, 5.3)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import bert_finetune as bert_finetune_config
from configs import cvt as cvt_config
from configs import elmo_tagger as elmo_tagger_config
from input_pipeline import bert_finetune
from input_pipeline import tagging
from input_pipeline.common import tokenizer as tokenizer_lib
from models import bert
from objectives import classification
from objectives import span
from objectives import tagging as tagging_objective
from trainer import sharding
import trainer.checks
import trainer.state

WORDS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'john', 'lives', 'in', 'wash', '##ing',
         '##ton', '.', 'd', 'c', 'the', 'city']


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_text('\n'.join(WORDS) + '\n')
  return tokenizer_lib.WordPieceTokenizer(str(path), lower_case=True)


def test_first_subword_labels_and_their_inverse_on_a_hand_made_sentence(tokenizer):
  # Sec. 5.3: the first sub-token of each word carries its label; "Washington" is 3 pieces and
  # "D.C." is 4 tokens of one word (the basic tokenizer splits off the periods).
  sentence = ['John', 'lives', 'in', 'Washington', 'D.C.']
  tags = [1, 0, 0, 5, 6]  # B-PER O O B-LOC I-LOC
  examples = bert_finetune.tagging_examples([sentence], [tags], tokenizer, max_length=16)
  batch = bert_finetune.batch_arrays(examples, np.array([0]), np.ones(1, np.float32), 16,
                                     tokenizer.pad_id)
  tokens = tokenizer.convert_ids_to_tokens(batch['input_ids'][0][:batch['input_mask'][0].sum()])
  assert tokens == ['[CLS]', 'john', 'lives', 'in', 'wash', '##ing', '##ton', 'd', '.', 'c', '.',
                    '[SEP]']
  assert batch['labels'][0][:12].tolist() == [0, 1, 0, 0, 5, 0, 0, 6, 0, 0, 0, 0]
  assert batch['label_weights'][0][:13].tolist() == [0, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0]
  assert examples.word_positions[0].tolist() == [1, 2, 3, 4, 7]
  # The inverse: a tag predicted at every token is read back at each word's first piece.
  predicted = np.arange(16) + 100
  assert bert_finetune.word_labels(examples.word_positions[0], predicted).tolist() == [
      101, 102, 103, 104, 107]


def test_a_word_cut_off_by_max_seq_length_has_no_position_and_reads_as_O(tokenizer):
  examples = bert_finetune.tagging_examples([['John', 'lives', 'in', 'Washington']], [[1, 0, 0, 5]],
                                            tokenizer, max_length=6)
  batch = bert_finetune.batch_arrays(examples, np.array([0]), np.ones(1, np.float32), 6,
                                     tokenizer.pad_id)
  # [CLS] john lives in wash [SEP]: Washington keeps its first piece only.
  assert tokenizer.convert_ids_to_tokens(batch['input_ids'][0]) == [
      '[CLS]', 'john', 'lives', 'in', 'wash', '[SEP]']
  examples = bert_finetune.tagging_examples([['John', 'lives', 'in', 'Washington']], [[1, 0, 0, 5]],
                                            tokenizer, max_length=5)
  assert examples.word_positions[0].tolist() == [1, 2, 3, -1]
  assert bert_finetune.word_labels(examples.word_positions[0], np.full(5, 7)).tolist() == [7, 7, 7, 0]


def test_pairs_are_cls_a_sep_b_sep_with_segments_and_the_longer_text_cut(tokenizer):
  a, b = [5, 6, 7, 8, 9, 10], [14, 15]
  examples = bert_finetune.sequence_examples([[a, b]], [1], tokenizer.cls_id, tokenizer.sep_id, 9)
  batch = bert_finetune.batch_arrays(examples, np.array([0, 0]), np.array([1.0, 0.0]), 10,
                                     tokenizer.pad_id)
  # 9 tokens: [CLS] + 4 of A + [SEP] + 2 of B + [SEP]; A, the longer, lost its last two.
  assert batch['input_ids'][0].tolist() == [2, 5, 6, 7, 8, 3, 14, 15, 3, 0]
  assert batch['segment_ids'][0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
  assert batch['input_mask'][0].tolist() == [1] * 9 + [0]
  assert batch['labels'].tolist() == [1, 1]
  assert batch['example_index'].tolist() == [0, -1]  # the padding row


def _task(name):
  return bert_finetune.task_spec(name)


def test_classification_scores_match_a_hand_count():
  examples = bert_finetune.sequence_examples([[[5]]] * 6, [1, 1, 1, 0, 0, 0], 2, 3, 8)
  # Rows in shuffled order, as an eval pass on several hosts may give them.
  predictions = {'example_index': np.array([5, 0, 1, 2, 3, 4]),
                 'prediction': np.array([0, 1, 1, 0, 1, 0], np.float32)}
  scores = bert_finetune.score(_task('mrpc'), examples, predictions)
  # Predicted 1,1,0,1,0,0 against 1,1,1,0,0,0: tp 2, fp 1, fn 1, tn 2.
  assert scores['accuracy'] == pytest.approx(4 / 6)
  assert scores['f1'] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
  assert scores['matthews_corr'] == pytest.approx((2 * 2 - 1 * 1) / np.sqrt(3 * 3 * 3 * 3))


def test_regression_scores_are_pearson_and_spearman():
  labels = [0.0, 1.0, 2.0, 3.0]
  examples = bert_finetune.sequence_examples([[[5], [6]]] * 4, labels, 2, 3, 8)
  predicted = np.array([0.0, 1.0, 4.0, 9.0], np.float32)  # monotone, not linear
  scores = bert_finetune.score(_task('stsb'), examples,
                               {'example_index': np.arange(4), 'prediction': predicted})
  assert scores['spearman'] == pytest.approx(1.0)
  x, y = predicted - predicted.mean(), np.array(labels) - np.mean(labels)
  assert scores['pearson'] == pytest.approx((x @ y) / np.sqrt((x @ x) * (y @ y)), rel=1e-5)


def test_tagging_scores_are_conll_span_f1_over_words(tokenizer):
  task = _task('conll2003')
  names = {n: i for i, n in enumerate(task.label_names)}
  gold = [['B-PER', 'O', 'O', 'B-LOC', 'I-LOC'], ['B-ORG', 'I-ORG', 'O']]
  sentences = [['John', 'lives', 'in', 'Washington', 'D.C.'], ['the', 'city', 'in']]
  examples = bert_finetune.tagging_examples(
      sentences, [[names[t] for t in tags] for tags in gold], tokenizer, max_length=32)
  guessed = [['B-PER', 'O', 'O', 'B-LOC', 'O'], ['B-ORG', 'I-ORG', 'O']]
  predicted = np.zeros((2, 32), np.int32)
  for row, (positions, tags) in enumerate(zip(examples.word_positions, guessed)):
    predicted[row, positions] = [names[t] for t in tags]
  scores = bert_finetune.score(task, examples, {'example_index': np.array([0, 1]),
                                                'predicted_tags': predicted})
  # Gold chunks PER, LOC(2 words), ORG; predicted PER, LOC(1 word), ORG: 2 of 3 right.
  assert scores['span_precision'] == pytest.approx(2 / 3)
  assert scores['span_recall'] == pytest.approx(2 / 3)
  assert scores['span_f1'] == pytest.approx(2 / 3)
  assert scores['word_accuracy'] == pytest.approx(7 / 8)
  # Part of speech has no chunks: word accuracy alone (seqeval read 'NN' as a chunk prefix).
  task = _task('conll2003_pos')
  names = task.label_names
  tags = [[names.index(t) for t in ('NNP', 'VBZ', 'IN', 'NNP', 'NNP')], [names.index('DT')] * 3]
  examples = bert_finetune.tagging_examples(sentences, tags, tokenizer, max_length=32)
  predicted = np.zeros((2, 32), np.int32)
  for row, (positions, row_tags) in enumerate(zip(examples.word_positions, tags)):
    predicted[row, positions] = row_tags
  predicted[1, examples.word_positions[1][0]] = names.index('NN')
  scores = bert_finetune.score(task, examples, {'example_index': np.array([0, 1]),
                                                'predicted_tags': predicted})
  assert scores == {'word_accuracy': pytest.approx(7 / 8)}


def test_scoring_refuses_a_pass_that_missed_examples():
  examples = bert_finetune.sequence_examples([[[5]]] * 3, [1, 0, 1], 2, 3, 8)
  with pytest.raises(ValueError, match='predicted 2 of 3'):
    bert_finetune.score(_task('sst2'), examples, {'example_index': np.array([0, 2]),
                                                  'prediction': np.zeros(2, np.float32)})


def _tiny(head, num_labels):
  return bert.Config(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, mlp_dim=32,
                     max_position_embeddings=16, num_labels=num_labels, head=head)


@pytest.mark.parametrize('head,num_labels', [('classify', 3), ('span', 2), ('tag', 5)])
def test_heads_read_the_pooled_state_or_every_token(head, num_labels):
  model = bert.Model(_tiny(head, num_labels))
  rng = np.random.default_rng(0)
  batch = {'input_ids': jnp.asarray(rng.integers(5, 50, (2, 8)), jnp.int32),
           'segment_ids': jnp.zeros((2, 8), jnp.int32), 'input_mask': jnp.ones((2, 8), jnp.int32)}
  params = model.init(jax.random.key(0), batch)['params']
  out = model.apply({'params': params}, batch)
  if head == 'classify':
    kernel, bias = params['classifier']['kernel'].unbox(), params['classifier']['bias'].unbox()
    np.testing.assert_allclose(out['logits'], out['pooled_output'] @ kernel + bias, atol=1e-5)
  elif head == 'span':
    kernel = params['span_head']['kernel'].unbox()
    bias = params['span_head']['bias'].unbox()
    expected = out['sequence_output'] @ kernel + bias
    np.testing.assert_allclose(out['start_logits'], expected[..., 0], atol=1e-5)
    np.testing.assert_allclose(out['end_logits'], expected[..., 1], atol=1e-5)
  else:
    kernel, bias = params['tagger']['kernel'].unbox(), params['tagger']['bias'].unbox()
    np.testing.assert_allclose(out['logits'], out['sequence_output'] @ kernel + bias, atol=1e-5)


def test_span_head_refuses_other_label_counts():
  with pytest.raises(ValueError, match='num_labels=2'):
    _tiny('span', 3)


def test_span_loss_is_the_mean_of_start_and_end_cross_entropy_by_hand():
  start = np.array([[1.0, 2.0, 0.5, 9.0]], np.float32)
  end = np.array([[0.0, 1.0, 3.0, 9.0]], np.float32)
  batch = {'input_mask': np.array([[1, 1, 1, 0]]), 'start_positions': np.array([1]),
           'end_positions': np.array([2]), 'example_weights': np.array([1.0], np.float32),
           'example_index': np.array([0])}
  loss, metrics = span.loss_fn({'start_logits': start, 'end_logits': end}, batch)
  # The padding position (logit 9) takes no probability.
  log_z_start = np.log(np.exp(1.0) + np.exp(2.0) + np.exp(0.5))
  log_z_end = np.log(np.exp(0.0) + np.exp(1.0) + np.exp(3.0))
  expected = ((log_z_start - 2.0) + (log_z_end - 3.0)) / 2
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  summary = span.summarize(jax.device_get(metrics))
  assert summary['start_accuracy'] == 1.0 and summary['end_accuracy'] == 1.0
  predicted = span.predict({'start_logits': start, 'end_logits': end}, batch)
  assert float(predicted['start_logits'][0, 3]) < -1e8


def test_span_loss_ignores_padding_rows():
  batch = {'input_mask': np.ones((2, 3)), 'start_positions': np.array([0, 2]),
           'end_positions': np.array([0, 2]), 'example_weights': np.array([1.0, 0.0], np.float32)}
  logits = np.array([[0.0, 0.0, 0.0], [np.nan, 0.0, 0.0]], np.float32)
  loss, _ = span.loss_fn({'start_logits': logits, 'end_logits': logits}, batch)
  assert float(loss) == pytest.approx(np.log(3.0), rel=1e-5)


def test_predictions_are_the_argmax_class_or_the_regression_value():
  logits = np.array([[0.1, 0.9], [2.0, -1.0]], np.float32)
  batch = {'labels': np.array([1, 0], np.int32), 'example_index': np.array([3, 4])}
  assert classification.predict({'logits': logits}, batch)['prediction'].tolist() == [1.0, 0.0]
  batch['labels'] = np.array([1.5, 0.5], np.float32)
  assert classification.predict({'logits': logits}, batch)['prediction'].tolist() == [
      pytest.approx(0.1), pytest.approx(2.0)]
  tags = tagging_objective.predict({'logits': np.eye(3)[None].astype(np.float32)},
                                   {'example_index': np.array([0])})['predicted_tags']
  assert tags.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize('task', ['sst2', 'mrpc', 'stsb', 'offline_next', 'conll2003',
                                  'offline_replaced'])
def test_example_batches_fit_the_config_of_each_task(task):
  config = bert_finetune_config.get_config(f'{task},tiny')
  config.data.lower_case = True
  bert_finetune.check_config(config)
  batch = bert_finetune.example_batch(config.data, config.model.vocab_size, 4)
  model = bert.Model(bert.Config(**config.model.to_dict() | {'dtype': 'float32'}))
  out = jax.eval_shape(lambda: model.init_with_output(jax.random.key(0), batch)[0])
  L = config.data.max_seq_length
  spec = bert_finetune.task_spec(task)
  if isinstance(spec, tagging.Task):
    assert batch['labels'].shape == batch['label_weights'].shape == (4, L)
    assert out['logits'].shape == (4, L, spec.num_labels)
  else:
    assert batch['labels'].shape == (4,)
    assert out['logits'].shape == (4, spec.num_labels)
  assert (batch['input_ids'][:, 0] == 2).all()  # [CLS]


def test_a_task_with_the_wrong_head_is_refused_in_one_line():
  config = bert_finetune_config.get_config('sst2,tiny')
  config.data.task = 'conll2003'
  with pytest.raises(ValueError, match='model.head=tag and model.num_labels=9'):
    bert_finetune.check_config(config)
  with pytest.raises(ValueError, match='Unknown BERT fine-tuning task'):
    bert_finetune_config.get_config('nope')
  with pytest.raises(ValueError, match='Unknown size'):
    bert_finetune_config.get_config('sst2,huge')
  # A pair needs [CLS] a [SEP] b [SEP]: at 4 every second text was cut to nothing.
  config = bert_finetune_config.get_config('mrpc,tiny')
  config.data.max_seq_length = 4
  with pytest.raises(ValueError, match="max_seq_length=4 leaves no room for task 'mrpc'"):
    bert_finetune.check_config(config)
  config.data.max_seq_length = 5
  bert_finetune.check_config(config)
  config = bert_finetune_config.get_config('sst2,tiny')
  config.data.max_seq_length = 3  # [CLS] a [SEP]
  bert_finetune.check_config(config)


@pytest.mark.parametrize('config_file, variant', [
    (bert_finetune_config, 'offline_next,tiny'),
    # Span F1 counted over the batches read: a part of the split, or the first ones twice.
    (elmo_tagger_config, 'offline_replaced,tiny'),
    (cvt_config, 'tiny')])
def test_part_of_an_eval_split_is_refused_for_a_scored_task(config_file, variant):
  config = config_file.get_config(variant)
  if config.model.get('use_elmo'):
    config.model.use_elmo = False  # (no pretrained biLM here)
  mesh = sharding.make_mesh(config.mesh)
  trainer.checks.validate(config, mesh)
  config.train.eval_steps = 3
  with pytest.raises(ValueError, match='set train.eval_steps=0'):
    trainer.checks.validate(config, mesh)


def test_sizes_and_casing_left_unset_come_from_init_from(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  pretrained = bert_finetune_config.get_config('sst2,mini').to_dict()
  pretrained['data']['lower_case'] = False
  (tmp_path / 'config.json').write_text(json.dumps(pretrained))
  config = bert_finetune_config.get_config('sst2')
  assert config.model.hidden_size is None and config.data.lower_case is None
  with pytest.raises(ValueError, match='set --config.init_from'):
    trainer.checks.inherit_unset_fields(config, str(tmp_path / 'run'))
  config.init_from = str(tmp_path)
  trainer.checks.inherit_unset_fields(config, str(tmp_path / 'run'))
  assert (config.model.hidden_size, config.model.num_layers) == (256, 4)
  assert config.data.lower_case is False
  assert config.model.num_labels == 2 and config.model.head == 'classify'


def _fine_tuned_run(workdir, task, num_labels):
  """A workdir as fine-tuning leaves one: config.json naming the task, a checkpoint."""
  import json  # pylint: disable=g-import-not-at-top
  from trainer import checkpoints  # pylint: disable=g-import-not-at-top
  (workdir / 'config.json').write_text(json.dumps({'data': {'task': task}}))
  params = _head_params(num_labels, seed=1)
  mngr = checkpoints.manager(str(workdir), 1)
  checkpoints.save(mngr, 0, {'step': 0, 'params': params}, {0: {}}, 1)
  mngr.wait_until_finished()
  return params


def _head_params(num_labels, seed):
  batch = {'input_ids': jnp.ones((1, 8), jnp.int32), 'segment_ids': jnp.zeros((1, 8), jnp.int32),
           'input_mask': jnp.ones((1, 8), jnp.int32)}
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  return nn.meta.unbox(bert.Model(_tiny('classify', num_labels)).init(
      jax.random.key(seed), batch)['params'])


@pytest.mark.parametrize('task,num_labels,head_kept', [('sst2', 2, True), ('mrpc', 2, False),
                                                      ('mnli', 3, False)])
def test_another_tasks_head_starts_afresh_from_a_fine_tuned_run(tmp_path, task, num_labels,
                                                                 head_kept):
  # Sec. 4: each task adds its own output layer; only the same task's run gives its head.
  saved = _fine_tuned_run(tmp_path, 'sst2', 2)
  params = _head_params(num_labels, seed=2)
  config = ml_collections.ConfigDict(dict(init_from=str(tmp_path), model_name='bert',
                                          data=dict(task=task)))
  loaded = trainer.state.init_params(params, config)
  for encoder_part in ('token_embed', 'layer_1', 'pooler'):
    jax.tree.map(np.testing.assert_array_equal, loaded[encoder_part], saved[encoder_part])
  expected = saved['classifier'] if head_kept else params['classifier']
  jax.tree.map(np.testing.assert_array_equal, loaded['classifier'], expected)


def test_finetune_configs_name_their_pipeline_objective_and_head():
  expect = {'sst2': ('bert_finetune', 'classification', 'classify', 2),
            'stsb': ('bert_finetune', 'classification', 'classify', 1),
            'squad': ('squad', 'span', 'span', 2),
            'offline_span': ('squad', 'span', 'span', 2),
            'conll2003': ('bert_finetune', 'tagging', 'tag', 9)}
  for task, wanted in expect.items():
    c = bert_finetune_config.get_config(task)
    assert (c.data.pipeline, c.objective, c.model.head, c.model.num_labels) == wanted
    assert isinstance(c, ml_collections.ConfigDict)


def test_offline_capitalized_tags_the_words_the_corpus_capitalizes_after_the_first(monkeypatch):
  from input_pipeline.common import sources  # pylint: disable=g-import-not-at-top
  documents = [['The value None means no RFC applies here.', 'Use Python or not at all today.'],
               ['too short .']]
  monkeypatch.setattr(sources, 'documents', lambda cfg, split: iter(documents))
  cfg = ml_collections.ConfigDict(dict(task='offline_capitalized', data_dir='', eval_holdout=10,
                                       max_seq_length=16))
  sentences, tags = tagging.offline_sentences(cfg, 'train', 0)
  pairs = sorted(zip(map(tuple, sentences), map(tuple, tags)))
  assert pairs == [
      (('the', 'value', 'none', 'means', 'no', 'rfc', 'applies', 'here', '.'),
       (0, 0, 1, 0, 0, 1, 0, 0, 0)),
      (('use', 'python', 'or', 'not', 'at', 'all', 'today', '.'), (0, 1, 0, 0, 0, 0, 0, 0))]
  assert tagging.offline_sentences(cfg, 'train', 1)[0] in ([list(p[0])] for p in pairs)


def test_glue_by_name_through_tfds_mock_data_scores_a_whole_pass(tokenizer):
  import tensorflow_datasets as tfds  # pinned: a broken install fails, never skips
  config = bert_finetune_config.get_config('mrpc,tiny')
  config.data.max_seq_length = 24
  with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
    expected = list(tfds.as_numpy(tfds.load('glue/mrpc', split='validation',
                                            shuffle_files=False)))
    it = bert_finetune.get_iterator(config.data, 'eval', tokenizer=tokenizer, batch_size=4,
                                    seed=0)
    batches = [next(it) for _ in range(it.steps_per_epoch)]
  labels = np.array([int(e['label']) for e in expected])
  first = batches[0]
  assert first['input_ids'].shape == (4, 24) and (first['input_ids'][:, 0] == 2).all()
  # Row 0 is [CLS] A [SEP] B [SEP] of the first pair, as sequence_examples frames it.
  texts = [tokenizer.encode(expected[0][k].decode()) for k in ('sentence1', 'sentence2')]
  want = bert_finetune.batch_arrays(
      bert_finetune.sequence_examples([texts], [0], 2, 3, 24), np.array([0]),
      np.ones(1, np.float32), 24, tokenizer.pad_id)
  for key in ('input_ids', 'segment_ids', 'input_mask'):
    np.testing.assert_array_equal(first[key][0], want[key][0])
  np.testing.assert_array_equal(first['labels'], labels[:4])
  assert batches[1]['example_index'].tolist() == [4, 5, -1, -1]
  rows = np.concatenate([b['example_index'] for b in batches])
  real = rows >= 0
  scores = it.score({'example_index': rows[real], 'prediction': np.ones(real.sum(), np.float32)})
  assert scores['accuracy'] == pytest.approx(labels.mean())
