"""The writer below its front ends (``api/``): from a captured snapshot to a durable
checkpoint. The backend seam, handle and lifecycle, the background loop, capture and
staging, the plan (what a save writes), the commit (how it becomes durable, alone or
from many ranks), incremental saves, preemption."""
