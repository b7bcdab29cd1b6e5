"""What a PD deployment needs around the connector: ``proxy``, ``launcher`` (serve-pd),
``procs``, ``sweep`` (accuracy sweep) with ``lmeval``, ``report`` and ``tokenizer``, and the
``kvshare`` command line (``cli``). Nothing here imports the connector's internals."""
