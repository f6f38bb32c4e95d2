"""Kernels: ``infer.kernels.cpu``, infer's C kernels for CPUs (the ``cpu`` attention backend's and the execution
layer's fused paths). Kernels import the public contracts and nothing above them."""
