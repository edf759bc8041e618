"""pdserve's compute kernels: each module holds a Triton kernel, its launcher and a plain-torch ``*_ref``.

The CPU engine runs the references; CUDA runs the Triton kernels. This package is
pdserve's, not Hugging Face's ``kernels`` distribution: it defines no ``__version__``
and tests check that transformers never mistakes it for that package.
"""
