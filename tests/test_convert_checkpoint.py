"""Tests of convert_checkpoint.py: HF and TF BERT and HF openai-gpt into workdirs, BERT back to HF.

The references are transformers' BertModel and OpenAIGPTModel (requirements-parity.txt) on tiny
random models; the TF checkpoint is written with google-research/bert's variable names.
"""

import json
import os
import shutil
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from trainer import checkpoints
import convert_checkpoint
import forked  # tests/
from configs import bert_finetune
from configs import gpt as gpt_configs
from configs import gpt_finetune as gpt_finetune_configs
import input_pipeline
from input_pipeline.common import tokenizer as tokenizer_lib
from models import bert
import trainer.checks
import trainer.loop
import trainer.state

# The reference implementations (requirements-parity.txt, installed by requirements-dev.txt):
# imported outright, so that CI fails rather than skips without them.
import torch  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import transformers  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT_VOCAB = list(tokenizer_lib.SPECIAL_TOKENS) + [f'w{i}' for i in range(95)]
GPT_TEXT = ['The quick brown fox jumps over the lazy dog.', 'Hello, world! Tokenizers split words.',
            'A café serves coffee; the dog sleeps all day long.'] * 20
GPT_SENTENCES = ['Hello, World! The quick brown fox.', 'The LAZY dog sleeps; a café...',
                 'xyzzy words', '']


def _randomize(model, seed: int):
  """Every weight random and large enough that a wrong activation, bias or gain shows (HF
  initializes biases to 0 and gains to 1, and its small weights hide the GELU variant)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      gain = name.endswith('weight') and ('LayerNorm' in name or '.ln_' in name)
      param.copy_(torch.randn(param.shape, generator=generator) * (0.2 if gain else 0.3)
                  + (1.0 if gain else 0.0))
  return model.eval()


def _bert_dir(path, *, lower_case=None, base_model_only=False, seed=0):
  """A random tiny BertForPreTraining (or its BertModel) saved as HF saves it, with a vocab.txt."""
  model = _randomize(transformers.BertForPreTraining(transformers.BertConfig(
      vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, max_position_embeddings=64)), seed)
  (model.bert if base_model_only else model).save_pretrained(path, safe_serialization=True)
  (path / 'vocab.txt').write_text(''.join(t + '\n' for t in BERT_VOCAB), encoding='utf-8')
  if lower_case is not None:
    (path / 'tokenizer_config.json').write_text(json.dumps({'do_lower_case': lower_case}))
  return model


@pytest.fixture(scope='module')
def hf_bert(tmp_path_factory):
  path = tmp_path_factory.mktemp('hf_bert')
  return path, _bert_dir(path, lower_case=False)


@pytest.fixture(scope='module')
def bert_workdir(hf_bert, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('runs') / 'bert')
  convert_checkpoint.convert('hf', str(hf_bert[0]), workdir)
  return workdir


def _bert_batch():
  """Two rows: segments A and B, the second padded after 7 tokens."""
  rng = np.random.default_rng(0)
  ids = rng.integers(5, 100, (2, 12)).astype(np.int32)
  mask = np.ones((2, 12), np.int32)
  mask[1, 7:] = 0
  ids[1, 7:] = 0
  segments = np.zeros((2, 12), np.int32)
  segments[0, 6:], segments[1, 4:7] = 1, 1
  return {'input_ids': ids, 'input_mask': mask, 'segment_ids': segments}


def _assert_bert_matches(workdir, reference, heads=True):
  """Every layer's hidden states (real positions), the pooled output and the MLM and NSP logits
  (unless the heads are fresh; a BertForMaskedLM has MLM logits alone, and no pooler), at atol
  1e-4."""
  config, model, params, _ = trainer.state.load_trained(workdir, 'bert', 'test')
  batch = _bert_batch()
  # Every position, in an order of each row's own: the MLM head must read the rows named.
  rng = np.random.default_rng(1)
  positions = np.stack([rng.permutation(12) for _ in range(2)]).astype(np.int32)
  ours = model.apply({'params': params}, {**batch, 'masked_lm_positions': positions},
                     deterministic=True)
  with torch.no_grad():
    theirs = reference(input_ids=torch.tensor(batch['input_ids'], dtype=torch.long),
                       attention_mask=torch.tensor(batch['input_mask']),
                       token_type_ids=torch.tensor(batch['segment_ids'], dtype=torch.long),
                       output_hidden_states=True)
  real = batch['input_mask'] > 0
  assert len(ours['hidden_states']) == len(theirs.hidden_states) == config.model.num_layers + 1
  for layer, (a, b) in enumerate(zip(ours['hidden_states'], theirs.hidden_states)):
    np.testing.assert_allclose(np.asarray(a)[real], b.numpy()[real], atol=1e-4,
                               err_msg=f'hidden states {layer}')
  at = lambda x: np.take_along_axis(x.numpy(), positions[..., None], axis=1)  # noqa: E731
  real_at = np.take_along_axis(real, positions, axis=1)
  if isinstance(reference, transformers.BertForMaskedLM):
    np.testing.assert_allclose(np.asarray(ours['mlm_logits'])[real_at],
                               at(theirs.logits)[real_at], atol=1e-4)
    return
  with torch.no_grad():
    pooled = reference.bert.pooler(theirs.hidden_states[-1]).numpy()
  np.testing.assert_allclose(np.asarray(ours['pooled_output']), pooled, atol=1e-4)
  if heads:
    np.testing.assert_allclose(np.asarray(ours['mlm_logits'])[real_at],
                               at(theirs.prediction_logits)[real_at], atol=1e-4)
    np.testing.assert_allclose(np.asarray(ours['nsp_logits']),
                               theirs.seq_relationship_logits.numpy(), atol=1e-4)


# BERT from HF, and back.

def test_hf_bert_hidden_states_match_transformers(hf_bert, bert_workdir):
  _assert_bert_matches(bert_workdir, hf_bert[1])


def test_a_bert_for_masked_lm_checkpoint_converts_with_a_fresh_pooler(tmp_path):
  # HF's BertForMaskedLM (what run_mlm.py saves) has the MLM head but no pooler.
  source = tmp_path / 'mlm'
  reference = _randomize(transformers.BertForMaskedLM(transformers.BertConfig(
      vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, max_position_embeddings=64)), 3)
  reference.save_pretrained(source, safe_serialization=True)
  (source / 'vocab.txt').write_text(''.join(t + '\n' for t in BERT_VOCAB), encoding='utf-8')
  summary = convert_checkpoint.convert('hf', str(source), str(tmp_path / 'run'))
  assert summary.endswith('initialized: nsp_head/bias, nsp_head/kernel, pooler/bias, '
                          'pooler/kernel.'), summary
  _assert_bert_matches(str(tmp_path / 'run'), reference)


def test_round_trip_hf_to_ours_to_hf_is_exact(hf_bert, bert_workdir, tmp_path):
  summary = convert_checkpoint.export_hf(bert_workdir, str(tmp_path / 'hf'))
  assert 'Left out' not in summary and 'Not in the run' not in summary
  original = load_file(str(hf_bert[0] / 'model.safetensors'))
  exported = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  assert sorted(exported) == sorted(original)
  for name, array in original.items():
    assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name
  # HF saves the decoder's weight and bias, tied to the word embeddings and cls.predictions.bias,
  # once: loaded back, every tensor of the state dict, tied copies included, is the original.
  state = hf_bert[1].state_dict()
  assert set(state) - set(original) == {'cls.predictions.decoder.weight',
                                        'cls.predictions.decoder.bias'}
  reloaded, info = transformers.BertForPreTraining.from_pretrained(
      str(tmp_path / 'hf'), output_loading_info=True)
  assert not any(info.values()), info
  assert set(reloaded.state_dict()) == set(state)
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, state[name]), name
  for key in ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
              'intermediate_size', 'max_position_embeddings', 'type_vocab_size', 'layer_norm_eps',
              'hidden_act', 'initializer_range', 'hidden_dropout_prob', 'pad_token_id'):
    assert getattr(reloaded.config, key) == getattr(hf_bert[1].config, key), key
  tokenizer = transformers.BertTokenizer.from_pretrained(str(tmp_path / 'hf'))
  assert tokenizer.tokenize('W1 w2') == ['[UNK]', 'w2']  # cased, as the original
  assert (tmp_path / 'hf' / 'vocab.txt').read_text() == (hf_bert[0] / 'vocab.txt').read_text()


def test_export_tells_hf_the_positions_the_run_trained(bert_workdir, tmp_path):
  def model_max_length(hf_dir):
    return json.loads((hf_dir / 'tokenizer_config.json').read_text())['model_max_length']

  convert_checkpoint.export_hf(bert_workdir, str(tmp_path / 'released'))
  assert model_max_length(tmp_path / 'released') == 64  # a release trained its whole table
  # A run that trained 16 of its 64 positions (no later phase): HF truncates to 16.
  run = str(tmp_path / 'run')
  shutil.copytree(bert_workdir, run)
  params = trainer.state.load_trained(bert_workdir, 'bert', 'test')[2]
  mngr = checkpoints.manager(run, 2)
  checkpoints.save(mngr, 1, {'step': 1, 'params': params}, {0: {}}, 1, positions=16)
  mngr.wait_until_finished()
  summary = convert_checkpoint.export_hf(run, str(tmp_path / 'hf'))
  assert model_max_length(tmp_path / 'hf') == 16
  assert 'trained positions 0-15 of 64' in summary


def test_converted_workdir_is_a_pretraining_workdir(hf_bert, bert_workdir, tmp_path):
  saved = json.loads(open(os.path.join(bert_workdir, 'config.json')).read())
  assert saved['model_name'] == 'bert' and saved['data']['vocab_file'] == ''
  assert (saved['model']['num_layers'], saved['model']['mlp_dim'], saved['data']['lower_case'],
          saved['data']['max_seq_length']) == (2, 64, False, 64)
  tokenizer = input_pipeline.get_tokenizer(
      trainer.state.load_trained(bert_workdir, 'bert', 'test')[0].data, 100, saved_dir=bert_workdir)
  assert tokenizer.lower_case is False and tokenizer.encode('W1 w2') == [1, 7]
  # Fine-tuning from it: sizes and casing inherited, init_from accepted, the new head reported.
  config = bert_finetune.get_config('offline_shuffled')
  config.init_from = bert_workdir
  run = str(tmp_path / 'run')
  trainer.checks.inherit_unset_fields(config, run)
  trainer.checks.check_init_from(config)
  assert config.model.hidden_size == 32 and config.data.lower_case is False
  model = bert.Model(trainer.checks.model_config(config))
  example = input_pipeline.example_batch(config.data, config.model.vocab_size, batch_size=1)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0),
                                                                        example)['params'])))
  params, new, unused = checkpoints.restore_params(bert_workdir, target)
  assert new == ['classifier/bias', 'classifier/kernel']
  assert 'mlm_output_bias' in unused
  np.testing.assert_array_equal(
      params['layer_1']['mlp']['wi']['kernel'],
      hf_bert[1].bert.encoder.layer[1].intermediate.dense.weight.detach().numpy().T)


def test_export_leaves_out_finetuning_heads(hf_bert, bert_workdir, tmp_path):
  config, _, params, _ = trainer.state.load_trained(bert_workdir, 'bert', 'test')
  config.model.num_labels = 3
  params = {**jax.device_get(params), 'classifier': {'kernel': np.ones((32, 3), np.float32),
                                                     'bias': np.zeros(3, np.float32)}}
  finetuned = str(tmp_path / 'finetuned')
  convert_checkpoint.write_workdir(finetuned, config, params,
                                   os.path.join(bert_workdir, 'vocab.txt'))
  summary = convert_checkpoint.export_hf(finetuned, str(tmp_path / 'hf'))
  assert 'Left out (fine-tuning heads): classifier' in summary
  exported = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  assert sorted(exported) == sorted(load_file(str(hf_bert[0] / 'model.safetensors')))


def test_a_scan_layers_run_exports_as_its_unstacked_layers(hf_bert, bert_workdir, tmp_path):
  config, _, params, _ = trainer.state.load_trained(bert_workdir, 'bert', 'test')
  params = jax.device_get(params)
  layers = [params.pop(f'layer_{i}') for i in range(config.model.num_layers)]
  params['layers'] = {'block': jax.tree.map(lambda *xs: np.stack(xs), *layers)}
  config.model.scan_layers = True
  scanned = str(tmp_path / 'scanned')
  convert_checkpoint.write_workdir(scanned, config, params,
                                   os.path.join(bert_workdir, 'vocab.txt'))
  convert_checkpoint.export_hf(scanned, str(tmp_path / 'hf'))
  exported = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  original = load_file(str(hf_bert[0] / 'model.safetensors'))
  assert sorted(exported) == sorted(original)
  for name, x in original.items():
    np.testing.assert_array_equal(exported[name], x, err_msg=name)


def test_old_bert_model_checkpoint_gets_fresh_heads(tmp_path):
  """A BertModel (no bert. prefix, no cls.* heads) in an older pytorch_model.bin: LayerNorm's
  gamma and beta, and the position_ids buffer."""
  reference = _bert_dir(tmp_path / 'base', base_model_only=True, seed=1)
  os.remove(tmp_path / 'base' / 'model.safetensors')
  state = {k.replace('LayerNorm.weight', 'LayerNorm.gamma').replace('LayerNorm.bias',
                                                                      'LayerNorm.beta'): v
           for k, v in reference.bert.state_dict().items()}
  assert 'embeddings.LayerNorm.gamma' in state and not any(k.startswith('bert.') for k in state)
  torch.save({**state, 'embeddings.position_ids': torch.arange(64)[None]},
             tmp_path / 'base' / 'pytorch_model.bin')
  summary = convert_checkpoint.convert('hf', str(tmp_path / 'base'), str(tmp_path / 'run'))
  heads = ('mlm_transform/kernel', 'mlm_transform/bias', 'mlm_ln/scale', 'mlm_ln/bias',
           'mlm_output_bias', 'nsp_head/kernel', 'nsp_head/bias')
  assert 'Not in the checkpoint, initialized:' in summary
  assert sorted(summary.split('initialized: ')[1].rstrip('.').split(', ')) == sorted(heads)
  _assert_bert_matches(str(tmp_path / 'run'), reference, heads=False)
  assert trainer.state.load_trained(str(tmp_path / 'run'), 'bert', 'test')[3].lower_case is True


def test_missing_unexpected_and_misshapen_tensors_are_named(hf_bert, tmp_path):
  tensors = load_file(str(hf_bert[0] / 'model.safetensors'))
  name = 'bert.encoder.layer.1.attention.self.key.weight'
  cases = (({k: v for k, v in tensors.items() if k != name}, f'no tensor {name}'),
           ({**tensors, 'bert.extra.weight': np.ones(3, np.float32)}, 'bert.extra.weight'),
           ({**tensors, name: tensors[name][:, :16].copy()}, rf'{name} has shape \(32, 16\) '
            r'but our layer_1/attention/key/kernel needs \(32, 32\)'))
  for i, (changed, match) in enumerate(cases):
    source = tmp_path / f'hf{i}'
    shutil.copytree(hf_bert[0], source)
    save_file(changed, str(source / 'model.safetensors'))
    with pytest.raises(ValueError, match=match) as error:
      convert_checkpoint.convert('hf', str(source), str(tmp_path / f'run{i}'))
    assert '\n' not in str(error.value)
    assert not checkpoints.exist(str(tmp_path / f'run{i}'))


# BERT from a google-research/bert TF checkpoint.

def _google_name(hf_name: str) -> tuple[str, bool]:
  """google-research/bert's variable name of an HF tensor, and whether it is transposed."""
  special = {'cls.predictions.bias': 'cls/predictions/output_bias',
             'cls.seq_relationship.weight': 'cls/seq_relationship/output_weights',
             'cls.seq_relationship.bias': 'cls/seq_relationship/output_bias'}
  if hf_name in special:
    return special[hf_name], False
  name = hf_name.replace('.', '/').replace('encoder/layer/', 'encoder/layer_')
  name = name.replace('LayerNorm/weight', 'LayerNorm/gamma').replace('LayerNorm/bias',
                                                                      'LayerNorm/beta')
  if 'embeddings/' in name and name.endswith('_embeddings/weight'):
    return name[:-len('/weight')], False
  return (name[:-len('weight')] + 'kernel', True) if name.endswith('/weight') else (name, False)


def _write_tf_checkpoint(hf_dir, directory):
  import tensorflow as tf  # pinned: a broken install fails, never skips
  os.makedirs(directory)
  graph = tf.Graph()
  with graph.as_default():
    for hf_name, array in load_file(str(hf_dir / 'model.safetensors')).items():
      name, transposed = _google_name(hf_name)
      value = array.T if transposed else array
      tf.compat.v1.Variable(value, name=name)
      for slot in ('adam_m', 'adam_v'):  # optimizer slots, as the released checkpoints have
        tf.compat.v1.Variable(np.zeros_like(value), name=f'{name}/{slot}')
    tf.compat.v1.train.get_or_create_global_step()
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      saver.save(session, os.path.join(directory, 'bert_model.ckpt'), write_meta_graph=False)
  os.remove(os.path.join(directory, 'checkpoint'))  # the release zips have none
  config = json.loads((hf_dir / 'config.json').read_text())
  keys = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
          'intermediate_size', 'hidden_act', 'hidden_dropout_prob', 'attention_probs_dropout_prob',
          'max_position_embeddings', 'type_vocab_size', 'initializer_range')
  with open(os.path.join(directory, 'bert_config.json'), 'w') as f:
    json.dump({k: config[k] for k in keys}, f)
  shutil.copy(hf_dir / 'vocab.txt', directory)


def test_tf_checkpoint_matches_transformers(hf_bert, tmp_path):
  release = tmp_path / 'uncased_L-2_H-32_A-4'
  _write_tf_checkpoint(hf_bert[0], str(release))
  convert_checkpoint.convert('tf', str(release), str(tmp_path / 'run'))
  _assert_bert_matches(str(tmp_path / 'run'), hf_bert[1])
  assert trainer.state.load_trained(str(tmp_path / 'run'), 'bert', 'test')[3].lower_case is True
  # A directory without the release's name is read off its vocabulary: capitalized pieces
  # make it cased (convert() takes casing()'s answer, as for the release above); the flag
  # always decides.
  renamed = tmp_path / 'my_bert'
  shutil.copytree(release, renamed)
  assert convert_checkpoint.casing(str(renamed), 'tf') is True
  vocab = (renamed / 'vocab.txt').read_text(encoding='utf-8').replace('\nw7\n', '\nW7\n')
  assert 'W7' in vocab
  (renamed / 'vocab.txt').write_text(vocab, encoding='utf-8')
  assert convert_checkpoint.casing(str(renamed), 'tf') is False
  convert_checkpoint.convert('tf', str(release), str(tmp_path / 'run3'), lower_case=False)
  assert json.loads((tmp_path / 'run3' / 'config.json').read_text())['data']['lower_case'] is False


# GPT from HF openai-gpt.

@pytest.fixture(scope='module')
def hf_gpt(tmp_path_factory):
  """A random tiny OpenAIGPTLMHeadModel with a lower-cased '</w>' BPE, as HF saves them (in
  shards, model.safetensors.index.json)."""
  from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
  path = tmp_path_factory.mktemp('hf_gpt')
  bpe = Tokenizer(models.BPE(unk_token='<unk>', end_of_word_suffix='</w>'))
  bpe.normalizer = normalizers.BertNormalizer(lowercase=True)
  bpe.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  bpe.train_from_iterator(GPT_TEXT, trainers.BpeTrainer(
      vocab_size=150, special_tokens=['<unk>'], end_of_word_suffix='</w>', show_progress=False))
  bpe.model.save(str(path))  # vocab.json, merges.txt
  vocab_size = len(json.loads((path / 'vocab.json').read_text()))
  model = _randomize(transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(
      vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=4)), 0)
  model.save_pretrained(path, safe_serialization=True, max_shard_size='20KB')  # several files
  return path, model


def test_gpt_hidden_states_and_tokenizer_match_transformers(hf_gpt, tmp_path):
  path, reference = hf_gpt
  assert reference.config.afn == 'gelu'  # HF's openai-gpt computes it with the tanh GELU
  convert_checkpoint.convert('hf', str(path), str(tmp_path / 'run'))
  config, model, params, tokenizer = trainer.state.load_trained(str(tmp_path / 'run'), 'gpt',
                                                                'test')
  V = reference.config.vocab_size
  assert config.model.vocab_size == V + 5 and config.data.lower_case is True
  assert (tokenizer.pad_id, tokenizer.eot_id, tokenizer.extract_id) == (V, V + 1, V + 4)
  table = np.asarray(params['token_embed']['embedding'])
  np.testing.assert_array_equal(table[:V], reference.transformer.tokens_embed.weight.detach())
  assert 0.005 < table[V:].std() < 0.05  # N(0, 0.02) rows for the specials
  ids = np.random.default_rng(0).integers(0, V, (2, 16)).astype(np.int32)
  ours = model.apply({'params': params}, {'input_ids': ids}, deterministic=True)
  with torch.no_grad():
    theirs = reference.transformer(input_ids=torch.tensor(ids, dtype=torch.long),
                                   output_hidden_states=True)
  assert len(ours['hidden_states']) == len(theirs.hidden_states) == 3
  for layer, (a, b) in enumerate(zip(ours['hidden_states'], theirs.hidden_states)):
    np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=1e-4, err_msg=f'layer {layer}')
  with torch.no_grad():
    logits = reference(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours['lm_logits'])[..., :V], logits, atol=1e-4)
  hf_tokenizer = transformers.OpenAIGPTTokenizer.from_pretrained(str(path))
  for text in GPT_SENTENCES:
    assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False)['input_ids'], text
  assert tokenizer.decode(tokenizer.encode('The Quick fox.')) == 'the quick fox .'
  assert tokenizer.encode('<|endoftext|>') != [tokenizer.eot_id]
  # GPT fine-tuning without a size takes the converted model's sizes and casing, no flag needed.
  finetune = gpt_finetune_configs.get_config('offline_shuffled')
  finetune.init_from = str(tmp_path / 'run')
  trainer.checks.inherit_unset_fields(finetune, str(tmp_path / 'finetuned'))
  trainer.checks.check_init_from(finetune)
  assert finetune.model.vocab_size == V + 5 and finetune.data.lower_case is True


def test_converted_gpt_generates_as_transformers_does(hf_gpt, tmp_path):
  """openai-gpt had no end-of-text token: generate.py puts none before the prompt and never
  draws one of the special tokens, whose rows grow_token_embedding drew at random."""
  import generate  # pylint: disable=g-import-not-at-top
  path, reference = hf_gpt
  run = str(tmp_path / 'run')
  convert_checkpoint.convert('hf', str(path), run)
  assert checkpoints.newest_data(run)['eot_trained'] is False
  _, _, _, tokenizer = trainer.state.load_trained(run, 'gpt', 'test')
  prompts = ['the quick brown', 'a dog']
  ours = generate.generate(run, prompts, max_new_tokens=10, temperature=0.0, top_k=0, seed=0)
  for prompt, text in zip(prompts, ours):
    with torch.no_grad():
      theirs = reference.generate(torch.tensor([tokenizer.encode(prompt)]), do_sample=False,
                                  max_new_tokens=10, pad_token_id=0)
    assert text == tokenizer.decode(theirs[0].tolist()), prompt
  with pytest.raises(ValueError, match='give every --prompt some text'):
    generate.generate(run, ['a dog', ''], max_new_tokens=2, temperature=0.0, top_k=0, seed=0)
  # Fine-tuning from it does not train the token either; GPT pretraining from it does.
  before = checkpoints.newest_data(run)
  assert trainer.loop.has_trained_eot(gpt_finetune_configs.get_config('offline_shuffled'),
                                      before) is False
  assert trainer.loop.has_trained_eot(gpt_configs.get_config('tiny'), before) is True


# Bad input.

def test_bad_input_is_one_line(hf_bert, hf_gpt, bert_workdir, tmp_path):
  def refused(match, source, **kwargs):
    with pytest.raises(ValueError, match=match) as error:
      convert_checkpoint.convert(kwargs.pop('fmt', 'hf'), str(source),
                                 kwargs.pop('workdir', str(tmp_path / 'run')), **kwargs)
    assert '\n' not in str(error.value)

  refused('is not a directory', tmp_path / 'missing')
  refused('already holds a checkpoint', hf_bert[0], workdir=bert_workdir)
  for i, (field, value, match) in enumerate((
      ('model_type', 'gpt2', "model_type='gpt2'"), ('hidden_act', 'relu', "hidden_act='relu'"),
      ('position_embedding_type', 'relative_key', 'position_embedding_type'))):
    source = tmp_path / f'hf{i}'
    shutil.copytree(hf_bert[0], source)
    config = json.loads((source / 'config.json').read_text())
    (source / 'config.json').write_text(json.dumps({**config, field: value}))
    refused(match, source)
  source = tmp_path / 'relu_gpt'
  shutil.copytree(hf_gpt[0], source)
  config = json.loads((source / 'config.json').read_text())
  (source / 'config.json').write_text(json.dumps({**config, 'afn': 'relu'}))
  refused("afn='relu'", source)
  refused('drop --lower_case=false', hf_gpt[0], lower_case=False)
  os.remove(source / 'merges.txt')
  (source / 'config.json').write_text(json.dumps(config))
  refused('merges.txt does not exist', source)
  # The command line: one line on stderr, a non-zero exit.
  result = forked.run(
      [sys.executable, 'convert_checkpoint.py', '--from=hf', f'--input={tmp_path}/missing',
       f'--workdir={tmp_path}/cli'], cwd=ROOT)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines() == [
      f'convert_checkpoint.py: error: --input={tmp_path}/missing is not a directory: pass a '
      'checkpoint directory.']


def test_an_export_never_writes_into_a_training_run(tmp_path):
  """HF's config.json would replace the run's: it could no longer be resumed or read."""
  run = tmp_path / 'run'
  (run / 'checkpoints').mkdir(parents=True)
  (run / 'config.json').write_text(json.dumps({'model_name': 'bert'}))
  other = tmp_path / 'other'  # a run whose checkpoints were moved aside: its config.json
  other.mkdir()
  (other / 'config.json').write_text(json.dumps({'model_name': 'gpt'}))
  (tmp_path / 'file').write_text('x')
  for output, why in ((run, 'training run'), (other, 'training run'),
                      (tmp_path / 'file', 'is a file')):
    with pytest.raises(ValueError, match=why) as error:
      convert_checkpoint.check_hf_output(str(run), str(output))
    assert '\n' not in str(error.value)
  hf = tmp_path / 'hf'  # an earlier export of HF's own: model.safetensors decides there
  hf.mkdir()
  (hf / 'config.json').write_text(json.dumps({'model_type': 'bert'}))
  convert_checkpoint.check_hf_output(str(run), str(hf))
  convert_checkpoint.check_hf_output(str(run), str(tmp_path / 'new'))
