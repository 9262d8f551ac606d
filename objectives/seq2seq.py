"""Label-smoothed cross entropy of a translation model (Vaswani et al. 2017, sec. 5.4).

The smoothed target puts 1 - eps on the reference token and eps / V on every
token of the vocabulary (Szegedy et al. 2016, sec. 7, which the paper cites),
so the loss is (1 - eps) * NLL + eps * mean_v(-log p_v). Padding (target id 0
outside any segment) has weight 0. Perplexity and accuracy are of the
unsmoothed model, as the paper reports them.

loss.normalize says what the summed loss is divided by: 'tokens' (the target
tokens, as tensor2tensor and flax's WMT example do) or 'sentences' (the target
sentences, as OpenNMT-py's trainer divides its summed NLL by the batch's
sentences: CoVe's MT-LSTM trained so, with SGD at 1 and clipping at 5).
"""

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from input_pipeline import translation
from models import decoding
from objectives import lm

Array = jax.Array


def weights(batch: Mapping[str, Array]) -> Array:
  """1 at real target tokens, 0 at padding."""
  if 'target_segment_ids' in batch:
    return (batch['target_segment_ids'] > 0).astype(jnp.float32)
  return (batch['target_ids'] > 0).astype(jnp.float32)


def smoothed_cross_entropy(logits_XV: Array, targets_X: Array, label_smoothing: float) -> Array:
  """Per-token cross entropy against (1 - eps) * onehot + eps / V, shape X."""
  logp_XV = jax.nn.log_softmax(logits_XV.astype(jnp.float32), axis=-1)
  nll_X = -jnp.take_along_axis(logp_XV, targets_X[..., None], axis=-1)[..., 0]
  if not label_smoothing:
    return nll_X
  return (1.0 - label_smoothing) * nll_X - label_smoothing * logp_XV.mean(axis=-1)


NORMALIZE = ('tokens', 'sentences')  # loss.normalize


def sentences(batch: Mapping[str, Array]) -> Array:
  """The target sentences of a batch: its rows with a target, or its packed segments."""
  if 'target_segment_ids' in batch:
    return batch['target_segment_ids'].max(axis=-1).astype(jnp.float32).sum()
  return (batch['target_ids'] > 0).any(axis=-1).astype(jnp.float32).sum()


def loss_fn(outputs: Mapping[str, Array], batch: Mapping[str, Array], *,
            label_smoothing: float = 0.1, normalize: str = 'tokens'
            ) -> tuple[Array, dict[str, Array]]:
  """Smoothed cross entropy of outputs['logits'] against batch['target_ids'], summed and
  divided by the target tokens or sentences (`normalize`)."""
  if normalize not in NORMALIZE:
    raise ValueError(f'loss.normalize={normalize!r}: use one of {", ".join(NORMALIZE)}.')
  logits_BLV, targets_BL = outputs['logits'], batch['target_ids']
  weights_BL = weights(batch)
  ce_BL = smoothed_cross_entropy(logits_BLV, targets_BL, label_smoothing)
  count = weights_BL.sum()
  ce_sum = jnp.where(weights_BL > 0, ce_BL * weights_BL, 0.0).sum()
  divisor = count if normalize == 'tokens' else sentences(batch)
  loss = ce_sum / jnp.maximum(divisor, 1.0)
  nll, _, correct = lm.token_stats(logits_BLV, targets_BL, weights_BL)
  # One mean, over `divisor` (trainer/steps.py weighs micro-batches by it).
  return loss, {'loss': lm.pair(loss * divisor, divisor), 'smoothed_loss': lm.pair(ce_sum, count),
                'nll': lm.pair(nll, count), 'token_accuracy': lm.pair(correct, count)}


_REPORT_ORDER = ('loss', 'nll', 'perplexity', 'token_accuracy')


def summarize(totals: Mapping[str, np.ndarray]) -> dict[str, float]:
  """Means of the (sum, count) pairs, plus perplexity exp(nll) per target token."""
  return lm.summarize_with_perplexity(totals, 'nll', 'perplexity', _REPORT_ORDER)


def bleu(hypotheses: list[str], references: list[str], lowercase: bool = False) -> float:
  """sacrebleu's corpus BLEU (13a tokenization, as its default signature says); `lowercase`:
  case-insensitive, for a run whose target vocabulary lower-cases (data.lower_case), whose
  hypotheses have no capitals for the references' to match."""
  return float(sacrebleu.corpus_bleu(hypotheses, [references], lowercase=lowercase).score)


def lowercases_targets(tokenizer) -> bool:
  """Whether the run's target text is lower-cased (CoVe's SourceWords: its target BPE's)."""
  return bool(getattr(getattr(tokenizer, 'target', tokenizer), 'lower_case', False))


def eval_metrics(config, model, params, tokenizer) -> dict[str, float]:
  """BLEU of config.decode.bleu_examples eval pairs, decoded as config.decode says (beam 4,
  alpha 0.6 in the paper, sec. 6.1); none when it is 0. The loop adds these to each eval."""
  examples = config.get('decode', {}).get('bleu_examples')
  if not examples:
    return {}
  pairs = translation.eval_pairs(config.data, examples)
  d = config.decode
  hypotheses = decoding.translate(model, params, tokenizer, [p[0] for p in pairs],
                                  beam_size=d.beam_size, alpha=d.alpha,
                                  max_extra_length=d.max_extra_length, batch_size=d.batch_size)
  return {'bleu': bleu(hypotheses, [p[1] for p in pairs], lowercases_targets(tokenizer))}
