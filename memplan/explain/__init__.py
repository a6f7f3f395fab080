"""``memplan explain``: a PyTorch memory snapshot read against the prediction.

``read`` turns a snapshot's device trace into a :class:`memplan.viz.track.Track` (block sizes
from the allocator model, reserved bytes from the trace's own segment events); ``attribute``
names each allocation's category (from the snapshot's frames, else by aligning it with the
predicted run); ``report`` sums what was live at the peak and compares it with the estimate.
"""
