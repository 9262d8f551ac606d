"""Pure loss functions over model outputs; train.py imports objectives.<config.objective>.

Each loss_fn returns (loss, metrics); metrics['loss'] is the pair (loss x n, n) when the loss
is one mean over n (tokens, examples, windows), so that micro-batches weigh by n and
train.grad_accum_steps leaves the step's gradient that of the whole batch (trainer/steps.py);
(loss, 1) when it is a sum of means over different counts (BERT's MLM + NSP, CVT's views;
CVT's labeled steps too, whose losses are logged beside the views').
"""
