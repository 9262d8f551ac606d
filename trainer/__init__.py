"""The training system that train.py and the other programs share.

    checks.py         config checks, each mistake one line naming the fix
    optimizer.py      optimizers, schedules, frozen and weight-decay masks
    state.py          the sharded train state; `build` (model, objective, steps); a new
                      run's state (`initial_state`); loading a trained workdir's parameters
                      (`load_trained`, `init_params`)
    steps.py          the jitted train and eval steps
    evaluation.py     eval on the held-out split, and an objective's `eval_metrics` hook
    loop.py           `train_and_evaluate`: setup, the loop, logs, evals, checkpoints
    phases.py         a run's phases (BERT: 90% of the steps at 128 tokens, then 512)
    checkpoints.py    orbax checkpoints with the data position; unreadable ones set aside
    sharding.py       the mesh, logical-axis shardings, global batches
    metric_writer.py  console, metrics.jsonl, TensorBoard
    cli.py            --config loading shared by the programs
"""
