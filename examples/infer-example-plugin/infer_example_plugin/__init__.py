"""An example third-party infer plugin: ``scheduler: sjf`` and ``allocator: stack``."""
