"""The attention engines behind ``dilated_attention``: each computes exactly what
``reference.reference_attention`` computes (``chunked.py`` picks among the PyTorch ones, ``ops.py``
between them and the Triton kernels)."""
