"""Retained-memory primitives, shared by the trainer (``leto.trainer``) and the updater
(``leto.updater``), which both import from here; nothing here imports either of them.

* :mod:`leto.retained.slot` - where one tensor lives inside a region;
* :mod:`leto.retained.optim_state` - what a ``torch.optim`` optimizer keeps per parameter,
  and its binding to retained views;
* :mod:`leto.retained.layout` - the byte layout of a rank's retained regions;
* :mod:`leto.retained.marker` - the update marker: step, chunk cursor and phase in one word.
"""
