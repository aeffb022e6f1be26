"""The schedulers: the batching stage's second kind of plug-in, beside the batchers.

A batcher (:mod:`paella.dispatcher.batchers`) hands the stage whole batches; a scheduler
drives its own jobs. Every scheduler of the project lives here, one module or package
each, and each is built the same way:

* it subclasses :class:`~paella.dispatcher.batchers.base.SchedulerBatcher` and reaches
  the dispatcher only through the
  :class:`~paella.dispatcher.batchers.base.SchedulerContext` it is started with
  (registering its internal models, submitting jobs for clients, device memory,
  answering requests), plus what a job it registers runs (``JobAdaptor``, ``cudart``);
  pyproject.toml's import-linter contract keeps this package off the dispatcher's
  internals;
* it is declared in the entry-point group ``paella.batchers`` (pyproject.toml), exactly
  as a third party's scheduler would be, and found by name through the batchers' one
  registry (``[batching] batcher = "..."`` in a model's ``config.toml``).

The schedulers:

* ``orca`` (:mod:`.orca_plugin`): Orca's iteration-level scheduling of a GPT
  (:mod:`.generation`, :mod:`.iteration_scheduler`);
* ``cellular`` (:mod:`.cellular_plugin`): BatchMaker's cellular batching of LSTM,
  Seq2Seq and TreeLSTM cells (:mod:`.cell_engine`, :mod:`.cell_scheduler`);
* ``dvabatch`` (:mod:`.dvabatch`): DVABatch's multi-entry multi-exit batching over a
  model's stages;
* the engines they and the experiments share: the step runtime (:mod:`.runtime`: every
  batched step a job), BatchMaker's cellular batching (:mod:`.cell_scheduler`,
  :mod:`.graph`, :mod:`.rnn_engine`), the padded baselines (:mod:`.padding`).

Outside the daemon (experiments, benchmarks, tests in virtual time) the caller builds a
context on its dispatcher (:func:`paella.dispatcher.batchers.stage.scheduler_context`)
and drives the engine through it, so there is one host contract everywhere.
"""
