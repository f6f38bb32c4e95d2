"""An example third-party infer plugin: ``scheduler: sjf`` and ``allocator: stack``.

``INFER_PLUGIN_API`` is the version of infer's plugin API these modules are written to: infer reads it from each
entry-point module or, as here, from the package above them.
"""

INFER_PLUGIN_API = 2
