"""Configuration: the knob table shared by the native core and the launchers.

- :mod:`~spark_dl.config.knobs`: every knob (name, variable, type, default, doc) from
  ``knobs.json``, the value grammar, and the variables the launchers set for workers.

Layering: the lowest Python layer, beside the native extension. It uses only the standard
library and imports nothing else from spark_dl, so launchers and the rendezvous client
read their settings without loading the core.
"""
