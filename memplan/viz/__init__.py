"""Pictures of a step's memory: the predicted run (``memplan estimate --timeline``) and a measured
snapshot beside it (``memplan explain --timeline``).

``track`` turns a timeline or a snapshot's trace into one sequence of allocations with the
allocator's reserved bytes after each; ``series`` samples it into what a picture draws;
``html`` and ``figure``'s SVG (standard library only), ``figure``'s PNG (Pillow, the ``viz``
extra) and ``snapshot`` (PyTorch's ``_dump_snapshot`` pickle) write it. ``output`` checks the path before any work.
"""
