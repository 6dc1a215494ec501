"""The distributed kind: a user's own ``torch.distributed`` training step, run on every rank
of a real process group that tyingspec launches (gloo over 127.0.0.1), judged copy by copy.

A tied matrix split across pipeline stages, DP replicas or FSDP shards lives as several
copies; they stay one tie only if every copy's gradient after the user's sync is the
single-process tied gradient and every copy steps the same.  ``target.py`` is the contract
(:class:`DistributedTarget`, the :class:`World` a rank sees), ``launch.py`` starts and ends the
ranks, ``reference.py`` splits the single-process gradient into its components (replica x
micro-batch x path), ``judge.py`` turns the gathered copies into findings and labels,
``adapter.py`` is the kind's call and ``zoo.py`` its built-ins.
"""
